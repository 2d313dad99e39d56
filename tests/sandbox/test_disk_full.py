"""The node's state disk full: its state directory on a small loop-mounted ext4 that the test fills.

A capture (pause, snapshot) that finds no room answers E2B's 507 naming the full disk, keeps nothing of
itself (no snapshot row or directory, no temporary layer) and leaves the sandbox running with its files; a
template build fails with the reason in its status. Once room is made, the same pause works and the
sandbox resumes with its files.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Iterator

import pytest
from e2b import BuildException, Sandbox, Template

from ..conftest import free_pool_cidr, free_port
from .conftest import start_node, stop_node

pytestmark = pytest.mark.vm

MARK = "/home/user/full-disk.txt"


@contextlib.contextmanager
def small_disk(size: str) -> Iterator[Path]:
    """An ext4 of ``size`` on a loop device, mounted; unmounted (which frees the loop device) at the end."""
    top = Path(tempfile.mkdtemp(prefix="aenv-smalldisk-", dir="/var/tmp"))
    img, mnt = top / "disk.img", top / "mnt"
    mnt.mkdir()
    subprocess.run(["truncate", "-s", size, str(img)], check=True)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", str(img)], check=True)
    subprocess.run(["mount", "-o", "loop", str(img), str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)
        if os.path.ismount(mnt):
            subprocess.run(["umount", "-l", str(mnt)], check=False)
        shutil.rmtree(top, ignore_errors=True)


def _fill(disk: Path, leave: int) -> Path:
    """A ballast file that leaves ``leave`` bytes free on ``disk``."""
    st = os.statvfs(disk)
    ballast = disk / "ballast"
    subprocess.run(["fallocate", "-l", str(st.f_bavail * st.f_frsize - leave), str(ballast)], check=True)
    return ballast


def test_a_full_state_disk_fails_captures_and_builds_cleanly(monkeypatch: pytest.MonkeyPatch) -> None:
    with small_disk("3G") as disk:
        state = disk / "state"
        node = start_node(state, port=free_port(), pool=free_pool_cidr(), AENV_NET_WARM_SLOTS="1",
                          AENV_SNAPSHOT_PUBLISH_RETRY_INTERVAL_S="1")
        try:
            for k, v in node.sdk_env().items():
                monkeypatch.setenv(k, v)
            sb = Sandbox.create(timeout=600)
            sid = sb.sandbox_id
            sb.files.write(MARK, f"kept by {sid}")
            sb.commands.run("head -c 64M /dev/urandom > /dev/shm/dirty")  # a capture with pages to write
            snapshots_before = set(os.listdir(state / "snapshots"))
            ballast = _fill(disk, 8 << 20)

            with node.api() as c:
                for path in (f"/sandboxes/{sid}/pause", f"/sandboxes/{sid}/snapshots"):
                    r = c.post(path, json={})
                    assert r.status_code == 507, (path, r.status_code, r.text)
                    body = r.json()
                    assert body["code"] == 507 and "state disk is full" in body["message"], body
            # the sandbox runs on, with its files; nothing of the failed captures is kept
            assert node.sql(f"SELECT state FROM sandboxes WHERE id = '{sid}'") == [("running",)]
            assert sb.commands.run("echo alive").stdout == "alive\n"
            assert sb.files.read(MARK) == f"kept by {sid}"
            assert set(os.listdir(state / "snapshots")) == snapshots_before
            assert not [p for p in (state / "layers").iterdir() if p.name.startswith(".")]
            rows = node.sql(f"SELECT error FROM events WHERE sandbox_id = '{sid}' AND error IS NOT NULL")
            assert any("state disk is full" in (e or "") for (e,) in rows), rows

            # a build has no room either: it fails with the reason in its status
            with pytest.raises(BuildException):
                Template.build(Template().from_template("base").run_cmd("echo built > /home/user/b.txt"),
                               "full-disk-build")
            [(status, error)] = node.sql("SELECT status, error FROM template_builds WHERE template_id IN "
                                         "(SELECT id FROM templates WHERE alias = 'full-disk-build')")
            assert status == "error" and "No space left on device" in (error or ""), error

            # room again: the same pause works, and the sandbox comes back with its files
            ballast.unlink()
            sb.pause()
            back = Sandbox.connect(sid, timeout=600)
            assert back.files.read(MARK) == f"kept by {sid}"
            back.kill()
        finally:
            stop_node(node.proc)
            with contextlib.suppress(OSError):
                shutil.copy(node.log_path, "/var/tmp/aenv-fulldisk-last-node.log")
            # nothing of the node may hold the disk: the unmount must succeed
            assert not _holders(disk), _holders(disk)


def _holders(disk: Path) -> list[int]:
    """Processes with a file open under ``disk`` (the node's VMMs and servers must all be gone)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(str(disk)):
                    out.append(int(pid))
                    break
            except OSError:
                pass
    return out
