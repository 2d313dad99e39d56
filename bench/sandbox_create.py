"""Sandbox create-to-first-command latency and create throughput through the unmodified E2B SDK, against
the raw VMM restore floors measured in the same run.

A real node (`aenv-node serve`, fresh state directory, see bench/_node.py) builds the `base` template (one
Linux guest cold boot under QEMU TCG here, then captured); every `Sandbox.create()` restores that boot
snapshot copy-on-write. Measured:

  latency      N sequential sandboxes: `Sandbox.create()` -> end of the first `commands.run("echo ok")`,
               split into create and first command, then `kill()`; p50/p95. The node's own view of each
               create (its `create` event: duration, and `restore_ms` = slot + disk image + NBD + VMM
               restore) is read from its database. One warm-up sandbox before, reported on its own.
  throughput   C concurrent clients (threads), each looping create -> run -> kill until a total count or a
               time budget is reached; creates per minute = completed cycles / wall time.
  floors       (a) QEMU TCG Linux guest: the same template's boot snapshot (files and shape read from the
               node's SQLite) restored directly with `QemuDriver.restore` (`-incoming defer`, migrate-incoming,
               `cont`), disks as plain files (the snapshot's disk layers materialized once into a flat file,
               copied per restore, untimed) instead of the node's NBD server, inside a network namespace
               this bench creates with a `tap0` like a node slot's. Process start -> `cont` done.
               (b) Firecracker tiny PVH guest (tests/vmm/tinyguest.py) under this host's KVM: boot,
               capture, then restore -> running (and Firecracker's own `load_snapshot` latency).
  ratios       node create p50 / QEMU restore floor; node-side restore p50 / QEMU restore floor.

The machine is shared (2 cores, other workers): the load average at start and end is recorded next to the
numbers. Writes bench/results/sandbox_create.json; the last line printed is a one-line summary.

Run: .venv/bin/python bench/sandbox_create.py [-n 10] [-c 1,2,4] [--tp-count 12] [--tp-time 120]
     [--floor-runs 5]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from aenv_node.vmm import (  # noqa: E402
    FirecrackerDriver,
    QemuDriver,
)
from bench._floor import (  # noqa: E402
    GUEST_IP,
    BenchNetns,
    flat_disk,
    floor_files,
    run_cmd,
    snapshot_files,
    template_snapshot_id,
    vm_config,
)
from bench._node import BenchNode, profiled, run_node, sigterm_as_interrupt  # noqa: E402
from bench._stats import ms, pct, utc_now  # noqa: E402
from bench.vmm_floor import MEM_MIB as TINY_MEM_MIB  # noqa: E402
from bench.vmm_floor import cfg as tiny_cfg  # noqa: E402
from tests.vmm.tinyguest import build_tiny_guest, last_tick, wait_for_tick  # noqa: E402
from _results import result_path  # noqa: E402

ENVD_PORT = 49983
CLONE_NEWNET = 0x40000000




def dist(values_s: list[float]) -> dict[str, float]:
    """p50/p95/min/max/mean in ms of samples in seconds."""
    if not values_s:
        return {}
    return {
        "p50_ms": ms(pct(values_s, 50)), "p95_ms": ms(pct(values_s, 95)), "min_ms": ms(min(values_s)),
        "max_ms": ms(max(values_s)), "mean_ms": ms(statistics.fmean(values_s)), "n": len(values_s),
    }  # fmt: skip


# ---- through the SDK ---------------------------------------------------------------------------------------


def cycle(sandbox_cls: Any, sandbox_timeout_s: int) -> dict[str, Any]:
    """create -> run("echo ok") -> kill; the phases' durations in seconds."""
    t0 = time.perf_counter()
    sb = sandbox_cls.create(timeout=sandbox_timeout_s)
    t1 = time.perf_counter()
    try:
        r = sb.commands.run("echo ok")
        t2 = time.perf_counter()
        if r.stdout != "ok\n" or r.exit_code != 0:
            raise RuntimeError(f"first command in {sb.sandbox_id}: exit {r.exit_code}, stdout {r.stdout!r}")
    finally:
        tk = time.perf_counter()
        sb.kill()
        t3 = time.perf_counter()
    return {
        "sandbox_id": sb.sandbox_id, "create_s": t1 - t0, "first_cmd_s": t2 - t1, "total_s": t2 - t0,
        "kill_s": t3 - tk,
    }  # fmt: skip


def node_create_events(node: BenchNode) -> dict[str, dict[str, float]]:
    """The node's own timing of each create: {sandbox_id: {duration_ms, restore_ms}}."""
    out: dict[str, dict[str, float]] = {}
    for sid, duration, detail in node.sql(
        "SELECT sandbox_id, duration_ms, detail FROM events WHERE operation = 'create' AND to_state = 'running'"
    ):
        d = json.loads(detail) if isinstance(detail, str) else (detail or {})
        out[sid] = {"duration_ms": duration, "restore_ms": d.get("restore_ms")}
    return out


def match_event(events: dict[str, dict[str, float]], sandbox_id: str) -> dict[str, float] | None:
    """The SDK's id may carry a client suffix (`<id>-<client>`): match on the node's id as a prefix."""
    if sandbox_id in events:
        return events[sandbox_id]
    for sid, e in events.items():
        if sandbox_id.startswith(sid):
            return e
    return None


def latency_phase(sandbox_cls: Any, node: BenchNode, n: int, sandbox_timeout_s: int) -> dict[str, Any]:
    warm = cycle(sandbox_cls, sandbox_timeout_s)
    print(f"warm-up sandbox: create {ms(warm['create_s'])} ms, first command {ms(warm['first_cmd_s'])} ms")
    samples = []
    for i in range(n):
        c = cycle(sandbox_cls, sandbox_timeout_s)
        samples.append(c)
        print(
            f"  {i + 1:3}/{n}: create->first command {ms(c['total_s']):8.1f} ms  (create {ms(c['create_s']):8.1f}"
            f", first command {ms(c['first_cmd_s']):7.1f}, kill {ms(c['kill_s']):7.1f})",
            flush=True,
        )
    events = node_create_events(node)
    server_total, server_restore, server_init = [], [], []
    for c in samples:
        e = match_event(events, c["sandbox_id"])
        if e is not None:
            c["node_create_ms"] = e["duration_ms"]
            c["node_restore_ms"] = e["restore_ms"]
            if e["duration_ms"] is not None:
                server_total.append(e["duration_ms"] / 1000)
            if e["restore_ms"] is not None:
                server_restore.append(e["restore_ms"] / 1000)
                if e["duration_ms"] is not None:
                    server_init.append((e["duration_ms"] - e["restore_ms"]) / 1000)
    return {
        "warmup": {k: (ms(v) if k.endswith("_s") else v) for k, v in warm.items()},
        "create_to_first_command": dist([c["total_s"] for c in samples]),
        "create": dist([c["create_s"] for c in samples]),
        "first_command": dist([c["first_cmd_s"] for c in samples]),
        "kill": dist([c["kill_s"] for c in samples]),
        "node_create": dist(server_total),  # node: slot + image + NBD + VMM restore + envd /init
        "node_restore": dist(server_restore),  # node: up to the VMM running (before envd /init)
        "node_envd_init": dist(server_init),  # node: VMM running -> envd /init answered
        "samples": [{k: (ms(v) if k.endswith("_s") else v) for k, v in c.items()} for c in samples],
    }


def throughput_phase(
    sandbox_cls: Any, clients: int, max_total: int, max_time_s: float, sandbox_timeout_s: int
) -> dict[str, Any]:
    """`clients` threads loop create -> run -> kill; no new cycle starts once `max_total` started or the time
    budget is spent. Rate = completed cycles / wall time from start until the last thread finished."""
    lock = threading.Lock()
    stop = threading.Event()
    started = 0
    done: list[dict[str, Any]] = []
    errors: list[str] = []
    t0 = time.perf_counter()
    deadline = t0 + max_time_s

    def client() -> None:
        nonlocal started
        while not stop.is_set():
            with lock:
                if started >= max_total or time.perf_counter() >= deadline:
                    return
                started += 1
            try:
                c = cycle(sandbox_cls, sandbox_timeout_s)
                with lock:
                    done.append(c)
            except Exception as e:  # a failed cycle is counted, not fatal: report it
                with lock:
                    errors.append(f"{type(e).__name__}: {e}"[:500])

    threads = [threading.Thread(target=client, name=f"client-{i}", daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    try:
        for t in threads:
            while t.is_alive():
                t.join(timeout=0.5)
    except BaseException:
        stop.set()  # on ^C: no new cycles; the node's shutdown ends those in flight
        raise
    elapsed = time.perf_counter() - t0
    return {
        "clients": clients,
        "completed": len(done),
        "errors": errors,
        "elapsed_s": round(elapsed, 2),
        "creates_per_min": round(len(done) / elapsed * 60, 2) if done else 0.0,
        "create": dist([c["create_s"] for c in done]),
        "create_to_first_command": dist([c["total_s"] for c in done]),
    }


# ---- raw floors --------------------------------------------------------------------------------------------


def _probe_envd_in_netns(netns: Path, deadline: float, out: list[float]) -> None:
    """In this (dedicated) thread: enter `netns`, poll envd's /health in the guest until it answers 2xx;
    append the perf_counter time of the answer to `out`. setns moves only the calling thread."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(netns, os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns({netns})")
    finally:
        os.close(fd)
    while time.perf_counter() < deadline:
        try:
            with socket.create_connection((GUEST_IP, ENVD_PORT), timeout=1) as s:
                s.sendall(b"GET /health HTTP/1.1\r\nHost: envd\r\nConnection: close\r\n\r\n")
                if s.recv(64).startswith((b"HTTP/1.1 20", b"HTTP/1.0 20")):
                    out.append(time.perf_counter())
                    return
        except OSError:
            pass
        time.sleep(0.002)


async def qemu_restore_floor(
    snap: dict[str, Any], work: Path, runs: int, tcg_tb_size_mib: int
) -> dict[str, Any]:
    """Restore the template's boot snapshot with the QEMU driver, disks as files; process start -> running."""
    flat = work / "disk.flat"
    materialize_s = await trio.to_thread.run_sync(flat_disk, snap, flat)
    driver = QemuDriver(tcg_tb_size_mib=tcg_tb_size_mib)
    restore, alive_after, envd_ready = [], [], []
    with BenchNetns() as ns:
        for i in range(runs):
            wd = work / f"q{i}"
            wd.mkdir()
            disk = wd / "disk.raw"
            run_cmd("cp", "--sparse=always", str(flat), str(disk))  # this restore's writable disk (untimed)
            config = vm_config(snap, wd, disk, ns.path, "aenv-bench-floor")
            files = floor_files(snap, wd)  # untimed
            t0 = time.perf_counter()
            async with driver.restore(config, files) as vm:
                restore.append(time.perf_counter() - t0)
                # then: until envd in the guest answers over the tap (the node's create waits for envd too)
                answered: list[float] = []
                th = threading.Thread(
                    target=_probe_envd_in_netns, args=(ns.path, time.perf_counter() + 30, answered), daemon=True
                )
                th.start()
                await trio.to_thread.run_sync(th.join, abandon_on_cancel=True)
                if answered:
                    envd_ready.append(answered[0] - t0)
                st = await vm.stats()
                alive_after.append(st.state.value == "running" and st.cpu_seconds > 0)
            shutil.rmtree(wd, ignore_errors=True)
    return {
        "restore": dist(restore),
        "median_ms": ms(statistics.median(restore)),
        "runs_ms": [ms(x) for x in restore],
        "running_after": alive_after,
        "restore_to_envd_health": dist(envd_ready),  # process start -> envd /health answers in the guest
        "envd_health_runs_ms": [ms(x) for x in envd_ready],
        "disk_materialize_ms": ms(materialize_s),
        "snapshot_id": snap["id"],
        "shape": snap["shape"],
        "tcg_tb_size_mib": tcg_tb_size_mib,
        "memory_image_bytes": os.path.getsize(snap["memory"]),
        "vmstate_bytes": os.path.getsize(snap["vmstate"]),
    }


async def firecracker_restore_floor(work: Path, runs: int) -> dict[str, Any]:
    """Tiny PVH guest under KVM: boot, capture, then restore -> running (guest ticks checked after)."""
    driver = FirecrackerDriver()
    if not driver.binary.is_file():
        return {"skipped": f"firecracker not installed at {driver.binary}"}
    kernel = build_tiny_guest(work / "guest")
    c = tiny_cfg(work / "boot", kernel)
    async with driver.boot(c) as vm:
        await wait_for_tick(c.console_path, 2)
        res = await vm.capture(work / "snap.vmstate", work / "snap.memory")
    tick = last_tick(c.console_path) or 0
    restore, internal = [], []
    for i in range(runs):
        rc = tiny_cfg(work / f"r{i}", kernel)
        t0 = time.perf_counter()
        async with driver.restore(rc, res.snapshot_files()) as vm:
            restore.append(time.perf_counter() - t0)
            lat = (await vm.stats()).vmm.get("metrics", {}).get("latencies_us", {})
            if lat.get("load_snapshot"):
                internal.append(lat["load_snapshot"] / 1e6)
            await wait_for_tick(rc.console_path, tick + 2)  # it really runs on
        shutil.rmtree(work / f"r{i}", ignore_errors=True)
    out: dict[str, Any] = {
        "restore": dist(restore),
        "median_ms": ms(statistics.median(restore)),
        "runs_ms": [ms(x) for x in restore],
        "mem_mib": TINY_MEM_MIB,
    }
    if internal:
        out["vmm_internal_load_snapshot_median_ms"] = ms(statistics.median(internal))
    return out


async def floors(snap: dict[str, Any], work: Path, runs: int, tcg_tb_size_mib: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    qdir, fdir = work / "qemu", work / "fc"
    qdir.mkdir()
    fdir.mkdir()
    out["qemu_tcg_restore"] = await qemu_restore_floor(snap, qdir, runs, tcg_tb_size_mib)
    print(f"QEMU TCG restore floor: {out['qemu_tcg_restore']['runs_ms']} ms", flush=True)
    out["firecracker_tiny_restore"] = await firecracker_restore_floor(fdir, runs)
    print(f"Firecracker tiny restore: {out['firecracker_tiny_restore'].get('runs_ms')} ms", flush=True)
    return out


# ---- main --------------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-n", "--sandboxes", type=int, default=10, help="sandboxes for the latency phase")
    ap.add_argument("-c", "--clients", default="1,2,4", help="concurrency levels for throughput")
    ap.add_argument("--tp-count", type=int, default=12, help="max create cycles per concurrency level")
    ap.add_argument("--tp-time", type=float, default=120, help="time budget (s) per concurrency level")
    ap.add_argument("--floor-runs", type=int, default=5)
    ap.add_argument("--tcg-tb-size-mb", type=int, default=64, help="as the node's vmm.tcg_tb_size_mb")
    ap.add_argument("--sandbox-timeout", type=int, default=300, help="E2B sandbox timeout (s) per sandbox")
    ap.add_argument("--out", type=Path, default=result_path("sandbox_create"))
    ap.add_argument("--profile", action="store_true",
                    help="py-spy the node's control plane through the throughput phase of the last level")
    args = ap.parse_args()
    levels = [int(x) for x in args.clients.split(",") if x.strip()]

    results: dict[str, Any] = {
        "started_at": utc_now(),
        "host": {
            "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
            "cpus": os.cpu_count(),
            "note": "2 shared cores; other workers run on this machine at the same time",
        },
        "config": {
            "sandboxes": args.sandboxes, "clients": levels, "tp_count": args.tp_count, "tp_time_s": args.tp_time,
            "floor_runs": args.floor_runs, "tcg_tb_size_mb": args.tcg_tb_size_mb, "first_command": "echo ok",
        },
    }
    print(f"loadavg at start {results['host']['loadavg_at_start']}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="sbx-create-", dir="/dev/shm"))
    stop_hooks: list[Callable[[], None]] = []
    try:
        with sigterm_as_interrupt(), run_node(stop_hook=stop_hooks) as node:
            print(f"node up: /health {node.health_s:.1f} s, template base ready {node.template_ready_s:.1f} s",
                  flush=True)  # fmt: skip
            results["node"] = {"health_s": round(node.health_s, 2), "template_ready_s": round(node.template_ready_s, 2),
                               "env": node.env}
            for (detail,) in node.sql(
                "SELECT detail FROM events WHERE subject = 'template' AND to_state = 'ready' ORDER BY id DESC LIMIT 1"
            ):
                results["node"]["template_build"] = json.loads(detail) if isinstance(detail, str) else detail
            os.environ.update(node.sdk_env())
            from e2b import Sandbox

            results["latency"] = latency_phase(Sandbox, node, args.sandboxes, args.sandbox_timeout)
            tp = []
            for c in levels:
                cpu_before = node.cpu_s()
                with contextlib.ExitStack() as stack:
                    if args.profile and c == levels[-1]:
                        raw = args.out.with_name("sandbox_create_profile.txt")
                        results["profile"] = stack.enter_context(profiled(node.proc.pid, raw))
                        results["profile"]["raw"] = str(raw)
                    r = throughput_phase(Sandbox, c, args.tp_count, args.tp_time, args.sandbox_timeout)
                cpu_after = node.cpu_s()
                # the node's own CPU per create -> command -> kill cycle (the guests' and VMMs' not counted)
                r["node_cpu_ms_per_cycle"] = {
                    k: round((cpu_after[k] - cpu_before[k]) * 1000 / max(r["completed"], 1), 1)
                    for k in cpu_after if k in cpu_before}
                tp.append(r)
                print(f"C={c}: {r['completed']} cycles in {r['elapsed_s']} s = {r['creates_per_min']} creates/min"
                      f" ({len(r['errors'])} errors); node CPU per cycle {r['node_cpu_ms_per_cycle']} ms",
                      flush=True)  # fmt: skip
            results["throughput"] = tp
            if "profile" in results:
                prof = results["profile"]
                print(f"profile of the node's control plane ({prof.get('samples', 0)} samples at 100 Hz):")
                for frame, share in prof.get("top_node", []):
                    print(f"  {share * 100:5.1f}%  {frame}")
            # what the node said about failures (its log goes away with its state directory)
            results["node_log_warnings"] = [
                ln[:400] for ln in node.log_path.read_text(errors="replace").splitlines()
                if " WARNING " in ln or " ERROR " in ln
            ][:30]
            snap = snapshot_files(node.state_dir, template_snapshot_id(node.state_dir))
            for hook in stop_hooks:  # the node is idle from here on: stop it, keep its snapshot files
                hook()
            results["loadavg_before_floors"] = [round(x, 2) for x in os.getloadavg()]
            results["floors"] = trio.run(floors, snap, work, args.floor_runs, args.tcg_tb_size_mb)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    results["host"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    results["finished_at"] = utc_now()
    lat = results["latency"]
    q = results["floors"]["qemu_tcg_restore"]["median_ms"]
    fc = results["floors"]["firecracker_tiny_restore"].get("median_ms")
    create_p50 = lat["create"]["p50_ms"]
    ratios = {"node_create_p50_over_qemu_restore_floor": round(create_p50 / q, 2)}
    if lat["node_restore"]:
        ratios["node_side_restore_p50_over_qemu_restore_floor"] = round(lat["node_restore"]["p50_ms"] / q, 2)
    if lat["node_create"]:
        ratios["node_side_create_p50_over_qemu_restore_floor"] = round(lat["node_create"]["p50_ms"] / q, 2)
    qe = results["floors"]["qemu_tcg_restore"]["restore_to_envd_health"]
    if qe:
        ratios["node_create_p50_over_qemu_restore_to_envd_floor"] = round(create_p50 / qe["p50_ms"], 2)
        if lat["node_create"]:
            ratios["node_side_create_p50_over_qemu_restore_to_envd_floor"] = round(
                lat["node_create"]["p50_ms"] / qe["p50_ms"], 2
            )
    results["ratios"] = ratios
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")

    tp_s = "/".join(str(r["creates_per_min"]) for r in results["throughput"])
    c_s = "/".join(str(r["clients"]) for r in results["throughput"])
    la = results["host"]["loadavg_at_start"][0]
    print(
        f"sandbox_create: create->first command p50 {lat['create_to_first_command']['p50_ms']:.0f} ms "
        f"p95 {lat['create_to_first_command']['p95_ms']:.0f} ms; create p50 {create_p50:.0f} ms "
        f"p95 {lat['create']['p95_ms']:.0f} ms; first command p50 {lat['first_command']['p50_ms']:.0f} ms; "
        f"node-side restore p50 {lat['node_restore'].get('p50_ms', float('nan')):.0f} ms + envd /init p50 "
        f"{lat['node_envd_init'].get('p50_ms', float('nan')):.0f} ms; "
        f"C={c_s}: {tp_s} creates/min; QEMU TCG restore floor {q:.0f} ms "
        f"(create p50 / floor = {ratios['node_create_p50_over_qemu_restore_floor']}), "
        f"restore->envd /health floor {qe.get('p50_ms', float('nan')):.0f} ms "
        f"(ratio {ratios.get('node_create_p50_over_qemu_restore_to_envd_floor', '-')}); "
        f"Firecracker tiny restore {fc if fc is not None else '-'} ms; load avg {la:.1f} at start (shared host)"
    )


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("interrupted: node stopped, namespace and temp dirs removed", file=sys.stderr)
        sys.exit(130)
