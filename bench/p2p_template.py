"""N real nodes start sandboxes from the same new template, with and without P2P: the bytes each reads from the
shared repository and from its peers, and how long its first create and a full read of the template's data take.

A real cluster on 127.0.0.1 per mode (P2P off, then on): redis-server (unix socket), ``aenv-node scheduler`` and
N real nodes (``aenv-node serve``, bench/_node.py: fresh state, own slot pool, the cluster's key, one shared
posix_fs repository, ``p2p.enabled`` as the mode says). On n1 a sandbox from ``base`` writes a file of random
data and is snapshotted (E2B ``create_snapshot``): a new template, published to the repository in the
background. Then n2 ... nN, one after the other, each create a sandbox from it (the node imports the template)
and read the whole file in the guest (``sha256sum``): the memory image is materialized through the node's cache,
the disk read through its data plane's. Each node's repository and peer bytes are the deltas of its ``/metrics``
around that (``aenv_cache_*`` and ``aenv_dataplane_cache_*``: both caches).

The first importer (n2) finds no peer holding the template (n1 made it from local files: its caches hold none
of it), so it reads the repository in both modes; with P2P every later node reads from the nodes before it. The
figure is the total repository bytes with P2P against without (the floor is one node's worth).

Guests are Linux under QEMU TCG on this 2-core machine: times are dominated by emulation and only indicative.
Everything listens on 127.0.0.1; every process is stopped by its PID and every state directory removed, also
on ^C or SIGTERM. Writes bench/results/p2p_template.json.

    flock /tmp/aenv-vm.lock .venv/bin/python bench/p2p_template.py [--nodes 3] [--file-mib 64]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from e2b import Sandbox

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _node import free_port, run_node, sigterm_as_interrupt  # noqa: E402
from _stats import utc_now  # noqa: E402
from cluster import KEY, redis_and_scheduler, wait_registered  # noqa: E402
from _results import result_path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20
COUNTERS = ("repository_bytes", "peer_bytes")


def scrape(url: str) -> dict[str, float]:
    """A node's cache counters (both caches summed): repository and peer bytes."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    out = dict.fromkeys(COUNTERS, 0.0)
    for line in text.splitlines():
        for prefix in ("aenv_cache_", "aenv_dataplane_cache_"):
            for name in COUNTERS:
                if line.startswith(f"{prefix}{name}_total "):
                    out[name] += float(line.rsplit(" ", 1)[1])
    return out


def run_mode(p2p: bool, n_nodes: int, file_mib: int) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="aenv-bench-p2pt-", dir="/var/tmp"))
    mode: dict[str, Any] = {"p2p": p2p, "nodes": []}
    try:
        with contextlib.ExitStack() as stack:
            sched_url, _sched = redis_and_scheduler(stack, tmp)
            sched = stack.enter_context(httpx.Client(base_url=sched_url, headers={"X-API-KEY": KEY}, timeout=30))
            nodes = []
            for n in range(1, n_nodes + 1):
                port = free_port()
                nodes.append(stack.enter_context(run_node(port=port, api_key=KEY, extra_env={
                    "AENV_NODE_NODE_ID": f"n{n}", "AENV_CLUSTER_SCHEDULER_URL": sched_url,
                    "AENV_CLUSTER_ADVERTISE_URL": f"http://127.0.0.1:{port}",
                    "AENV_CLUSTER_HEARTBEAT_INTERVAL_S": "0.5",
                    "AENV_STORAGE_REPOSITORY_PATH": str(tmp / "repository"),
                    "AENV_P2P_ENABLED": "true" if p2p else "false"})))
            wait_registered(sched, [f"n{n}" for n in range(1, n_nodes + 1)], timeout=120)

            def on(node: Any) -> dict[str, str]:
                return {"api_url": node.url, "sandbox_url": node.url, "api_key": KEY}

            maker = Sandbox.create("base", timeout=600, **on(nodes[0]))  # type: ignore[arg-type]
            maker.commands.run(f"head -c {file_mib}M /dev/urandom > /home/user/big && sync", timeout=600)
            want = maker.commands.run("sha256sum /home/user/big", timeout=600).stdout.split()[0]
            template = maker.create_snapshot().snapshot_id
            maker.kill()
            record = tmp / "repository" / "manifests" / f"template-{template}.json"
            deadline = time.monotonic() + 600
            while not record.exists():
                if time.monotonic() > deadline:
                    raise RuntimeError("the template was not published")
                time.sleep(0.2)
            for i, node in enumerate(nodes[1:], start=2):
                before = scrape(node.url)
                t0 = time.monotonic()
                sb = Sandbox.create(template, timeout=600, **on(node))  # type: ignore[arg-type]
                created = time.monotonic() - t0
                got = sb.commands.run("sha256sum /home/user/big", timeout=600).stdout.split()[0]
                total = time.monotonic() - t0
                sb.kill()
                after = scrape(node.url)
                if got != want:
                    raise RuntimeError(f"n{i} read other bytes than n1 wrote")
                row = {"node": f"n{i}", "create_s": round(created, 2), "create_and_read_s": round(total, 2),
                       **{f"{k}_mib": round((after[k] - before[k]) / MiB, 1) for k in COUNTERS}}
                mode["nodes"].append(row)
                print(f"  p2p={'on ' if p2p else 'off'} {row['node']}: repository {row['repository_bytes_mib']} MiB, "
                      f"peers {row['peer_bytes_mib']} MiB, create {row['create_s']} s, create+read "
                      f"{row['create_and_read_s']} s", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    mode["repository_mib"] = round(sum(r["repository_bytes_mib"] for r in mode["nodes"]), 1)
    mode["peer_mib"] = round(sum(r["peer_bytes_mib"] for r in mode["nodes"]), 1)
    return mode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=3, help="nodes in each cluster (n1 makes the template)")
    ap.add_argument("--file-mib", type=int, default=64, help="random data the template's disk holds")
    ap.add_argument("--out", type=Path, default=result_path("p2p_template"))
    args = ap.parse_args()
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:  # a background job: see bench/cluster.py
        signal.signal(signal.SIGINT, signal.default_int_handler)
    results: dict[str, Any] = {"bench": "p2p_template", "started_at": utc_now(),
                               "host": {"cpus": os.cpu_count(), "loadavg_at_start": list(os.getloadavg())},
                               "config": {"nodes": args.nodes, "file_mib": args.file_mib}, "modes": []}
    with sigterm_as_interrupt():
        for p2p in (False, True):
            results["modes"].append(run_mode(p2p, args.nodes, args.file_mib))
    off, on = results["modes"]
    results["repository_ratio_on_over_off"] = round(on["repository_mib"] / off["repository_mib"], 3) \
        if off["repository_mib"] else None
    print(f"repository MiB read by n2..n{args.nodes}: P2P off {off['repository_mib']}, on {on['repository_mib']} "
          f"(x{results['repository_ratio_on_over_off']}); from peers with P2P: {on['peer_mib']} MiB", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
