"""The `base` template rootfs: cached by the hash of its spec and code, and shaped as sandboxes expect.

Uses the node's state directory ($AENV_STATE_DIR, default /var/lib/aenv) so the ~1 minute debootstrap runs
only when the rootfs is not built yet; the image is read with debugfs, never mounted or written.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from aenv_node.images.rootfs import RootfsSpec, ensure_base_rootfs, rootfs_hash

pytestmark = pytest.mark.slow


def debugfs(image: Path, request: str) -> str:
    return subprocess.run(["debugfs", "-R", request, str(image)], capture_output=True, text=True, check=True).stdout


@pytest.fixture(scope="module")
def base() -> Path:
    if os.geteuid() != 0 or shutil.which("debootstrap") is None:
        pytest.skip("needs root and debootstrap")
    return ensure_base_rootfs(Path(os.environ.get("AENV_STATE_DIR", "/var/lib/aenv")))


def test_second_call_is_a_cache_hit(base: Path) -> None:
    messages: list[str] = []
    assert ensure_base_rootfs(base.parent.parent, progress=messages.append) == base
    assert messages == []
    assert base.name == f"base-{rootfs_hash(RootfsSpec())}.ext4"
    assert not [p for p in base.parent.iterdir() if p.name.startswith(".tmp-")]


def test_hash_changes_with_the_spec() -> None:
    assert rootfs_hash(RootfsSpec()) == rootfs_hash(RootfsSpec())
    assert rootfs_hash(RootfsSpec(revision=2)) != rootfs_hash(RootfsSpec())
    assert rootfs_hash(RootfsSpec(include=("bash",))) != rootfs_hash(RootfsSpec())


def test_user_sudo_and_mount_point(base: Path) -> None:
    passwd = debugfs(base, "cat /etc/passwd")
    assert "user:x:1000:1000::/home/user:/bin/bash" in passwd.splitlines()
    sudo_line = next(ln for ln in debugfs(base, "cat /etc/group").splitlines() if ln.startswith("sudo:"))
    assert "user" in sudo_line.split(":")[3].split(","), sudo_line
    assert debugfs(base, "cat /etc/sudoers.d/user").strip() == "user ALL=(ALL:ALL) NOPASSWD: ALL"
    assert "Type: directory" in debugfs(base, "stat /opt/aenv")
    home = debugfs(base, "stat /home/user")
    assert "User:  1000" in home and "Type: directory" in home
    for tool in ("/usr/bin/bash", "/usr/bin/sudo", "/usr/bin/ps", "/usr/bin/ip", "/etc/ssl/certs/ca-certificates.crt"):
        assert "Type: regular" in debugfs(base, f"stat {tool}"), tool
    assert debugfs(base, "cat /etc/resolv.conf").strip() == "nameserver 8.8.8.8"
    assert ".deb" not in debugfs(base, "ls /var/cache/apt/archives")
