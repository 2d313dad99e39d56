"""The production path's overhead: the node's create, pause, resume, snapshot and fork under Firecracker (and
QEMU) with KVM on a KVM host, against the raw VMM operations on the same template snapshot, in the same run.

The KVM host is the TCG VM of tests/kvmhost (nested SVM: the sandboxes are real Linux guests under Firecracker
with KVM, emulated twice over), so absolute times are meaningless; the ratios node / raw are the point.

  node   through the unmodified E2B SDK from this machine (the API forwarded into the VM): create
         (``Sandbox.create``), pause (``sandbox.pause()``), resume (``Sandbox.connect``), snapshot
         (``create_snapshot``), fork of two (``fork(count=2)``); R rounds, medians. Also the node's own steps
         from its events (restore step; per capture: guest paused, memory layer, flat memory image).
  raw    inside the VM, after the node's rounds (tests/kvmhost/raw_ops.py). Firecracker: raw API calls over its
         socket, none of our code: restore = new process + ``/snapshot/load`` + resume; pause = Paused + Diff
         ``/snapshot/create``; snapshot = pause + Diff + Resumed; fork of two = one Diff of the parent + two
         restores. QEMU: our VMM driver alone (QEMU has no one-call diff snapshot), the same four operations.

The node's create and resume are compared with raw restore, fork with raw fork. Writes
bench/results/kvmhost.json; the last line printed is a one-line summary.

Run: .venv/bin/python bench/kvmhost.py [--rounds 3] [--vmm firecracker,qemu]   (one KVM host VM per VMM, in turn)
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.kvmhost import vm  # noqa: E402
from tests.kvmhost.conftest import _wait_base  # noqa: E402
from _results import result_path  # noqa: E402


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def node_ops(host: vm.KvmHost, rounds: int) -> dict[str, float]:
    import os

    os.environ.update(host.env())
    from e2b import Sandbox

    res: dict[str, list[float]] = {"create": [], "pause": [], "resume": [], "snapshot": [], "fork2": []}
    for _ in range(rounds):
        d, sb = timed(lambda: Sandbox.create())
        sb.commands.run("true")
        res["create"].append(d + 0)
        d, _ = timed(lambda: sb.create_snapshot())
        res["snapshot"].append(d)
        d, _ = timed(sb.pause)
        res["pause"].append(d)
        d, sb2 = timed(lambda: Sandbox.connect(sb.sandbox_id))
        sb2.commands.run("true")
        res["resume"].append(d)
        d, kids = timed(lambda: sb2.fork(count=2))
        res["fork2"].append(d)
        for k in kids:
            k.kill()
        sb2.kill()
        print("node round:", {k: round(v[-1], 2) for k, v in res.items()}, flush=True)
    return {k: statistics.median(v) for k, v in res.items()}


def node_steps(host: vm.KvmHost) -> dict[str, float]:
    """Where the node's time went, from its own events (the VM's SQLite), medians in seconds: the restore step
    of creates, resumes and forks (``restore_ms``: disk, slot, VMM restore, before envd ``/init``), and the
    steps of each capture kind's commit (guest paused, capture, memory layer, flat memory image)."""
    by: dict[str, list[float]] = {}
    for r in host.sql("SELECT operation, json_extract(detail, '$.restore_ms') AS ms FROM events "
                      "WHERE to_state = 'running' AND json_extract(detail, '$.restore_ms') IS NOT NULL"):
        by.setdefault(f"restore_step_{r['operation']}", []).append(float(r["ms"]) / 1000)
    steps = ("paused_ms", "capture_ms", "memory_layer_ms", "flat_image_ms")
    cols = ", ".join(f"json_extract(detail, '$.{k}') AS {k}" for k in steps)
    for r in host.sql(f"SELECT json_extract(detail, '$.kind') AS kind, {cols} FROM events "
                      "WHERE operation = 'snapshot_commit' AND to_state = 'committed'"):
        for k in steps:
            if r.get(k) is not None:
                by.setdefault(f"{r['kind']}_{k[:-3]}", []).append(float(r[k]) / 1000)
    return {k: statistics.median(v) for k, v in sorted(by.items())}


def raw_ops(host: vm.KvmHost, vmm: str, rounds: int) -> dict[str, float]:
    out = host.sh(f"/opt/aenv-node/venv/bin/python /opt/aenv-node/src/raw_ops.py {vmm} {rounds} 2>&1",
                  timeout_s=1800)
    line = next((ln for ln in out.splitlines()[::-1] if ln.startswith("{")), None)
    if line is None:
        raise RuntimeError(f"raw_ops.py printed no result:\n{out[-3000:]}")
    return dict(json.loads(line))


PAIRS = {"create": "restore", "resume": "restore", "pause": "pause", "snapshot": "snapshot", "fork2": "fork2"}


def measure(vmm: str, rounds: int) -> dict[str, Any]:
    """One KVM host VM whose node runs ``vmm``: the node's rounds through the SDK, then the raw floor inside."""
    run_dir = Path(tempfile.mkdtemp(prefix=f"aenv-kvmhost-bench-{vmm}-", dir="/var/tmp"))
    try:
        host = vm.up(run_dir, vmm=vmm, shell=True, progress=lambda m: print("kvmhost:", m, flush=True))
        _wait_base(host)
        node = node_ops(host, rounds)
        node.update(node_steps(host))
        raw = raw_ops(host, vmm, rounds)
    finally:
        vm.down(run_dir)
        if (run_dir / "console.log").exists():  # for post-mortems: the run directory goes away
            shutil.copy(run_dir / "console.log", Path(f"/var/tmp/aenv-kvmhost-bench-{vmm}-last-console.log"))
        shutil.rmtree(run_dir, ignore_errors=True)
    ratios = {op: node[op] / raw[floor] for op, floor in PAIRS.items()}
    for op, floor in PAIRS.items():
        print(f"{vmm:11s} {op:9s} node {node[op] * 1000:8.0f} ms   raw {floor:8s} {raw[floor] * 1000:8.0f} ms   "
              f"x{ratios[op]:.1f}", flush=True)
    return {"node_s": node, "raw_s": raw, "node_over_raw": ratios}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--vmm", default="firecracker,qemu", help="comma-separated: firecracker, qemu")
    args = ap.parse_args()
    vmms = [v for v in args.vmm.split(",") if v]
    result: dict[str, Any] = {"when": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                              "rounds": args.rounds, "pairs": PAIRS,
                              "note": "nested: the VMM with KVM inside a QEMU TCG VM; compare ratios, not absolute "
                                      "times"}
    for vmm in vmms:
        result[vmm] = measure(vmm, args.rounds)
    out = result_path("kvmhost")
    out.write_text(json.dumps(result, indent=1) + "\n")
    print("kvmhost " + "; ".join(f"{vmm}: " + " ".join(f"{op}=x{r:.1f}" for op, r in result[vmm]["node_over_raw"].items())
                                 for vmm in vmms) + f" (wrote {out})")


if __name__ == "__main__":
    main()
