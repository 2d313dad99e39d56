"""The data plane: what a control-plane restart costs running sandboxes, and what the second process costs them.

Two nodes, one after the other (bench/_node.py: fresh state, loopback only), each with --sandboxes running
sandboxes of the ``base`` template:

* with the data plane (``node.data_plane = true``, the default): the node is killed with SIGKILL and started
  again on the same state, first with no sandbox running (the floor: a restart that takes over nothing), then
  with the sandboxes running; the take-over is timed from the new process's start to every sandbox answering a
  command through the E2B SDK (all of them still on their VMM, their background process alive). The data
  plane's RSS is read with the sandboxes running.
* on both nodes, with and without the data plane (``false``: the node's own process serves the disks): the
  SDK ``pause()`` + ``connect()`` of a sandbox that wrote --write-mib since its resume (--rounds times), and a
  guest's ``dd ... conv=fsync`` write throughput through its disk (NBD served by the data plane, or by the
  node's process).

Prints one line per figure and writes bench/results/dataplane.json. Ratios: take-over / floor restart, and
each with-data-plane figure / the same without it.

Run: .venv/bin/python bench/dataplane.py [--sandboxes 4] [--rounds 5] [--write-mib 16]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from _node import BenchNode, NodeStartError, run_node, sigterm_as_interrupt  # noqa: E402
from _stats import ms, utc_now  # noqa: E402
from _results import result_path  # noqa: E402


def restart(node: BenchNode) -> float:
    """SIGKILL the node and start it again on its state and port; seconds from the new process to /health."""
    node.proc.send_signal(signal.SIGKILL)
    node.proc.wait()
    port = node.url.rsplit(":", 1)[1]
    with open(node.log_path, "ab") as log:
        t0 = time.monotonic()
        node.proc = subprocess.Popen(
            [sys.executable, "-m", "aenv_node.cli.node", "serve", "--listen", f"127.0.0.1:{port}"],
            env={**os.environ, **node.env}, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            cwd=str(ROOT), start_new_session=True)
    while True:
        node.check_alive()
        try:
            if httpx.get(node.url + "/health", timeout=1).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        if time.monotonic() - t0 > 120:
            raise NodeStartError(f"node did not answer /health after its restart:\n{node.log_tail()}")
        time.sleep(0.02)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def lifecycle(sb: Any, args: argparse.Namespace) -> dict[str, float]:
    """Pause + connect rounds of one sandbox, and its disk's fsync'd write throughput."""
    from e2b import Sandbox

    pauses, resumes = [], []
    for i in range(args.rounds):
        sb.commands.run(f"head -c {args.write_mib}M /dev/urandom > /home/user/w{i}.bin && sync")
        t = time.monotonic()
        sb.pause()
        pauses.append(time.monotonic() - t)
        t = time.monotonic()
        sb = Sandbox.connect(sb.sandbox_id)
        resumes.append(time.monotonic() - t)
    out = sb.commands.run("dd if=/dev/zero of=/home/user/dd.bin bs=1M count=128 conv=fsync 2>&1 | tail -1").stdout
    # "134217728 bytes (134 MB, 128 MiB) copied, 1.2 s, 112 MB/s"
    seconds = float(out.split("copied,")[1].split("s,")[0])
    sb.kill()
    return {"pause_p50_ms": ms(statistics.median(pauses)), "resume_p50_ms": ms(statistics.median(resumes)),
            "dd_fsync_mib_s": round(128 / seconds, 1)}


def one_node(data_plane: bool, args: argparse.Namespace) -> dict[str, Any]:
    from e2b import Sandbox

    env = {"AENV_NODE_DATA_PLANE": "true" if data_plane else "false", "AENV_NET_WARM_SLOTS": "2"}
    out: dict[str, Any] = {}
    with run_node(extra_env=env) as node:
        os.environ.update(node.sdk_env())
        if data_plane:
            out["restart_floor_s"] = round(restart(node), 3)
        out.update(lifecycle(Sandbox.create(timeout=900), args))
        if not data_plane:
            return out
        sandboxes = [Sandbox.create(timeout=900) for _ in range(args.sandboxes)]
        sleepers = {sb.sandbox_id: sb.commands.run("sleep 100000", background=True, timeout=0).pid
                    for sb in sandboxes}
        plane = _dataplane_pid(node)
        out["dataplane_rss_mib"] = round(rss_mib(plane), 1)
        out["node_rss_mib"] = round(rss_mib(node.proc.pid), 1)
        t0 = time.monotonic()
        health = restart(node)
        for sb in sandboxes:  # every one answers, on the same VMM, its process alive
            back = Sandbox.connect(sb.sandbox_id)
            assert back.commands.run(f"kill -0 {sleepers[sb.sandbox_id]} && echo ok").stdout == "ok\n"
        out["takeover_health_s"] = round(health, 3)
        out["takeover_all_answer_s"] = round(time.monotonic() - t0, 3)
        for sb in sandboxes:
            Sandbox.kill(sb.sandbox_id)
    return out


def _dataplane_pid(node: BenchNode) -> int:
    out = subprocess.run([sys.executable, "-m", "aenv_node.cli.node", "dataplane", "status"], cwd=str(ROOT),
                         env={**os.environ, **node.env}, capture_output=True, text=True, check=True).stdout
    return int(out.split("pid ")[1].split(":")[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sandboxes", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--write-mib", type=int, default=16)
    args = ap.parse_args()
    with sigterm_as_interrupt():
        with_dp = one_node(True, args)
        without = one_node(False, args)
    ratios = {
        "takeover_over_floor_restart": round(with_dp["takeover_all_answer_s"] / with_dp["restart_floor_s"], 2),
        "pause_with_over_without": round(with_dp["pause_p50_ms"] / without["pause_p50_ms"], 2),
        "resume_with_over_without": round(with_dp["resume_p50_ms"] / without["resume_p50_ms"], 2),
        "dd_fsync_with_over_without": round(with_dp["dd_fsync_mib_s"] / without["dd_fsync_mib_s"], 2),
    }
    result = {"bench": "dataplane", "at": utc_now(), "args": vars(args), "with_data_plane": with_dp,
              "without_data_plane": without, "ratios": ratios}
    out = result_path("dataplane")
    out.write_text(json.dumps(result, indent=1) + "\n")
    for k, v in {**{f"with.{k}": v for k, v in with_dp.items()},
                 **{f"without.{k}": v for k, v in without.items()}, **ratios}.items():
        print(f"{k}: {v}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
