"""Devices and driver rules, with real VMs: a tap NIC in a network namespace, file drives, the balloon,
and the configurations each driver must refuse."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from aenv_node.vmm import (
    BalloonConfig,
    BalloonNotAllowed,
    CaptureKind,
    Drive,
    FirecrackerDriver,
    MemoryMode,
    NetIf,
    QemuDriver,
    SnapshotError,
    UnsupportedOperation,
    VmmApiError,
    VmmConfigError,
    VmmDriver,
)

from .tinyguest import console_ticks, image_status, tiny_config, wait_for_tick

pytestmark = pytest.mark.vm


def tap_flags(netns: Path) -> list[str]:
    out = subprocess.run(
        ["ip", "-n", netns.name, "-j", "link", "show", "tap0"], check=True, capture_output=True, text=True
    ).stdout
    return json.loads(out)[0]["flags"]


def open_files(pid: int) -> set[str]:
    out = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            out.add(os.readlink(fd))
        except OSError:
            pass
    return out


async def test_tap_nic_in_netns_and_file_drives(
    driver: VmmDriver, tiny_kernel: Path, workroot: Path, netns: Path
) -> None:
    ro, rw = workroot / "ro.img", workroot / "rw.img"
    for f in (ro, rw):
        with open(f, "wb") as fh:
            fh.truncate(1 << 20)
    assert "LOWER_UP" not in tap_flags(netns)  # nobody holds the tap yet: no carrier
    cfg = tiny_config(
        workroot / "vm",
        tiny_kernel,
        net=NetIf(tap="tap0", mac="06:00:ac:10:00:02"),
        netns=netns,
        drives=(Drive(str(ro), read_only=True), Drive(str(rw))),
    )
    async with driver.boot(cfg) as vm:
        await wait_for_tick(cfg.console_path, 2)
        assert os.stat(f"/proc/{vm.pid}/ns/net").st_ino == os.stat(netns).st_ino
        assert "LOWER_UP" in tap_flags(netns)  # the VMM opened the tap
        files = open_files(vm.pid)
        assert str(ro) in files and str(rw) in files
        res = await vm.capture(workroot / "vmstate", workroot / "memory")
    assert "LOWER_UP" not in tap_flags(netns)
    # Restore into the same slot (same netns, same tap name): the NIC comes back.
    cfg2 = tiny_config(workroot / "r", tiny_kernel, net=cfg.net, netns=netns, drives=cfg.drives)
    _, tick = image_status(res.memory)
    async with driver.restore(cfg2, res.snapshot_files()) as vm2:
        await wait_for_tick(cfg2.console_path, tick + 2)
        assert "LOWER_UP" in tap_flags(netns)
        assert os.stat(f"/proc/{vm2.pid}/ns/net").st_ino == os.stat(netns).st_ino


async def test_balloon_device(driver: VmmDriver, tiny_kernel: Path, workroot: Path) -> None:
    """A balloon configured at boot; run-time targets reach the VMM (the tiny guest has no balloon driver,
    so nothing is reclaimed)."""
    cfg = tiny_config(workroot / "vm", tiny_kernel, balloon=BalloonConfig(amount_mib=0, deflate_on_oom=True))
    async with driver.boot(cfg) as vm:
        await wait_for_tick(cfg.console_path, 1)
        if driver.name == "firecracker":
            # Firecracker only takes a new target once the guest driver activated the device.
            with pytest.raises(VmmApiError, match="not activated"):
                await vm.balloon(16)
        else:
            await vm.balloon(16)
            st = await vm.stats()
            assert st.vmm["balloon_actual_bytes"] == cfg.mem_bytes  # no guest driver: nothing taken yet
        with pytest.raises(VmmConfigError):
            await vm.balloon(cfg.mem_mib)
        await wait_for_tick(cfg.console_path, 3)


async def test_qemu_refuses_free_page_reporting_on_a_shared_image(
    qemu: QemuDriver, tiny_kernel: Path, workroot: Path
) -> None:
    """host-facts DANGER: free page reporting with share=off RAM punches holes in the image file itself."""
    cfg = tiny_config(workroot / "vm", tiny_kernel)
    async with qemu.boot(cfg) as vm:
        await wait_for_tick(cfg.console_path, 1)
        res = await vm.capture(workroot / "vmstate", workroot / "memory")
    fpr = BalloonConfig(free_page_reporting=True)
    bad = tiny_config(workroot / "r", tiny_kernel, balloon=fpr)
    with pytest.raises(BalloonNotAllowed):
        async with qemu.restore(bad, res.snapshot_files()):
            pass
    assert not (workroot / "r" / "qemu.log").exists(), "no QEMU may have been started"
    # Allowed where the VM owns its memory: a booted VM's own RAM file, or an image declared exclusive.
    ok_boot = tiny_config(workroot / "b", tiny_kernel, balloon=fpr)
    async with qemu.boot(ok_boot) as vm:
        await wait_for_tick(ok_boot.console_path, 1)
    own = workroot / "own.mem"
    own.write_bytes(res.memory.read_bytes())
    ok_restore = tiny_config(workroot / "x", tiny_kernel, balloon=fpr, mem_exclusive=True)
    _, tick = image_status(own)
    async with qemu.restore(ok_restore, res.snapshot_files(own)):
        await wait_for_tick(ok_restore.console_path, tick + 2)


async def test_qemu_capture_into_its_own_ram_file_seals_the_vm(
    qemu: QemuDriver, tiny_kernel: Path, workroot: Path
) -> None:
    """Capturing into the VM's own RAM file costs no copy, but that VM must never run again."""
    cfg = tiny_config(workroot / "vm", tiny_kernel)
    async with qemu.boot(cfg) as vm:
        await wait_for_tick(cfg.console_path, 2)
        res = await vm.capture(workroot / "vmstate", cfg.mem_path)
        with pytest.raises(SnapshotError, match="cannot run again"):
            await vm.resume()
    assert cfg.mem_path.exists(), "the image was handed over: it must survive the VM"
    _, tick = image_status(res.memory)
    cfg2 = tiny_config(workroot / "r", tiny_kernel)
    async with qemu.restore(cfg2, res.snapshot_files()):
        await wait_for_tick(cfg2.console_path, tick + 2)
        assert console_ticks(cfg2.console_path)[0] in (tick, tick + 1)


def test_qemu_command_line_for_nbd_and_tcg(tiny_kernel: Path, workroot: Path) -> None:
    from aenv_node.vmm import Accel

    cfg = tiny_config(
        workroot / "vm",
        tiny_kernel,
        drives=(Drive("nbd+unix:///?socket=/run/x.sock", read_only=True),),
        accel=Accel.TCG,
    )
    argv = QemuDriver()._argv(cfg, mem_path=cfg.mem_path, share=True, incoming=None)
    line = " ".join(argv)
    assert "file=nbd+unix:///?socket=/run/x.sock,format=raw" in line and "readonly=on" in line
    assert "-accel tcg,tb-size=16" in line and "-cpu max" in line
    assert "share=on" in line


async def test_firecracker_refusals(tiny_kernel: Path, workroot: Path) -> None:
    fc = FirecrackerDriver()
    if not fc.binary.is_file():
        pytest.skip("firecracker not installed")
    nbd = tiny_config(workroot / "a", tiny_kernel, drives=(Drive("nbd+unix:///?socket=/x"),))
    with pytest.raises(VmmConfigError, match="NBD"):
        async with fc.boot(nbd):
            pass
    fpr = tiny_config(workroot / "b", tiny_kernel, balloon=BalloonConfig(free_page_reporting=True))
    with pytest.raises(VmmConfigError, match="free page reporting"):
        async with fc.boot(fpr):
            pass


async def test_firecracker_diff_after_full_capture_of_a_booted_vm(tiny_kernel: Path, workroot: Path) -> None:
    """Firecracker's Diff = pages dirtied since the previous snapshot, also without a restore in between."""
    fc = FirecrackerDriver()
    if not fc.binary.is_file():
        pytest.skip("firecracker not installed")
    cfg = tiny_config(workroot / "vm", tiny_kernel)
    async with fc.boot(cfg) as vm:
        await wait_for_tick(cfg.console_path, 2)
        full = await vm.capture(workroot / "s1", workroot / "m1")
        _, t1 = image_status(full.memory)
        await vm.resume()
        await wait_for_tick(cfg.console_path, t1 + 3)
        diff = await vm.capture(workroot / "s2", workroot / "m2", kind=CaptureKind.DIFF)
    assert diff.dirty_bytes < 32 * 4096
    _, t2 = image_status(diff.memory)
    assert t2 >= t1 + 3


async def test_qemu_anonymous_ram_boots_but_cannot_be_captured(
    qemu: QemuDriver, tiny_kernel: Path, workroot: Path
) -> None:
    cfg = tiny_config(workroot / "vm", tiny_kernel, mem_mode=MemoryMode.ANONYMOUS)
    async with qemu.boot(cfg) as vm:
        await wait_for_tick(cfg.console_path, 2)
        assert not cfg.mem_path.exists()
        with pytest.raises(UnsupportedOperation, match="shared memory file"):
            await vm.capture(workroot / "s", workroot / "m")
