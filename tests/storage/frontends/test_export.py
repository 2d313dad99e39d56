"""Choosing a VM's disk frontend, and ``export_disk`` serving one device through NBD and FUSE for real
(ublk needs a kernel with ublk_drv: it is exercised in a TCG guest, test_ublk_guest.py, and in the KVM host VM)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from aenv_node.storage import FlatFileDevice
from aenv_node.storage.frontends import DiskFrontend, FrontendError, FrontendKind, choose_frontend, export_disk
from conftest import qemu_io

MiB = 1 << 20


def test_auto_gives_nbd_to_a_vmm_with_an_nbd_client(tmp_path) -> None:  # type: ignore[no-untyped-def]
    ctl = tmp_path / "ublk-control"
    ctl.touch()  # even where ublk exists: QEMU's own NBD client needs no kernel help
    assert choose_frontend("auto", vmm_takes_nbd=True, ublk_control=str(ctl)) is FrontendKind.NBD


def test_auto_gives_ublk_else_fuse_to_a_vmm_without_one(tmp_path) -> None:  # type: ignore[no-untyped-def]
    ctl = tmp_path / "ublk-control"
    assert choose_frontend("auto", vmm_takes_nbd=False, ublk_control=str(ctl)) is FrontendKind.FUSE
    ctl.touch()
    assert choose_frontend("auto", vmm_takes_nbd=False, ublk_control=str(ctl)) is FrontendKind.UBLK


def test_impossible_choices_are_refused_with_the_reason(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(FrontendError, match="no NBD client"):
        choose_frontend("nbd", vmm_takes_nbd=False)
    with pytest.raises(FrontendError, match="does not exist"):
        choose_frontend("ublk", vmm_takes_nbd=False, ublk_control=str(tmp_path / "absent"))
    with pytest.raises(FrontendError, match="auto, nbd, ublk or fuse"):
        choose_frontend("iscsi", vmm_takes_nbd=True)
    assert choose_frontend("fuse", vmm_takes_nbd=True) is FrontendKind.FUSE


@pytest.mark.parametrize("kind", [FrontendKind.NBD, FrontendKind.FUSE])
async def test_export_disk_serves_the_device_and_cleans_up(kind, tmp_path, short_dir) -> None:  # type: ignore[no-untyped-def]
    """Writes through the exported source reach the device; reads see its data; leaving the block removes the
    socket or the mount (and its directory)."""
    dev = FlatFileDevice(tmp_path / "dev.img", 8 * MiB)
    data = os.urandom(64 * 1024)
    dev.pwrite(MiB, data)
    run_dir = tmp_path / "run" if kind is FrontendKind.FUSE else Path(short_dir)
    run_dir.mkdir(exist_ok=True)
    try:
        async with export_disk(DiskFrontend(kind), dev, run_dir) as disk:
            assert disk.kind is kind
            if kind is FrontendKind.NBD:
                assert disk.source.startswith("nbd+unix://")
            else:
                assert os.path.getsize(disk.source) == 8 * MiB
                fd = os.open(disk.source, os.O_RDWR)
                try:
                    assert os.pread(fd, len(data), MiB) == data
                    os.pwrite(fd, b"\x5a" * 4096, 2 * MiB)
                    os.fsync(fd)
                finally:
                    os.close(fd)
            # the same image through QEMU's block layer, as a VMM would open it
            await qemu_io(disk.source, "write -P 0x33 4M 64k")
        assert dev.pread(4 * MiB, 64 * 1024) == b"\x33" * 64 * 1024
        if kind is FrontendKind.FUSE:
            assert dev.pread(2 * MiB, 4096) == b"\x5a" * 4096
            with open("/proc/mounts") as f:
                assert str(run_dir / "disk.fuse") not in f.read()
        assert list(run_dir.iterdir()) == [], list(run_dir.iterdir())
    finally:
        dev.close()
