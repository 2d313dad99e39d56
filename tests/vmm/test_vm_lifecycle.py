"""Both drivers, real VMs under KVM with the tiny guest: boot, pause/resume, capture, restore, diff, fork.

The guest counts ticks (50/s) in its status page and prints each on the serial console; it writes the tick
into one of 16 "sweep" pages, so a VM restored and run for 20+ ticks dirties exactly: the status page (its
counter and stack) and the 16 sweep pages, plus whatever the VMM itself writes into guest memory (a page or
two, e.g. Firecracker's). Nothing else; in particular never the boot-time pattern region.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import trio

from aenv_node.vmm import (
    CaptureKind,
    SnapshotError,
    SnapshotFiles,
    SnapshotFormat,
    UnsupportedOperation,
    VmmDriver,
    VmmStartError,
    VmState,
    memfile,
)

from .tinyguest import (
    MAGIC,
    MEM_MIB,
    PAGE,
    PATTERN,
    PATTERN_PAGES,
    STATUS,
    SWEEP,
    SWEEP_PAGES,
    console_ticks,
    image_status,
    last_tick,
    pattern_ok,
    tiny_config,
    wait_for_tick,
)

pytestmark = pytest.mark.vm

GUEST_PAGES = {STATUS // PAGE} | {SWEEP // PAGE + i for i in range(SWEEP_PAGES)}
PATTERN_PAGE_SET = {PATTERN // PAGE + i for i in range(PATTERN_PAGES)}
MAX_VMM_NOISE_PAGES = 4


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def pages_of(ranges) -> set[int]:
    return {p for r in ranges for p in range(r.offset // PAGE, r.end // PAGE)}


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


async def boot_and_capture(driver: VmmDriver, kernel: Path, root: Path, *, ticks: int = 3):
    """Boot, run `ticks` ticks, FULL capture into root/base; the VM is gone afterwards."""
    cfg = tiny_config(root / "boot", kernel)
    (root / "base").mkdir(parents=True, exist_ok=True)
    async with driver.boot(cfg) as vm:
        await wait_for_tick(cfg.console_path, ticks)
        res = await vm.capture(root / "base" / "vmstate", root / "base" / "memory")
    return res


async def test_boot_pause_resume(driver: VmmDriver, tiny_kernel: Path, workroot: Path) -> None:
    cfg = tiny_config(workroot / "vm", tiny_kernel)
    async with driver.boot(cfg) as vm:
        pid = vm.pid
        assert alive(pid)
        assert vm.state is VmState.RUNNING
        await wait_for_tick(cfg.console_path, 3)
        assert cfg.console_path.read_bytes().startswith(b"AENV BOOT\n")

        await vm.pause()
        assert vm.state is VmState.PAUSED
        await trio.sleep(0.05)  # a console write in flight lands
        frozen = last_tick(cfg.console_path)
        await trio.sleep(0.4)  # 20 ticks' worth of time
        assert last_tick(cfg.console_path) == frozen, "the guest kept running while paused"
        st = await vm.stats()
        assert st.state is VmState.PAUSED and st.pid == pid and st.rss_bytes > 0 and st.cpu_seconds > 0
        await vm.pause()  # idempotent

        await vm.resume()
        assert vm.state is VmState.RUNNING
        assert frozen is not None
        await wait_for_tick(cfg.console_path, frozen + 3)
        ticks = console_ticks(cfg.console_path)
        assert ticks == list(range(1, len(ticks) + 1)), "ticks must advance one by one"
        assert (await vm.stats()).state is VmState.RUNNING
        assert cfg.socket_path.exists()
    assert not alive(pid)
    assert not cfg.socket_path.exists()


async def test_full_capture_then_restore_continues(driver: VmmDriver, tiny_kernel: Path, workroot: Path) -> None:
    cfg = tiny_config(workroot / "boot", tiny_kernel)
    snap = workroot / "snap"
    snap.mkdir()
    async with driver.boot(cfg) as vm:
        await wait_for_tick(cfg.console_path, 5)
        res = await vm.capture(snap / "vmstate", snap / "memory")
        assert vm.state is VmState.PAUSED
        at = last_tick(cfg.console_path)
    assert res.kind is CaptureKind.FULL
    assert res.memory.stat().st_size == MEM_MIB << 20 == res.mem_size
    magic, tick = image_status(res.memory)
    assert magic == MAGIC
    assert at is not None and tick in (at, at + 1)
    assert pattern_ok(res.memory)

    cfg2 = tiny_config(workroot / "restored", tiny_kernel)
    async with driver.restore(cfg2, res.snapshot_files()) as vm2:
        assert vm2.state is VmState.RUNNING
        await wait_for_tick(cfg2.console_path, tick + 4)
        ticks = console_ticks(cfg2.console_path)
        # It continues where it was captured (the line for `tick` may or may not have been printed before).
        assert ticks[0] in (tick, tick + 1), f"restored guest restarted instead of continuing: {ticks[:5]}"
        assert ticks == list(range(ticks[0], ticks[0] + len(ticks)))
    assert sha256(res.memory) == sha256(res.memory)  # still readable after the VM is gone
    assert not cfg2.socket_path.exists()


async def test_capture_then_resume_keeps_running(driver: VmmDriver, tiny_kernel: Path, workroot: Path) -> None:
    """A snapshot of a running VM: capture, resume; the VM runs on and the captured image does not change."""
    cfg = tiny_config(workroot / "vm", tiny_kernel)
    async with driver.boot(cfg) as vm:
        await wait_for_tick(cfg.console_path, 3)
        res = await vm.capture(workroot / "vmstate", workroot / "memory")
        digest = sha256(res.memory)
        _, tick = image_status(res.memory)
        await vm.resume()
        await wait_for_tick(cfg.console_path, tick + 10)  # 10 sweep pages and the status page rewritten
        assert sha256(res.memory) == digest
        assert image_status(res.memory)[1] == tick


async def test_restore_paused_then_resume(driver: VmmDriver, tiny_kernel: Path, workroot: Path) -> None:
    res = await boot_and_capture(driver, tiny_kernel, workroot)
    cfg = tiny_config(workroot / "r", tiny_kernel)
    async with driver.restore(cfg, res.snapshot_files(), resume=False) as vm:
        assert vm.state is VmState.PAUSED
        await trio.sleep(0.3)
        assert console_ticks(cfg.console_path) == []
        await vm.resume()
        _, tick = image_status(res.memory)
        await wait_for_tick(cfg.console_path, tick + 2)


async def test_diff_capture_holds_only_pages_dirtied_since_restore(
    driver: VmmDriver, tiny_kernel: Path, workroot: Path
) -> None:
    base = await boot_and_capture(driver, tiny_kernel, workroot)
    _, base_tick = image_status(base.memory)
    cfg = tiny_config(workroot / "r1", tiny_kernel)
    d = workroot / "diff1"
    d.mkdir()
    async with driver.restore(cfg, base.snapshot_files()) as vm:
        await wait_for_tick(cfg.console_path, base_tick + SWEEP_PAGES + 4)  # every sweep page rewritten
        await vm.pause()
        live = await vm.dirty_memory_ranges()
        diff = await vm.capture(d / "vmstate", d / "memory", kind=CaptureKind.DIFF)
    assert diff.kind is CaptureKind.DIFF
    assert diff.memory.stat().st_size == MEM_MIB << 20

    for ranges in (diff.dirty_ranges, live):
        pages = pages_of(ranges)
        assert GUEST_PAGES <= pages, f"guest-written pages missing: {sorted(GUEST_PAGES - pages)}"
        noise = pages - GUEST_PAGES
        assert len(noise) <= MAX_VMM_NOISE_PAGES, f"pages not written by the guest: {sorted(noise)}"
        assert not noise & PATTERN_PAGE_SET
    # The diff file holds just those pages (sparse), not a memory-sized copy.
    allocated = diff.memory.stat().st_blocks * 512
    assert allocated <= diff.dirty_bytes + 64 * 1024, (allocated, diff.dirty_bytes)
    assert diff.dirty_bytes <= (len(GUEST_PAGES) + MAX_VMM_NOISE_PAGES) * PAGE
    assert memfile.data_ranges(diff.memory) == diff.dirty_ranges
    magic, diff_tick = image_status(diff.memory)
    assert magic == MAGIC and diff_tick >= base_tick + SWEEP_PAGES + 4

    # Layered restore: base image + diff pages = the VM as it was at the diff capture.
    merged = workroot / "merged.mem"
    await trio.to_thread.run_sync(memfile.materialize, base.memory, [(diff.memory, diff.dirty_ranges)], merged)
    assert image_status(merged) == (MAGIC, diff_tick)
    assert pattern_ok(merged)
    cfg2 = tiny_config(workroot / "r2", tiny_kernel)
    async with driver.restore(cfg2, diff.snapshot_files(merged)) as vm2:
        await wait_for_tick(cfg2.console_path, diff_tick + 3)
        ticks = console_ticks(cfg2.console_path)
        assert ticks[0] in (diff_tick, diff_tick + 1), ticks[:5]
        # A second generation: diff since this restore, layered over the merged image.
        await wait_for_tick(cfg2.console_path, diff_tick + 6)
        diff2 = await vm2.capture(workroot / "vmstate2", workroot / "diff2", kind=CaptureKind.DIFF)
    assert pages_of(diff2.dirty_ranges) >= {STATUS // PAGE}
    merged2 = workroot / "merged2.mem"
    await trio.to_thread.run_sync(
        memfile.materialize, base.memory, [(diff.memory, None), (diff2.memory, diff2.dirty_ranges)], merged2
    )
    _, tick2 = image_status(merged2)
    assert tick2 >= diff_tick + 6
    cfg3 = tiny_config(workroot / "r3", tiny_kernel)
    async with driver.restore(cfg3, diff2.snapshot_files(merged2)):
        await wait_for_tick(cfg3.console_path, tick2 + 2)
        assert console_ticks(cfg3.console_path)[0] in (tick2, tick2 + 1)


async def test_fork_three_children_diverge_copy_on_write(driver: VmmDriver, tiny_kernel: Path, workroot: Path) -> None:
    base = await boot_and_capture(driver, tiny_kernel, workroot)
    _, base_tick = image_status(base.memory)
    digest = sha256(base.memory)
    n = 3
    entered: list[float] = []
    left: list[float] = []
    all_up = trio.Event()
    out: dict[int, tuple[int, list[int], object]] = {}

    async def child(i: int) -> None:
        cfg = tiny_config(workroot / f"c{i}", tiny_kernel)
        async with driver.restore(cfg, base.snapshot_files()) as vm:
            entered.append(trio.current_time())
            if len(entered) == n:
                all_up.set()
            await all_up.wait()
            target = base_tick + 5 * (i + 1)
            await wait_for_tick(cfg.console_path, target)
            res = await vm.capture(cfg.workdir / "vmstate", cfg.workdir / "diff", kind=CaptureKind.DIFF)
            out[i] = (vm.pid, console_ticks(cfg.console_path), res)
            left.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        for i in range(n):
            nursery.start_soon(child, i)

    assert max(entered) < min(left), "the three children were not running at the same time"
    assert len({pid for pid, _, _ in out.values()}) == n
    final = []
    for i in range(n):
        _, ticks, res = out[i]
        assert ticks[0] in (base_tick, base_tick + 1), f"child {i} did not start from the snapshot: {ticks[:5]}"
        assert ticks == list(range(ticks[0], ticks[0] + len(ticks)))
        _, t = image_status(res.memory)  # type: ignore[attr-defined]
        assert t >= base_tick + 5 * (i + 1)
        final.append(t)
    assert len(set(final)) == n, f"children did not diverge: {final}"
    # Copy-on-write: all children wrote to their memory, the shared image did not change.
    assert sha256(base.memory) == digest
    assert image_status(base.memory)[1] == base_tick


async def test_cleanup_on_cancel_error_and_stop(driver: VmmDriver, tiny_kernel: Path, workroot: Path) -> None:
    cfg = tiny_config(workroot / "a", tiny_kernel)
    pid = 0
    with trio.move_on_after(30) as cs:
        async with driver.boot(cfg) as vm:
            pid = vm.pid
            await wait_for_tick(cfg.console_path, 1)
            cs.cancel()
            await trio.sleep_forever()
    assert cs.cancelled_caught and pid and not alive(pid)
    assert not cfg.socket_path.exists()

    cfg = tiny_config(workroot / "b", tiny_kernel)
    with pytest.raises(ZeroDivisionError):
        async with driver.boot(cfg) as vm:
            pid = vm.pid
            1 / 0  # noqa: B018
    assert not alive(pid) and not cfg.socket_path.exists()

    cfg = tiny_config(workroot / "c", tiny_kernel)
    async with driver.boot(cfg) as vm:
        pid = vm.pid
        await vm.stop()
        assert not alive(pid)
        assert vm.state is VmState.STOPPED
        assert await vm.wait() != 0  # killed
    assert not cfg.socket_path.exists()
    # What a VM leaves in its workdir: logs and the console only (no sockets, no RAM file).
    left = {p.name for p in cfg.workdir.iterdir()}
    assert left <= {"console.log", "qemu.log", "firecracker.log", "firecracker.stderr", "metrics.json", "vm.json"}


async def test_restore_rejects_bad_snapshots(driver: VmmDriver, tiny_kernel: Path, workroot: Path) -> None:
    base = await boot_and_capture(driver, tiny_kernel, workroot)
    garbage = workroot / "garbage.vmstate"
    garbage.write_bytes(os.urandom(4096))
    cfg = tiny_config(workroot / "r", tiny_kernel)
    with pytest.raises(SnapshotError):
        async with driver.restore(cfg, SnapshotFiles(garbage, base.memory, base.format)):
            pass
    small = workroot / "small.mem"
    small.write_bytes(b"\0" * 4096)
    with pytest.raises(SnapshotError, match="bytes"):
        async with driver.restore(cfg, SnapshotFiles(base.vmstate, small, base.format)):
            pass
    other = SnapshotFormat.FIRECRACKER if driver.name == "qemu" else SnapshotFormat.QEMU_MIGRATION
    with pytest.raises(SnapshotError, match="cannot restore"):
        async with driver.restore(cfg, SnapshotFiles(base.vmstate, base.memory, other)):
            pass
    assert not cfg.socket_path.exists()


async def test_diff_capture_of_a_booted_vm_is_refused(driver: VmmDriver, tiny_kernel: Path, workroot: Path) -> None:
    cfg = tiny_config(workroot / "vm", tiny_kernel)
    async with driver.boot(cfg) as vm:
        await wait_for_tick(cfg.console_path, 1)
        with pytest.raises(UnsupportedOperation, match="base image"):
            await vm.capture(workroot / "s", workroot / "m", kind=CaptureKind.DIFF)
        assert pages_of(await vm.dirty_memory_ranges()) == set(range((MEM_MIB << 20) // PAGE))


async def test_capture_twice_while_paused(driver: VmmDriver, tiny_kernel: Path, workroot: Path) -> None:
    """A second capture without running in between (same or another path) gives the same, restorable state."""
    cfg = tiny_config(workroot / "vm", tiny_kernel)
    async with driver.boot(cfg) as vm:
        await wait_for_tick(cfg.console_path, 2)
        a = await vm.capture(workroot / "a.vmstate", workroot / "a.mem")
        b = await vm.capture(workroot / "b.vmstate", workroot / "b.mem")
        again = await vm.capture(workroot / "b.vmstate", workroot / "b.mem")
    assert image_status(a.memory) == image_status(b.memory) == image_status(again.memory)
    _, tick = image_status(b.memory)
    cfg2 = tiny_config(workroot / "r", tiny_kernel)
    async with driver.restore(cfg2, again.snapshot_files()):
        await wait_for_tick(cfg2.console_path, tick + 2)
        assert console_ticks(cfg2.console_path)[0] in (tick, tick + 1)


async def test_a_kernel_the_vmm_cannot_load_is_a_start_error(driver: VmmDriver, workroot: Path) -> None:
    bad = workroot / "not-a-kernel"
    bad.write_bytes(b"\x7fELF" + os.urandom(4092))
    cfg = tiny_config(workroot / "vm", bad)
    with pytest.raises(VmmStartError) as err:
        async with driver.boot(cfg):
            pass
    assert err.value.log_tail, "the error must carry the VMM's own words"
    assert not cfg.socket_path.exists()


async def test_diff_capture_into_a_capture_buffer_restores_like_a_diff_file(
    driver: VmmDriver, tiny_kernel: Path, workroot: Path
) -> None:
    """QEMU copies the dirty pages into a lent buffer (no diff file); Firecracker writes its own file and
    leaves the buffer alone. Either way base + dirty pages restore to where the VM was."""
    from aenv_node.vmm.capture_buffer import CaptureBuffer

    base = await boot_and_capture(driver, tiny_kernel, workroot)
    _, base_tick = image_status(base.memory)
    cfg = tiny_config(workroot / "r1", tiny_kernel)
    buf = CaptureBuffer(MEM_MIB << 20)
    try:
        async with driver.restore(cfg, base.snapshot_files()) as vm:
            await wait_for_tick(cfg.console_path, base_tick + SWEEP_PAGES + 4)
            diff = await vm.capture(workroot / "vmstate1", workroot / "diff1", kind=CaptureKind.DIFF, buffer=buf)
        merged = workroot / "merged.mem"
        if driver.name == "qemu":
            assert diff.buffer is buf and not diff.memory.exists()
            assert GUEST_PAGES <= pages_of(diff.dirty_ranges)
            await trio.to_thread.run_sync(memfile.materialize_packed, base.memory, diff.dirty_ranges,
                                          buf.view[: diff.dirty_bytes], merged)
        else:
            assert diff.buffer is None and diff.memory.exists()
            await trio.to_thread.run_sync(memfile.materialize, base.memory, [(diff.memory, diff.dirty_ranges)],
                                          merged)
        magic, tick = image_status(merged)
        assert magic == MAGIC and tick >= base_tick + SWEEP_PAGES + 4
        assert pattern_ok(merged)
        cfg2 = tiny_config(workroot / "r2", tiny_kernel)
        async with driver.restore(cfg2, diff.snapshot_files(merged)):
            await wait_for_tick(cfg2.console_path, tick + 2)
            assert console_ticks(cfg2.console_path)[0] in (tick, tick + 1)
    finally:
        buf.close()
