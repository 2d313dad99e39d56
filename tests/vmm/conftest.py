"""Fixtures for the VMM driver tests: the tiny guest, each driver, a short work directory.

The VM tests run real VMs (QEMU microvm and Firecracker under this host's KVM) with the tiny PVH guest;
they skip with a reason when /dev/kvm or a VMM binary is missing. Every test's work directory is checked
afterwards: no VMM process may survive the test and no socket may be left in it.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from aenv_node.vmm import FirecrackerDriver, QemuDriver, VmmDriver, detect_accel
from aenv_node.vmm.firecracker.driver import DEFAULT_FIRECRACKER
from aenv_node.vmm.qemu.driver import DEFAULT_QEMU

from .tinyguest import build_tiny_guest


@pytest.fixture(scope="session")
def tiny_kernel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_guest(tmp_path_factory.mktemp("tinyguest"))


def _kvm_or_skip() -> None:
    if not detect_accel().kvm:
        pytest.skip("/dev/kvm is not usable on this host")


@pytest.fixture(params=["qemu", "firecracker"])
def driver(request: pytest.FixtureRequest) -> VmmDriver:
    _kvm_or_skip()
    if request.param == "qemu":
        if not DEFAULT_QEMU.is_file():
            pytest.skip(f"{DEFAULT_QEMU} missing (apt: qemu-system-x86)")
        return QemuDriver()
    if not DEFAULT_FIRECRACKER.is_file():
        pytest.skip(f"{DEFAULT_FIRECRACKER} missing (scripts/setup.d/30-firecracker.sh)")
    return FirecrackerDriver()


@pytest.fixture
def qemu() -> QemuDriver:
    _kvm_or_skip()
    if not DEFAULT_QEMU.is_file():
        pytest.skip(f"{DEFAULT_QEMU} missing (apt: qemu-system-x86)")
    return QemuDriver()


@pytest.fixture
def netns() -> Iterator[Path]:
    """A network namespace holding an up tap device `tap0`; deleted afterwards."""
    name = f"aenv-vmmt-{secrets.token_hex(3)}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(["ip", "-n", name, "tuntap", "add", "dev", "tap0", "mode", "tap"], check=True)
        subprocess.run(["ip", "-n", name, "link", "set", "tap0", "up"], check=True)
        yield Path("/run/netns") / name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


@pytest.fixture
def workroot() -> Iterator[Path]:
    """A short directory (unix socket paths are limited to 107 bytes) removed after the test.

    Fails the test if a process still has a file open under it or a socket is left in it.
    """
    root = Path(tempfile.mkdtemp(prefix="vmm-", dir="/tmp"))
    try:
        yield root
        sockets = [p for p in root.rglob("*") if p.is_socket()]
        assert not sockets, f"sockets left behind: {sockets}"
        holders = _pids_holding(root)
        assert not holders, f"processes still hold files under {root}: {holders}"
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _pids_holding(root: Path) -> list[int]:
    me = os.getpid()
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == me:
            continue
        try:
            for fd in (d / "fd").iterdir():
                if os.readlink(fd).startswith(str(root)):
                    out.append(int(d.name))
                    break
        except OSError:
            continue
    return out
