"""A capture quiesces the guest's filesystem (E2B #1104): envd syncs and freezes it before the capture and
thaws it after (a pause's guest at its resume), so the disk layer a pause seals is a clean ext4 holding every
write acknowledged before the pause, also one never fsynced, and a writer that fsyncs as fast as it can goes on
across TTL pauses and snapshots. The sealed layers are read on the host, as any other reader of them would:
the stack exported to a raw image, checked with e2fsck and read with debugfs."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
from e2b import Sandbox

from aenv_node.storage import Image

from .conftest import NodeProcess, node_in_tmp

pytestmark = pytest.mark.vm

CHUNK = 4 << 20


def _paused_snapshot(node: NodeProcess, sid: str) -> str:
    node.wait_state(sid, "paused")  # a pause answers before its capture is persisted
    (state, snap), = node.sql(f"SELECT state, snapshot_id FROM sandboxes WHERE id = '{sid}'")
    assert state == "paused", state
    return str(snap)


def _export_disk(node: NodeProcess, snapshot_id: str, out: Path) -> Path:
    """The snapshot's disk stack as a sparse raw image."""
    paths = [Path(p) for (p,) in node.sql(
        "SELECT l.local_path FROM snapshot_layers sl JOIN layers l ON l.digest = sl.layer_digest "
        f"WHERE sl.snapshot_id = '{snapshot_id}' AND sl.kind = 'disk' ORDER BY sl.position")]
    assert paths and all(p.exists() for p in paths), paths
    image = Image.open(paths)
    try:
        with open(out, "wb") as f:
            for off in range(0, image.size, CHUNK):
                data = image.pread(off, min(CHUNK, image.size - off))
                if data.count(0) != len(data):
                    f.seek(off)
                    f.write(data)
            f.truncate(image.size)
    finally:
        image.close()
    return out


def _fsck_clean(raw: Path) -> None:
    r = subprocess.run(["e2fsck", "-fn", str(raw)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"the sealed filesystem is not clean ({r.returncode}):\n{r.stdout}{r.stderr}"


def _cat(raw: Path, path: str) -> str:
    r = subprocess.run(["debugfs", "-R", f"cat {path}", str(raw)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


def _wait_state(node: NodeProcess, sid: str, state: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while node.sql(f"SELECT state FROM sandboxes WHERE id = '{sid}'") != [(state,)]:
        assert time.monotonic() < deadline, node.sql(f"SELECT state FROM sandboxes WHERE id = '{sid}'")
        time.sleep(0.3)


def test_a_pause_seals_a_clean_filesystem_with_a_write_never_synced(sdk_env: NodeProcess, tmp_path: Path) -> None:
    sb = Sandbox.create(timeout=600)
    try:
        # written, not synced: without a quiesce it sits in the guest's page cache (ext4 commits every 5 s)
        sb.commands.run("printf written-before-the-pause > /home/user/unsynced")
        sb.pause()
        raw = _export_disk(sdk_env, _paused_snapshot(sdk_env, sb.sandbox_id), tmp_path / "disk.raw")
        _fsck_clean(raw)
        assert _cat(raw, "/home/user/unsynced") == "written-before-the-pause"
        # the resumed guest is thawed: writes and a sync finish
        sb = Sandbox.connect(sb.sandbox_id)
        sb.files.write("/home/user/after", "thawed")
        assert sb.commands.run("sync && cat /home/user/after", timeout=30).stdout == "thawed"
        messages = [m for (m,) in sdk_env.sql(f"SELECT message FROM sandbox_logs WHERE sandbox_id = '{sb.sandbox_id}' "
                                               "AND source = 'envd' ORDER BY ts, id")]
        assert "froze / for a capture" in messages and "thawed / (resumed)" in messages, messages
    finally:
        sb.kill()


# The counter is replaced atomically (a new file, fsynced, renamed over it, the directory fsynced), so at any
# instant it holds a whole number; each value is acknowledged in `acked` once its replacement is durable.
WRITER = """
import os
n = 0
home = os.open("/home/user", os.O_RDONLY)
while True:
    n += 1
    with open("/home/user/counter.new", "w") as f:
        f.write(str(n)); f.flush(); os.fsync(f.fileno())
    os.rename("/home/user/counter.new", "/home/user/counter"); os.fsync(home)
    with open("/home/user/acked", "a") as f:
        f.write(f"{n}\\n"); f.flush(); os.fsync(f.fileno())
"""


def _count(sb: Sandbox) -> int:
    return int(sb.commands.run("cat /home/user/counter").stdout)


def test_an_fsyncing_writer_goes_on_across_ttl_pauses_and_snapshots(sdk_env: NodeProcess, tmp_path: Path) -> None:
    sb = Sandbox.create(timeout=600)
    sid = sb.sandbox_id
    try:
        sb.files.write("/home/user/writer.py", WRITER)
        sb.commands.run("python3 /home/user/writer.py", background=True)
        for round_ in range(2):
            time.sleep(2)
            sb.set_timeout(2)  # its end comes in 2 s: the TTL wheel pauses it (autoPause)
            _wait_state(sdk_env, sid, "paused")
            raw = _export_disk(sdk_env, _paused_snapshot(sdk_env, sid), tmp_path / f"disk{round_}.raw")
            _fsck_clean(raw)
            counter, acked = _cat(raw, "/home/user/counter"), _cat(raw, "/home/user/acked").split()
            # every fsync that returned before the pause is on the layer, and no file is torn
            assert counter.isdigit() and acked, (counter, acked[-3:])
            assert int(counter) in (int(acked[-1]), int(acked[-1]) + 1), (counter, acked[-3:])
            assert acked == [str(i) for i in range(1, len(acked) + 1)]
            sb = Sandbox.connect(sid, timeout=600)
            before = _count(sb)
            time.sleep(1)
            assert _count(sb) > before >= int(counter), "the writer did not go on after the resume"
        # a snapshot keeps the sandbox running with its memory: not frozen, the writer goes on
        froze = _froze(sdk_env, sid)
        with sdk_env.api() as api:
            r = api.post(f"/sandboxes/{sid}/snapshots", json={})
            assert r.status_code == 201, r.text
        before = _count(sb)
        time.sleep(1)
        assert _count(sb) > before and _froze(sdk_env, sid) == froze == 2
    finally:
        Sandbox.kill(sid)


def _froze(node: NodeProcess, sid: str) -> int:
    return int(node.sql(f"SELECT count(*) FROM sandbox_logs WHERE sandbox_id = '{sid}' "
                        "AND message = 'froze / for a capture'")[0][0])


def test_quiesce_off_pauses_without_freezing() -> None:
    with node_in_tmp("aenv-noquiesce-", AENV_SNAPSHOT_QUIESCE="off") as node:
        with node.api() as api:
            r = api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 600})
            assert r.status_code == 201, r.text
            sid = r.json()["sandboxID"]
            assert api.post(f"/sandboxes/{sid}/pause", json={}).status_code == 204
            assert api.post(f"/sandboxes/{sid}/connect", json={"timeout": 600}).status_code == 201
            api.delete(f"/sandboxes/{sid}")
        assert _froze(node, sid) == 0
        assert node.sql(f"SELECT count(*) FROM sandbox_logs WHERE sandbox_id = '{sid}' AND message LIKE 'thawed%'") == [
            (0,)]
