"""Raw VMM operation floors through the aenv_node.vmm drivers, for QEMU microvm and Firecracker.

Tiny PVH guest (tests/vmm/guest/tiny.S) under this host's KVM, 256 MiB of guest memory, files on the
filesystem of --dir (default /dev/shm, a tmpfs). For each VMM, medians over --runs repetitions of:

  boot          process start -> VMM reports the guest running (the driver's boot context entered)
  boot_console  process start -> the guest's first console line (it really executes)
  pause/resume  PATCH /vm or QMP stop/cont
  capture_full  booted VM -> vmstate + complete memory image at another path (QEMU: device state +
                sparse copy of its RAM file; Firecracker: Full snapshot)
  capture_seal  QEMU only: capture into the VM's own RAM file (device state only; the VM cannot run on)
  restore       process start -> running from a full snapshot (memory mapped copy-on-write)
  capture_diff  restored VM that ran ~20 ticks -> vmstate + sparse file of its dirty pages
  fork3         3 restores of one snapshot started at once -> all 3 running

Floors measured in the same run: raw_boot_console (the same VMM command line started with plain Popen,
console polled) for boot_console, and Firecracker's own latency metrics (`latencies_us`, measured inside the
VMM) for restore / capture; the ratios are the driver's overhead. Writes
bench/results/vmm_floor.json; the last line printed is a one-line summary.

Run: .venv/bin/python bench/vmm_floor.py [--runs 5] [--dir /dev/shm]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from aenv_node.vmm import (  # noqa: E402
    Accel,
    CaptureKind,
    FirecrackerDriver,
    QemuDriver,
    SnapshotFiles,
    VmConfig,
    VmmDriver,
)
from tests.vmm.tinyguest import build_tiny_guest, last_tick, wait_for_tick  # noqa: E402
from _results import result_path  # noqa: E402

MEM_MIB = 256


def cfg(workdir: Path, kernel: Path) -> VmConfig:
    return VmConfig(workdir=workdir, kernel=kernel, mem_mib=MEM_MIB, accel=Accel.KVM)


async def wait_console(path: Path, needle: bytes, timeout: float = 10.0) -> None:
    with trio.fail_after(timeout):
        while True:
            try:
                if needle in path.read_bytes():
                    return
            except FileNotFoundError:
                pass
            await trio.sleep(0.0005)


async def raw_boot(driver: VmmDriver, kernel: Path, wd: Path) -> float:
    """The floor for boot_console: the same VMM command line started with plain Popen, console polled."""
    c = cfg(wd, kernel)
    wd.mkdir(parents=True)
    if isinstance(driver, QemuDriver):
        with open(c.mem_path, "wb") as f:
            f.truncate(c.mem_bytes)
        argv = driver._argv(c, mem_path=c.mem_path, share=True, incoming=None)
    else:
        vm_json = {
            "boot-source": {"kernel_image_path": str(kernel), "boot_args": ""},
            "drives": [],
            "machine-config": {"vcpu_count": 1, "mem_size_mib": MEM_MIB, "track_dirty_pages": True},
        }
        (wd / "vm.json").write_text(json.dumps(vm_json))
        argv = [str(driver.binary), "--api-sock", str(c.socket_path), "--config-file", str(wd / "vm.json")]
    with open(c.console_path, "wb") as out:
        t0 = time.perf_counter()
        with open(wd / "stderr", "wb") as err:
            p = subprocess.Popen(argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL)
    try:
        try:
            await wait_console(c.console_path, b"AENV BOOT")
        except trio.TooSlowError:
            raise RuntimeError(f"raw {driver.name} boot failed: {(wd / 'stderr').read_text()[-2000:]}") from None
        return time.perf_counter() - t0
    finally:
        p.kill()
        p.wait()
        c.socket_path.unlink(missing_ok=True)


async def fork_child(
    driver: VmmDriver, c: VmConfig, snap: SnapshotFiles, t0: float, up: list[float], all_up: trio.Event
) -> None:
    """One of 3 concurrent restores: note when it runs, stay up until all 3 do."""
    async with driver.restore(c, snap):
        up.append(time.perf_counter() - t0)
        if len(up) == 3:
            all_up.set()
        await all_up.wait()


def ms(seconds: float) -> float:
    return round(seconds * 1000, 2)


async def bench_driver(driver: VmmDriver, kernel: Path, base: Path, runs: int) -> dict[str, list[float]]:
    r: dict[str, list[float]] = {
        k: []
        for k in (
            "boot", "boot_console", "pause", "resume", "capture_full", "capture_seal",
            "restore", "capture_diff", "fork3", "raw_boot_console",
        )
    }  # fmt: skip
    fc_lat: dict[str, list[float]] = {
        "load_snapshot": [], "full_create_snapshot": [], "diff_create_snapshot": [], "pause_vm": [],
    }  # fmt: skip
    for i in range(runs):
        wd = base / f"{driver.name}-{i}"
        c = cfg(wd / "boot", kernel)
        t0 = time.perf_counter()
        async with driver.boot(c) as vm:
            r["boot"].append(time.perf_counter() - t0)
            await wait_console(c.console_path, b"AENV BOOT")
            r["boot_console"].append(time.perf_counter() - t0)
            await wait_for_tick(c.console_path, 2)
            for _ in range(3):
                t = time.perf_counter()
                await vm.pause()
                r["pause"].append(time.perf_counter() - t)
                t = time.perf_counter()
                await vm.resume()
                r["resume"].append(time.perf_counter() - t)
            snap = wd / "snap"
            snap.mkdir()
            res = await vm.capture(snap / "vmstate", snap / "memory")
            r["capture_full"].append(res.duration_s)
            if driver.name == "firecracker":
                lat = (await vm.stats()).vmm.get("metrics", {}).get("latencies_us", {})
                if lat.get("full_create_snapshot"):
                    fc_lat["full_create_snapshot"].append(lat["full_create_snapshot"] / 1e6)
            tick = last_tick(c.console_path) or 0
            if driver.name == "qemu":
                await vm.resume()
                await wait_for_tick(c.console_path, tick + 2)
                seal = await vm.capture(snap / "vmstate.seal", c.mem_path)
                r["capture_seal"].append(seal.duration_s)
        r["raw_boot_console"].append(await raw_boot(driver, kernel, wd / "raw"))

        rc = cfg(wd / "restore", kernel)
        t0 = time.perf_counter()
        async with driver.restore(rc, res.snapshot_files()) as vm:
            r["restore"].append(time.perf_counter() - t0)
            await wait_for_tick(rc.console_path, tick + 20)
            d = await vm.capture(wd / "diff.vmstate", wd / "diff.memory", kind=CaptureKind.DIFF)
            r["capture_diff"].append(d.duration_s)
            if driver.name == "firecracker":
                lat = (await vm.stats()).vmm.get("metrics", {}).get("latencies_us", {})
                for k in ("load_snapshot", "diff_create_snapshot", "pause_vm"):
                    if lat.get(k):
                        fc_lat[k].append(lat[k] / 1e6)

        up: list[float] = []
        all_up = trio.Event()
        t0 = time.perf_counter()
        async with trio.open_nursery() as n:
            for j in range(3):
                n.start_soon(fork_child, driver, cfg(wd / f"fork{j}", kernel), res.snapshot_files(), t0, up, all_up)
        r["fork3"].append(max(up))
        shutil.rmtree(wd, ignore_errors=True)
    out = {k: v for k, v in r.items() if v}
    for k, v in fc_lat.items():
        if v:
            out[f"vmm_internal_{k}"] = v
    return out


def summarize(samples: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    return {
        k: {"median_ms": ms(statistics.median(v)), "min_ms": ms(min(v)), "max_ms": ms(max(v)), "n": len(v)}
        for k, v in samples.items()
    }


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--dir", type=Path, default=Path("/dev/shm"))
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="vmm-floor-", dir=args.dir))
    results: dict[str, object] = {
        "mem_mib": MEM_MIB,
        "runs": args.runs,
        "dir": str(args.dir),
        "loadavg_1m_at_start": round(os.getloadavg()[0], 2),  # the 2 cores are shared: read numbers with this
    }
    try:
        kernel = build_tiny_guest(base / "guest")
        for driver in (FirecrackerDriver(), QemuDriver()):
            if not driver.binary.is_file():
                print(f"{driver.name}: not installed, skipped")
                continue
            s = summarize(await bench_driver(driver, kernel, base, args.runs))
            results[driver.name] = s
            for k, v in s.items():
                lo, hi = v["min_ms"], v["max_ms"]
                print(f"{driver.name:12} {k:34} median {v['median_ms']:8.2f} ms  [{lo:.2f} .. {hi:.2f}]")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    fc = results.get("firecracker", {})
    ratios = {}
    if isinstance(fc, dict):
        # capture_diff = pause + snapshot create (+ finding the ranges): compare with the VMM's pause + create
        for op, internals in (
            ("restore", ("load_snapshot",)),
            ("capture_full", ("full_create_snapshot",)),
            ("capture_diff", ("pause_vm", "diff_create_snapshot")),
        ):
            keys = [f"vmm_internal_{k}" for k in internals]
            if op in fc and all(k in fc for k in keys):
                floor = sum(fc[k]["median_ms"] for k in keys)
                ratios[f"firecracker_{op}"] = round(fc[op]["median_ms"] / floor, 2)
    for vmm in ("firecracker", "qemu"):
        d = results.get(vmm)
        if isinstance(d, dict) and "raw_boot_console" in d:
            ratios[f"{vmm}_boot"] = round(d["boot_console"]["median_ms"] / d["raw_boot_console"]["median_ms"], 2)
    results["driver_over_floor"] = ratios
    results["loadavg_1m_at_end"] = round(os.getloadavg()[0], 2)
    out = result_path("vmm_floor")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")

    def g(vmm: str, op: str) -> str:
        d = results.get(vmm)
        return f"{d[op]['median_ms']:.1f}" if isinstance(d, dict) and op in d else "-"

    print(
        f"vmm_floor ({MEM_MIB} MiB tiny guest, medians ms) firecracker: boot {g('firecracker', 'boot')} "
        f"restore {g('firecracker', 'restore')} full {g('firecracker', 'capture_full')} "
        f"diff {g('firecracker', 'capture_diff')} fork3 {g('firecracker', 'fork3')} | "
        f"qemu: boot {g('qemu', 'boot')} restore {g('qemu', 'restore')} seal {g('qemu', 'capture_seal')} "
        f"full {g('qemu', 'capture_full')} diff {g('qemu', 'capture_diff')} fork3 {g('qemu', 'fork3')} | "
        f"driver/floor: {ratios}"
    )


if __name__ == "__main__":
    trio.run(main)
