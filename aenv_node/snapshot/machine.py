"""One sandbox machine, assembled: disk image + disk frontend + network slot + VMM process.

Template builds (boot) and sandboxes (restore) run the same machine; only the
way the VMM starts differs. ``open_machine`` owns, for the duration of its
``async with``, the frontend exporting the rootfs image (NBD, ublk or FUSE, as
the node's ``DiskFrontend`` says: storage/frontends/export.py) and the VMM process;
the caller owns the image (it seals or discards it) and the slot (it returns it
to the pool). Leaving the block, by any path, stops the VMM first and the disk
server second, so the guest never sees its disk vanish under it.

The VM shape (vcpus, memory, devices in order, MAC, kernel command line) must
be identical between the boot that captured a snapshot and every restore of
it: ``MachineShape`` (``state/records.py``) is stored with the snapshot and handed back here.

A node with a data plane serves a sandbox's disk there: ``open_machine`` then gets the ``disk_source`` the
data plane answered instead of a device to export, and ``attach_machine`` takes over a machine a previous
run of the node left running (the same configuration, rebuilt by ``machine_config``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator

from ..net import Slot
from ..state import MachineShape
from ..storage import BlockDevice
from ..storage.frontends import DiskExport, DiskFrontend, export_disk
from ..vmm import Accel, BalloonConfig, Drive, MemoryMode, NetIf, SnapshotFiles, Vm, VmConfig, VmmDriver
from ..vmm.process import ChildProcess

__all__ = ["Machine", "attach_machine", "machine_config", "open_machine"]


@dataclass
class Machine:
    vm: Vm
    #: the frontend this process serves the disk through (None: the data plane serves it)
    disk: DiskExport | None
    slot: Slot
    config: VmConfig


def machine_config(shape: MachineShape, *, disk_source: str, slot: Slot, workdir: Path, run_dir: Path,
                   name: str, booted: bool, mem_file: Path | None = None) -> VmConfig:
    """The VMM configuration of a machine of ``shape`` (the same for a start and a later take-over)."""
    return VmConfig(
        workdir=workdir,
        kernel=Path(shape.kernel),
        vcpus=shape.vcpus,
        mem_mib=shape.mem_mib,
        initrd=Path(shape.initrd) if shape.initrd else None,
        cmdline=shape.cmdline,
        # (a VM imported without the guest kit has no tools image: ``aenv-node template import-vm``)
        drives=(Drive(disk_source),) + ((Drive(shape.tools_img, read_only=True),) if shape.tools_img else ()),
        net=NetIf(tap=slot.tap, mac=slot.guest_mac),
        mem_file=mem_file,
        mem_mode=MemoryMode.SHARED if booted else MemoryMode.PRIVATE,
        api_socket=run_dir / "vmm.sock",
        pid_file=run_dir / "vmm.pid",
        console_log=workdir / "console.log",
        netns=Path(slot.netns_path),
        accel=Accel(shape.accel),
        name=name,
        # the guest hands pages it frees back to the host (QEMU restores run under its discard guard)
        balloon=BalloonConfig(free_page_reporting=True) if shape.free_page_reporting else None,
    )


@contextlib.asynccontextmanager
async def open_machine(
    driver: VmmDriver,
    shape: MachineShape,
    *,
    disk: BlockDevice | None = None,  # the image over the template's layers + this machine's upper
    disk_source: str | None = None,  # or: where the data plane serves it
    slot: Slot,
    workdir: Path,
    run_dir: Path,
    snapshot: SnapshotFiles | None = None,
    mem_file: Path | None = None,
    name: str = "aenv-vm",
    frontend: DiskFrontend,
) -> AsyncIterator[Machine]:
    """Start the machine: boot it (``snapshot`` None; RAM in ``mem_file`` mapped shared, so a later capture
    only saves device state) or restore it from ``snapshot`` (its memory image mapped copy-on-write)."""
    workdir.mkdir(parents=True, exist_ok=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    async with contextlib.AsyncExitStack() as stack:
        exported: DiskExport | None = None
        if disk is not None:
            exported = await stack.enter_async_context(export_disk(frontend, disk, run_dir))
            disk_source = exported.source
        if disk_source is None:
            raise ValueError("open_machine needs a disk or a disk_source")
        config = machine_config(shape, disk_source=disk_source, slot=slot, workdir=workdir, run_dir=run_dir,
                                name=name, booted=snapshot is None, mem_file=mem_file)
        if snapshot is None:
            ctx = driver.boot(config)
        else:
            ctx = driver.restore(config, snapshot)
        async with ctx as vm:
            yield Machine(vm=vm, disk=exported, slot=slot, config=config)


@contextlib.asynccontextmanager
async def attach_machine(driver: VmmDriver, shape: MachineShape, *, disk_source: str, slot: Slot, workdir: Path,
                         run_dir: Path, restored_from: SnapshotFiles, proc: ChildProcess,
                         name: str) -> AsyncIterator[Machine]:
    """Take over the machine a previous run of the node restored from ``restored_from`` and left running in
    ``proc``, its disk served by the data plane at ``disk_source``; leaving the block stops it."""
    config = machine_config(shape, disk_source=disk_source, slot=slot, workdir=workdir, run_dir=run_dir,
                            name=name, booted=False)
    async with driver.attach(config, restored_from, proc) as vm:
        yield Machine(vm=vm, disk=None, slot=slot, config=config)
