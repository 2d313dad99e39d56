"""envd's /quiesce and /thaw on a real filesystem of the test's own (a loop-mounted ext4, frozen with the
FIFREEZE ioctl as the guest's root is): writers block while it is frozen and go on after /thaw or the /init of
a resume; an envd given no --quiesce-path only syncs."""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

from .conftest import EnvdProcess, GuestUser, start_envd, stop_envd


@pytest.fixture
def ext4_mount(tmp_path: Path) -> Iterator[Path]:
    image, mnt = tmp_path / "fs.img", Path(tempfile.mkdtemp(prefix="quiesce-"))
    subprocess.run(["truncate", "-s", "64M", str(image)], check=True)
    subprocess.run(["mkfs.ext4", "-q", str(image)], check=True)
    subprocess.run(["mount", "-o", "loop", str(image), str(mnt)], check=True)  # the loop device goes with umount
    try:
        yield mnt
    finally:
        subprocess.run(["fsfreeze", "-u", str(mnt)], capture_output=True)  # never leave a frozen mount behind
        subprocess.run(["umount", str(mnt)], check=True)
        mnt.rmdir()


def _writer(path: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(["sh", "-c", f"echo written > {path} && sync {path}"])


def _blocked(proc: subprocess.Popen[bytes], for_s: float = 1.5) -> bool:
    try:
        proc.wait(timeout=for_s)
        return False
    except subprocess.TimeoutExpired:
        return True


def test_quiesce_freezes_until_thaw_or_init(test_user: GuestUser, ext4_mount: Path) -> None:
    envd: EnvdProcess = start_envd(test_user.name, "--quiesce-path", str(ext4_mount))
    try:
        with envd.client() as c:
            assert c.post("/init", json={"accessToken": "tok"}).status_code == 204
            assert c.post("/quiesce").status_code == 401  # the node's call: it needs the token
            auth = {"x-access-token": "tok"}
            assert c.post("/quiesce", headers=auth).json() == {"frozen": True}
            assert c.post("/quiesce", headers=auth).json() == {"frozen": True}  # a second freeze is the same one
            w = _writer(ext4_mount / "a")
            assert _blocked(w), "a write went through a frozen filesystem"
            assert c.post("/thaw", headers=auth).json() == {"thawed": True}
            assert w.wait(timeout=30) == 0 and (ext4_mount / "a").read_text() == "written\n"
            assert c.post("/thaw", headers=auth).json() == {"thawed": False}
            # a pause leaves the guest frozen: the /init of its resume thaws it
            assert c.post("/quiesce", headers=auth).json() == {"frozen": True}
            w = _writer(ext4_mount / "b")
            assert _blocked(w)
            assert c.post("/init", json={"accessToken": "tok"}, headers=auth).status_code == 204
            assert w.wait(timeout=30) == 0
        assert "froze" in envd.log() and "thawed" in envd.log()
    finally:
        stop_envd(envd)


def test_without_a_quiesce_path_envd_only_syncs(envd: EnvdProcess) -> None:
    with envd.client() as c:
        r = c.post("/quiesce")
        assert r.status_code == 200 and r.json()["frozen"] is False and "no --quiesce-path" in r.json()["reason"]
        assert c.post("/thaw").json() == {"thawed": False}
