#!/usr/bin/env python3
"""Free page reporting of a VM restored from a shared copy-on-write image, against an anonymous-RAM floor.

One Linux guest (the guest kit's kernel, QEMU TCG, 512 MiB, balloon with free page reporting; the guest of
tests/vmm/fprguest.py) is booted with its RAM in a file of its own and captured into it. Then:

- restored: a VM restored `share=off` from that image under the punch-hole guard
  (`QemuDriver(cow_discard=True)`); the guest overwrites its 200 MiB tmpfs file in place (all of it becomes
  private copies in QEMU), then deletes it. Measured: QEMU's private memory in the image mapping and its
  Anonymous total before, after the write and once the freed memory is back, the time from the guest's
  `rm` being done to the drop, and the image's sha256 before and after (must not change).
- floor: the same guest booted with anonymous RAM (the VM owns its memory: QEMU really discards, no guard),
  which fills the same 200 MiB at boot, then deletes it: the best free page reporting can do on this QEMU.
- spawn: the guard's cost at VMM start (fork+exec with a preexec_fn instead of vfork), timed on /bin/true
  through `vmm_process`, with and without the filter.

Usage: .venv/bin/python bench/free_page_reporting.py [--state-dir /var/lib/aenv] [--spawns 20]
Writes bench/results/free_page_reporting.json; the last line printed is a one-line summary.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from aenv_node.images import ensure_kit
from aenv_node.vmm import MemoryMode, QemuDriver
from aenv_node.vmm.process import vmm_process
from aenv_node.vmm.seccomp import punch_hole_guard
from bench._stats import ms, utc_now
from tests.vmm.fprguest import (
    KEEP_MIB,
    MEM_MIB,
    Guest,
    guest_config,
    image_anon_bytes,
    make_rootfs,
    rollup,
)
from _results import result_path  # noqa: E402

MiB = 1 << 20
BOOT_TIMEOUT_S = 240


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(4 * MiB):
            h.update(chunk)
    return h.hexdigest()


def mib(n: int) -> float:
    return round(n / MiB, 1)


async def until_returned(read, limit: int, timeout: float = 120.0) -> tuple[float, int]:  # type: ignore[no-untyped-def]
    """Seconds until read() <= limit (polled every 50 ms), and the value then."""
    t0 = time.monotonic()
    while True:
        v = read()
        if v <= limit:
            return time.monotonic() - t0, v
        if time.monotonic() - t0 > timeout:
            raise RuntimeError(f"memory not returned within {timeout} s (still {mib(v)} MiB, want <= {mib(limit)})")
        await trio.sleep(0.05)


async def settle(read, seconds: float = 6.0) -> int:  # type: ignore[no-untyped-def]
    """The value once reporting has had time to finish (the guest reports every 2 s)."""
    await trio.sleep(seconds)
    return read()


async def bench_restored(kit, work: Path, rootfs: Path) -> dict:  # type: ignore[no-untyped-def]
    plain, guarded = QemuDriver(), QemuDriver(cow_discard=True)
    boot = guest_config(kit, work / "boot", rootfs, work / "cmd-boot")
    async with plain.boot(boot) as vm:
        await Guest(boot).wait_line(r"^fpr: ready", BOOT_TIMEOUT_S)
        res = await vm.capture(work / "vmstate", boot.mem_path)
    image = res.memory
    sha_before = await trio.to_thread.run_sync(sha256, image)
    cfg = guest_config(kit, work / "restored", rootfs, work / "cmd-restored", mem_mode=MemoryMode.PRIVATE)
    t0 = time.perf_counter()
    async with guarded.restore(cfg, res.snapshot_files()) as vm:
        restore_s = time.perf_counter() - t0
        g = Guest(cfg)
        assert await g.run("ping") == "pong"
        pid = vm.pid
        before = {"image_private": image_anon_bytes(pid, image), "anonymous": rollup(pid)["Anonymous"]}
        await g.run("dirty")
        dirty = {"image_private": image_anon_bytes(pid, image), "anonymous": rollup(pid)["Anonymous"]}
        await g.run("free")
        limit = dirty["image_private"] - (KEEP_MIB * 3 // 4) * MiB
        took, _ = await until_returned(lambda: image_anon_bytes(pid, image), limit)
        after = {
            "image_private": await settle(lambda: image_anon_bytes(pid, image)),
            "anonymous": rollup(pid)["Anonymous"],
        }
        pss = rollup(pid)["Pss"]
    sha_after = await trio.to_thread.run_sync(sha256, image)
    return {
        "restore_ms": ms(restore_s),
        "before_mib": {k: mib(v) for k, v in before.items()},
        "after_write_mib": {k: mib(v) for k, v in dirty.items()},
        "after_free_mib": {k: mib(v) for k, v in after.items()},
        "pss_after_free_mib": mib(pss),
        "returned_mib": mib(dirty["anonymous"] - after["anonymous"]),
        "seconds_to_75pct_returned": round(took, 2),
        "image_unchanged": sha_before == sha_after,
    }


async def bench_floor(kit, work: Path, rootfs: Path) -> dict:  # type: ignore[no-untyped-def]
    cfg = guest_config(kit, work / "anon", rootfs, work / "cmd-anon", mem_mode=MemoryMode.ANONYMOUS)
    async with QemuDriver().boot(cfg) as vm:
        g = Guest(cfg)
        await g.wait_line(r"^fpr: ready", BOOT_TIMEOUT_S)
        pid = vm.pid
        filled = await settle(lambda: rollup(pid)["Anonymous"])  # boot-time garbage reported first
        await g.run("free")
        took, _ = await until_returned(lambda: rollup(pid)["Anonymous"], filled - (KEEP_MIB * 3 // 4) * MiB)
        after = await settle(lambda: rollup(pid)["Anonymous"])
    return {
        "filled_anonymous_mib": mib(filled),
        "after_free_anonymous_mib": mib(after),
        "returned_mib": mib(filled - after),
        "seconds_to_75pct_returned": round(took, 2),
    }


async def bench_spawn(work: Path, n: int) -> dict:
    guard = punch_hole_guard()
    out: dict[str, list[float]] = {"plain": [], "guarded": []}
    for _ in range(n):
        for name, filt in (("plain", None), ("guarded", guard)):
            t0 = time.perf_counter()
            async with vmm_process(["/bin/true"], log_path=work / "spawn.log", seccomp=filt) as p:
                await p.wait()
            out[name].append(time.perf_counter() - t0)
    return {k: {"median_ms": ms(statistics.median(v)), "min_ms": ms(min(v))} for k, v in out.items()}


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--state-dir", type=Path, default=Path(os.environ.get("AENV_STATE_DIR", "/var/lib/aenv")))
    ap.add_argument("--spawns", type=int, default=20)
    args = ap.parse_args()
    kit = await trio.to_thread.run_sync(ensure_kit, args.state_dir)
    work = Path(tempfile.mkdtemp(prefix="fpr-bench-", dir="/tmp"))
    results: dict[str, object] = {
        "bench": "free_page_reporting",
        "when": utc_now(),
        "mem_mib": MEM_MIB,
        "freed_mib": KEEP_MIB,
        "kit": kit.hash if hasattr(kit, "hash") else None,
        "loadavg_1m_at_start": round(os.getloadavg()[0], 2),
    }
    try:
        rootfs = work / "rootfs.ext4"
        make_rootfs(rootfs)
        r = await bench_restored(kit, work, rootfs)
        print(f"restored (share=off, guard): {json.dumps(r)}")
        f = await bench_floor(kit, work, rootfs)
        print(f"floor (anonymous RAM):      {json.dumps(f)}")
        s = await bench_spawn(work, args.spawns)
        print(f"spawn /bin/true:            {json.dumps(s)}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results.update(restored=r, floor_anonymous=f, spawn=s)
    ratios = {
        "returned_restored_vs_floor": round(r["returned_mib"] / f["returned_mib"], 2),
        "time_restored_vs_floor": round(r["seconds_to_75pct_returned"] / f["seconds_to_75pct_returned"], 2),
        "spawn_guarded_vs_plain": round(s["guarded"]["median_ms"] / s["plain"]["median_ms"], 2),
    }
    results["ratios"] = ratios
    out = result_path("free_page_reporting")
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(
        f"free_page_reporting: restored VM returned {r['returned_mib']} of {KEEP_MIB} MiB freed "
        f"(image private {r['after_write_mib']['image_private']} -> {r['after_free_mib']['image_private']} MiB) "
        f"in {r['seconds_to_75pct_returned']} s vs anonymous floor {f['returned_mib']} MiB in "
        f"{f['seconds_to_75pct_returned']} s (x{ratios['returned_restored_vs_floor']} memory, "
        f"x{ratios['time_restored_vs_floor']} time); image unchanged: {r['image_unchanged']}; "
        f"guarded spawn x{ratios['spawn_guarded_vs_plain']}"
    )


if __name__ == "__main__":
    trio.run(main)
