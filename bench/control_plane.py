"""The node's own throughput: creates per minute with a guest that costs nothing, beside raw VMM restores.

A real node (`aenv-node serve`, fresh state directory) runs Firecracker under this host's KVM, and the tests'
tiny PVH guest is imported as a template without envd (`POST /node/vm-templates`): its restore is ~13 ms
and it has nothing to initialise, so what a create costs beyond that is the node's (the API, SQLite, the
network slot, the disk in the data plane, the VMM's spawn). For each concurrency C in --concurrency, C
clients loop `POST /sandboxes` then `DELETE /sandboxes/{id}` (plain HTTP, as the SDK sends them) for
--seconds; measured: creates per minute, create latency p50/p99, and the CPU (user + system) the control
plane and the data plane used per create -> kill cycle (the VMMs' and guests' own not in it).

The floor, in the same run: the node's template snapshot restored with the same driver alone
(`FirecrackerDriver.restore`, its disk a plain file, a tap in a namespace of the bench's), restore -> running
-> stop, in a loop, at C=1 and at the largest C (one namespace per loop): restores per minute.

`--profile`: py-spy samples the control plane during the largest C's phase (the top frames in the JSON).

Writes bench/results/control_plane.json; the last line printed is a one-line summary.

Run: .venv/bin/python bench/control_plane.py [--concurrency 1,4,16] [--seconds 20] [--floor-seconds 10]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from aenv_node.vmm import FirecrackerDriver  # noqa: E402
from tests.vmm.tinyguest import build_tiny_guest  # noqa: E402
from _floor import BenchNetns, flat_disk, floor_files, snapshot_files, template_snapshot_id, vm_config  # noqa: E402
from _node import BenchNode, profiled, run_node, sigterm_as_interrupt  # noqa: E402
from _results import result_path  # noqa: E402

ALIAS = "tiny"


def pct(v: list[float], p: float) -> float:
    s = sorted(v)
    return s[min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))]


def dist_ms(samples_s: list[float]) -> dict[str, float]:
    if not samples_s:
        return {}
    ms = [x * 1000 for x in samples_s]
    return {"p50_ms": round(pct(ms, 50), 1), "p99_ms": round(pct(ms, 99), 1), "n": len(ms)}


def import_tiny(node: BenchNode, work: Path) -> dict[str, Any]:
    elf = build_tiny_guest(work / "tiny")
    with node.api() as c:
        r = c.post("/node/vm-templates", params={"alias": ALIAS, "memoryMB": 64, "readyConsole": "AENV BOOT"},
                   content=elf.read_bytes(), headers={"content-type": "application/octet-stream"})
    if r.status_code != 201:
        raise RuntimeError(f"importing the tiny guest failed: {r.status_code} {r.text}")
    return dict(r.json())


def create_loop(node: BenchNode, concurrency: int, seconds: float) -> dict[str, Any]:
    """C clients creating and killing sandboxes for ``seconds``; rates, latencies and the node's CPU."""
    latencies: list[float] = []
    kills: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()
    stop_at = time.monotonic() + seconds

    def client() -> None:
        with httpx.Client(base_url=node.url, headers={"X-API-KEY": node.api_key}, timeout=60) as c:
            while time.monotonic() < stop_at:
                t = time.perf_counter()
                r = c.post("/sandboxes", json={"templateID": ALIAS, "timeout": 120})
                created = time.perf_counter() - t
                if r.status_code != 201:
                    with lock:
                        errors.append(f"create {r.status_code}: {r.text[:200]}")
                    time.sleep(0.2)
                    continue
                t = time.perf_counter()
                k = c.delete(f"/sandboxes/{r.json()['sandboxID']}")
                killed = time.perf_counter() - t
                with lock:
                    latencies.append(created)
                    kills.append(killed)
                    if k.status_code != 204:
                        errors.append(f"kill {k.status_code}: {k.text[:200]}")

    cpu0 = node.cpu_s()
    t0 = time.monotonic()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    cpu1 = node.cpu_s()
    n = len(latencies)
    cpu = {k: round((cpu1[k] - cpu0[k]) * 1000 / n, 1) if n else None for k in cpu1 if k in cpu0}
    return {"concurrency": concurrency, "seconds": round(wall, 1), "creates": n,
            "creates_per_min": round(n * 60 / wall, 1), "create": dist_ms(latencies), "kill": dist_ms(kills),
            "node_cpu_ms_per_cycle": cpu,
            "node_cpu_ms_per_cycle_total": round(sum(v for v in cpu.values() if v is not None), 1),
            "errors": errors[:10], "error_count": len(errors)}  # fmt: skip


async def floor_loop(snap: dict[str, Any], work: Path, concurrency: int, seconds: float) -> dict[str, Any]:
    """Raw Firecracker restore -> running -> stop of the same snapshot, in ``concurrency`` loops."""
    driver = FirecrackerDriver()
    restores: list[float] = []
    cycles = 0
    disk = work / "floor-disk.raw"
    if not disk.exists():
        flat_disk(snap, disk)

    async def loop(i: int, netns: BenchNetns) -> None:
        nonlocal cycles
        n = 0
        while time.monotonic() < stop_at:
            wd = work / f"floor-{i}-{n}"
            wd.mkdir(parents=True)
            own = wd / "disk.raw"
            shutil.copyfile(disk, own)  # (a plain file per VM, as each sandbox has its own disk)
            cfg = vm_config(snap, wd, own, netns.path, f"aenv-cpfloor-{os.getpid()}-{i}")
            t = time.perf_counter()
            async with driver.restore(cfg, floor_files(snap, wd)):
                restores.append(time.perf_counter() - t)
            cycles += 1
            shutil.rmtree(wd, ignore_errors=True)
            n += 1

    nets = [BenchNetns(i, prefix="aenvcp") for i in range(concurrency)]
    for ns in nets:
        ns.__enter__()
    try:
        t0 = time.monotonic()
        stop_at = t0 + seconds
        async with trio.open_nursery() as nursery:
            for i, ns in enumerate(nets):
                nursery.start_soon(loop, i, ns)
        wall = time.monotonic() - t0
    finally:
        for ns in nets:
            ns.__exit__()
    return {"concurrency": concurrency, "seconds": round(wall, 1), "restores": cycles,
            "restores_per_min": round(cycles * 60 / wall, 1), "restore": dist_ms(restores)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", default="1,4,16", help="client counts, each a phase")
    ap.add_argument("--seconds", type=float, default=20.0, help="length of each phase")
    ap.add_argument("--floor-seconds", type=float, default=10.0, help="length of each raw restore loop")
    ap.add_argument("--profile", action="store_true", help="py-spy the control plane in the largest phase")
    ap.add_argument("--profile-raw", default=None, help="with --profile: keep py-spy's collapsed stacks here")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    levels = [int(x) for x in args.concurrency.split(",") if x]
    results: dict[str, Any] = {"bench": "control_plane", "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                               "loadavg_start": list(os.getloadavg()), "args": vars(args)}  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix="aenv-cp-", dir="/var/tmp"))
    try:
        with sigterm_as_interrupt(), run_node(template=None, extra_env={
                "AENV_VMM_KIND": "firecracker", "AENV_VMM_ACCEL": "kvm", "AENV_TEMPLATES_BUILD_DEFAULT": "false",
                # slots prepared ahead for every client, so a create takes a warm one as in steady state
                "AENV_NET_WARM_SLOTS": str(max(levels) + 2)}) as node:
            results["import"] = import_tiny(node, work)
            print(f"imported the tiny guest: boot {results['import']['bootMs']} ms, capture "
                  f"{results['import']['captureMs']} ms", flush=True)
            create_loop(node, 1, min(3.0, args.seconds))  # warm-up: the first creates fill caches
            phases = []
            for c in levels:
                if args.profile and c == max(levels):
                    raw = work / "profile.raw"
                    with profiled(node.proc.pid, raw) as prof:
                        phase = create_loop(node, c, args.seconds)
                    phase["profile"] = prof
                    if args.profile_raw:
                        shutil.copyfile(raw, args.profile_raw)
                else:
                    phase = create_loop(node, c, args.seconds)
                phases.append(phase)
                print(f"  C={c}: {phase['creates_per_min']} creates/min, create p50 {phase['create'].get('p50_ms')} "
                      f"ms p99 {phase['create'].get('p99_ms')} ms, kill p50 {phase['kill'].get('p50_ms')} ms; node "
                      f"CPU {phase['node_cpu_ms_per_cycle']} ms per cycle; errors {phase['error_count']}",
                      flush=True)  # fmt: skip
            results["node"] = phases
            snap = snapshot_files(node.state_dir, template_snapshot_id(node.state_dir, ALIAS))
            floors = []
            for c in levels:
                fl = trio.run(floor_loop, snap, work, c, args.floor_seconds)
                floors.append(fl)
                print(f"  floor C={c}: {fl['restores_per_min']} raw restores/min, restore p50 "
                      f"{fl['restore'].get('p50_ms')} ms", flush=True)
            results["floor"] = floors
    finally:
        shutil.rmtree(work, ignore_errors=True)
    by_c = {f["concurrency"]: f for f in results["floor"]}
    for phase in results["node"]:
        fl = by_c.get(phase["concurrency"]) or by_c.get(1)
        phase["vs_floor"] = round(phase["creates_per_min"] / fl["restores_per_min"], 3) if fl else None
    best = max(results["node"], key=lambda p: p["creates_per_min"])
    results["summary"] = (
        "control_plane: " + ", ".join(f"C={p['concurrency']} {p['creates_per_min']:.0f}/min "
                                      f"(create p50 {p['create'].get('p50_ms')} ms, node CPU "
                                      f"{p['node_cpu_ms_per_cycle_total']} ms/cycle)" for p in results["node"])
        + "; raw Firecracker restores " + ", ".join(f"C={f['concurrency']} {f['restores_per_min']:.0f}/min "
                                                    f"(p50 {f['restore'].get('p50_ms')} ms)" for f in results["floor"])
        + f"; best {best['creates_per_min']:.0f} creates/min = {best['vs_floor']}x the floor's rate; goal 3,300/min "
        f"and < 15 ms node CPU per create; load {results['loadavg_start'][0]:.2f} at start")
    out = Path(args.out) if args.out else result_path("control_plane")
    out.write_text(json.dumps(results, indent=1))
    print(results["summary"])


if __name__ == "__main__":
    main()
