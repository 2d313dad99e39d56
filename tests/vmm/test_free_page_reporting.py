"""Free page reporting for VMs restored from ONE shared copy-on-write memory image (QEMU 7.2, TCG).

QEMU 7.2 discards a reported page by punching a hole in the backing file and then MADV_DONTNEED-ing its
mapping; `QemuDriver(cow_discard=True)` runs QEMU under a seccomp filter that turns the first step into a
no-op. These tests check the filter itself on a plain process, and then, with a real Linux guest, that the
memory a restored guest frees goes back to the host while the image (and every other VM on it) is untouched.
"""

from __future__ import annotations

import dataclasses
import hashlib
import sys
from pathlib import Path

import pytest
import trio

from aenv_node.vmm import (
    BalloonConfig,
    BalloonNotAllowed,
    Drive,
    MemoryMode,
    QemuDriver,
    VmState,
)
from aenv_node.vmm.process import proc_seccomp_filters, vmm_process
from aenv_node.vmm.seccomp import punch_hole_guard, seccomp_available

from .fprguest import (
    KEEP_MIB,
    Guest,
    guest_config,
    image_anon_bytes,
    make_rootfs,
    rollup,
    wait_anon_below,
)
from .test_linux_tcg import kit  # noqa: F401  (the module-scoped guest kit fixture)
from .tinyguest import image_status, tiny_config, wait_for_tick

MiB = 1 << 20
BOOT_TIMEOUT_S = 180

# The "VMM" of the filter test: it punches a hole, preallocates, and drops a private page, then reports.
_PROBE = r"""
import ctypes, mmap, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
fd = os.open(sys.argv[1], os.O_RDWR)
punch = libc.fallocate(fd, 3, 0, 8192)
grow = libc.fallocate(fd, 0, 0, 4 * 8192)
m = mmap.mmap(fd, 8192, flags=mmap.MAP_PRIVATE)
m[0:7] = b"private"
m.madvise(mmap.MADV_DONTNEED, 0, 4096)
print(punch, grow, os.fstat(fd).st_size, m[0:7].decode(), flush=True)
"""


@pytest.fixture
def guard_or_skip() -> None:
    reason = seccomp_available()
    if reason:
        pytest.skip(reason)


@pytest.mark.parametrize("via", ["helper", "preexec"])
async def test_guard_fakes_punch_hole_and_lets_everything_else_run(
    guard_or_skip: None, tmp_path: Path, via: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under the guard (installed by vmm_process, as for QEMU: through the aenv-seccomp-exec helper that
    set-up compiles, or by preexec_fn without it) a hole punch returns 0 but leaves the file alone, other
    fallocate modes work, and MADV_DONTNEED drops a private page back to the file's content."""
    import aenv_node.vmm.process as process_mod
    from aenv_node.vmm.seccomp import exec_helper

    if via == "helper":
        assert exec_helper() is not None, "scripts/setup.d/25-seccomp-exec.sh did not install aenv-seccomp-exec"
    else:
        monkeypatch.setattr(process_mod, "exec_helper", lambda: None)
    data = tmp_path / "image"
    data.write_bytes(b"A" * 8192)
    probe = tmp_path / "probe.py"
    probe.write_text(_PROBE)
    out = tmp_path / "out"
    async with vmm_process(
        [sys.executable, str(probe), str(data)], log_path=tmp_path / "log", stdout_path=out, seccomp=punch_hole_guard()
    ) as proc:
        assert await proc.wait() == 0, proc.log_tail()
    punch, grow, size, first = out.read_text().split()
    assert (punch, grow, first) == ("0", "0", "AAAAAAA")
    assert int(size) == 4 * 8192  # mode 0 really ran
    assert data.read_bytes()[:8192] == b"A" * 8192  # the hole punch did not

    # The control: the same probe without the guard really punches the hole.
    data.write_bytes(b"A" * 8192)
    async with vmm_process(
        [sys.executable, str(probe), str(data)], log_path=tmp_path / "log", stdout_path=out
    ) as proc:
        assert await proc.wait() == 0
    assert data.read_bytes()[:8192] == bytes(8192)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(4 * MiB):
            h.update(chunk)
    return h.hexdigest()


@pytest.mark.vm
@pytest.mark.slow
async def test_restored_vms_return_freed_memory_without_touching_the_shared_image(
    kit, guard_or_skip: None, workroot: Path  # noqa: F811
) -> None:
    plain, guarded = QemuDriver(), QemuDriver(cow_discard=True)
    if not plain.binary.is_file():
        pytest.skip("qemu-system-x86_64 not installed")
    rootfs = workroot / "rootfs.ext4"
    make_rootfs(rootfs)

    # One boot: the VM owns its RAM file (share=on), so it needs no guard; it fills /tmp/keep and is
    # captured into that file (no copy): the file becomes the shared image.
    boot_cfg = guest_config(kit, workroot / "boot", rootfs, workroot / "cmd-boot")
    async with plain.boot(boot_cfg) as vm:
        assert proc_seccomp_filters(vm.pid) == 0
        g = Guest(boot_cfg)
        await g.wait_line(r"^fpr: ready", BOOT_TIMEOUT_S)
        assert (await g.wait_line(r"^fpr: balloon-driver (\d+)", 1)).group(1) == "1", "guest has no balloon driver"
        keep_md5 = (await g.wait_line(r"^fpr: keep ([0-9a-f]{32})", 1)).group(1)
        res = await vm.capture(workroot / "vmstate", boot_cfg.mem_path)
    image = res.memory
    snap = res.snapshot_files()
    sha_before = await trio.to_thread.run_sync(_sha256, image)

    def cfg(name: str):  # type: ignore[no-untyped-def]
        return guest_config(kit, workroot / name, rootfs, workroot / f"cmd-{name}", mem_mode=MemoryMode.PRIVATE)

    # Still refused where unsafe: without the guard, and with the guard but a writable file drive.
    with pytest.raises(BalloonNotAllowed, match="punch holes"):
        async with plain.restore(cfg("refused"), snap):
            pass
    writable = cfg("writable")
    writable = dataclasses.replace(writable, drives=(*writable.drives[:2], Drive(str(workroot / "cmd-writable"))))
    with pytest.raises(BalloonNotAllowed, match="writable file"):
        async with guarded.restore(writable, snap):
            pass
    assert not (workroot / "refused" / "qemu.log").exists() and not (workroot / "writable" / "qemu.log").exists()

    a_cfg, b_cfg = cfg("a"), cfg("b")
    async with guarded.restore(a_cfg, snap) as a, guarded.restore(b_cfg, snap) as b:
        assert proc_seccomp_filters(a.pid) == 1 and proc_seccomp_filters(b.pid) == 1
        ga, gb = Guest(a_cfg), Guest(b_cfg)
        assert await ga.run("ping") == "pong"

        # A overwrites the 200 MiB in place: all of it becomes private copies in QEMU A.
        assert await ga.run("dirty") == "done"
        dirty = image_anon_bytes(a.pid, image)
        assert dirty >= (KEEP_MIB - 8) * MiB, f"only {dirty >> 20} MiB private after dirtying {KEEP_MIB} MiB"
        anon_dirty = rollup(a.pid)["Anonymous"]

        # A frees it: the guest reports the free pages, QEMU drops its private copies.
        assert await ga.run("free") == "done"
        took, after = await wait_anon_below(a.pid, image, dirty - (KEEP_MIB * 3 // 4) * MiB, timeout=90)
        anon_after = rollup(a.pid)["Anonymous"]
        print(
            f"\nA private in image mapping: {dirty >> 20} -> {after >> 20} MiB in {took:.1f} s; "
            f"process Anonymous {anon_dirty >> 20} -> {anon_after >> 20} MiB"
        )
        assert anon_dirty - anon_after >= (KEEP_MIB // 2) * MiB
        assert "ram_block_discard_range" not in (a_cfg.workdir / "qemu.log").read_text(errors="replace")

        # B, which maps the same image, still sees the boot's data; A still runs.
        assert await gb.run("sum") == keep_md5
        assert await ga.run("ping") == "pong"
        assert (await a.stats()).state is VmState.RUNNING

    assert await trio.to_thread.run_sync(_sha256, image) == sha_before, "the shared memory image was modified"

    # A fresh restore from the image still has the boot's data (a punched hole would read as zeros).
    c_cfg = cfg("c")
    async with guarded.restore(c_cfg, snap):
        assert await Guest(c_cfg).run("sum") == keep_md5


@pytest.mark.vm
async def test_balloon_policy_on_copy_on_write_ram(
    qemu: QemuDriver, tiny_kernel: Path, workroot: Path, guard_or_skip: None
) -> None:
    """Cheap (the tiny guest under KVM): which restores of a shared image get the guard, which are refused,
    and that inflating the balloon of an unguarded one is refused (it would punch holes in the image too)."""
    cfg = tiny_config(workroot / "vm", tiny_kernel, balloon=BalloonConfig())
    async with qemu.boot(cfg) as vm:
        await wait_for_tick(cfg.console_path, 1)
        assert proc_seccomp_filters(vm.pid) == 0
        res = await vm.capture(workroot / "vmstate", workroot / "memory")
    snap = res.snapshot_files()
    guarded = QemuDriver(cow_discard=True)

    # Unguarded restore with a balloon that never inflates: allowed, but no inflation.
    plain_cfg = tiny_config(workroot / "p", tiny_kernel, balloon=BalloonConfig())
    async with qemu.restore(plain_cfg, snap) as vm:
        assert proc_seccomp_filters(vm.pid) == 0
        with pytest.raises(BalloonNotAllowed, match="cow_discard"):
            await vm.balloon(16)
    with pytest.raises(BalloonNotAllowed, match="inflating"):
        async with qemu.restore(tiny_config(workroot / "q", tiny_kernel, balloon=BalloonConfig(amount_mib=8)), snap):
            pass

    # Guarded: QEMU runs under the filter, inflation is allowed.
    g_cfg = tiny_config(workroot / "g", tiny_kernel, balloon=BalloonConfig())
    async with guarded.restore(g_cfg, snap) as vm:
        assert proc_seccomp_filters(vm.pid) == 1
        await vm.balloon(16)
        _, tick = image_status(res.memory)
        await wait_for_tick(g_cfg.console_path, tick + 2)
    # ... but not for a guest that expects reported pages to read as zeros.
    bad = tiny_config(workroot / "z", tiny_kernel, balloon=BalloonConfig(), cmdline="init_on_free=1")
    with pytest.raises(BalloonNotAllowed, match="init_on_free"):
        async with guarded.restore(bad, snap):
            pass
    # A VM that owns its memory never needs the guard.
    async with guarded.boot(tiny_config(workroot / "o", tiny_kernel, balloon=BalloonConfig())) as vm:
        assert proc_seccomp_filters(vm.pid) == 0
