"""Pause to nothing, resume, snapshots, fork and restart survival, through the unmodified E2B SDK."""

from __future__ import annotations

import hashlib
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox

from aenv_node.storage.layer import LayerReader

from .test_density import _sha256
from .test_e2b_sdk import _wait_state

pytestmark = pytest.mark.vm

COUNTER = ("nohup bash -c 'i=0; while true; do i=$((i+1)); echo $i > /home/user/counter; sleep 0.2; done'"
           " >/dev/null 2>&1 &")


def _counter(sb: Sandbox) -> int:
    # the counter file is rewritten in place: a read can land between its truncation and the write
    for _ in range(50):
        text = sb.files.read("/home/user/counter").strip()
        if text:
            return int(text)
        time.sleep(0.05)
    raise AssertionError("the counter file stays empty")


def _vmm_alive(node, sid: str) -> bool:
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    return sid in ps


def test_pause_then_connect_continues_with_files_and_processes(sdk_env) -> None:
    sb = Sandbox.create()
    try:
        sb.commands.run(COUNTER)
        sb.files.write("/home/user/keep.txt", "kept across pause")
        time.sleep(1)
        before = _counter(sb)
        assert sb.pause() is True
        sdk_env.wait_state(sb.sandbox_id, "paused")
        # paused to nothing: no VMM process, no slot, a committed pause snapshot
        assert not _vmm_alive(sdk_env, sb.sandbox_id)
        state, snap, pid, slot = sdk_env.sql(
            f"SELECT state, snapshot_id, vmm_pid, slot_index FROM sandboxes WHERE id = '{sb.sandbox_id}'")[0]
        assert (state, pid, slot) == ("paused", None, None)
        assert sdk_env.sql(f"SELECT kind, status FROM snapshots WHERE id = '{snap}'") == [("pause", "committed")]
        assert [s.state.value for s in Sandbox.list().next_items() if s.sandbox_id == sb.sandbox_id] == ["paused"]
        assert sb.pause() is False  # E2B: 409 -> already paused

        again = Sandbox.connect(sb.sandbox_id)
        assert again.files.read("/home/user/keep.txt") == "kept across pause"
        time.sleep(1)
        after = _counter(again)
        assert after > before  # the background process kept counting after the resume
        # pause, resume, pause, resume keeps everything
        again.files.write("/home/user/second.txt", "round two")
        first_image = Path(sdk_env.sql(f"SELECT memory_location FROM snapshots "
                                       f"WHERE id = '{snap}'")[0][0])
        first_inode = first_image.stat().st_ino
        again.pause()
        sdk_env.wait_state(sb.sandbox_id, "paused")
        # the first pause snapshot was this sandbox's alone: the second took its memory image over (moved
        # and patched in place, not copied)
        snap2 = sdk_env.sql(f"SELECT snapshot_id FROM sandboxes WHERE id = '{sb.sandbox_id}'")[0][0]
        second_image = Path(sdk_env.sql(f"SELECT memory_location FROM snapshots "
                                        f"WHERE id = '{snap2}'")[0][0])
        assert second_image != first_image and second_image.stat().st_ino == first_inode
        assert not first_image.exists()
        third = Sandbox.connect(sb.sandbox_id)
        assert third.files.read("/home/user/second.txt") == "round two"
        assert third.files.read("/home/user/keep.txt") == "kept across pause"
        time.sleep(1)
        assert _counter(third) > after
        lineage = httpx.get(f"{sdk_env.url}/snapshots/{third.get_info().sandbox_id and snap}/lineage",
                            headers={"X-API-KEY": sdk_env.api_key}).json()
        assert [x["kind"] for x in lineage] == ["pause", "boot"]
    finally:
        Sandbox.kill(sb.sandbox_id)


def test_what_follows_a_pause_waits_for_its_persist(sdk_env) -> None:
    """A pause answers once the guest is captured (the session's node has a data plane) and persists behind the
    answer: a connect right after it resumes from the committed pause snapshot, and a kill right after it is a
    kill (it waits for the pause's end, then ends the paused sandbox), not lost to the pause."""
    first, second = Sandbox.create(), Sandbox.create()
    try:
        for sb in (first, second):
            sb.files.write("/home/user/keep.txt", f"kept by {sb.sandbox_id}")
            sb.commands.run("head -c 128M /dev/urandom > /dev/shm/ballast")  # a persist with pages to write
        assert first.pause() is True
        assert Sandbox.get_info(first.sandbox_id).state.value == "paused"
        back = Sandbox.connect(first.sandbox_id)
        assert back.files.read("/home/user/keep.txt") == f"kept by {first.sandbox_id}"
        ops = sdk_env.sql(f"SELECT operation, to_state FROM events WHERE sandbox_id = '{first.sandbox_id}' "
                          "AND to_state IN ('paused', 'running') ORDER BY id")
        assert ops[-2:] == [("pause", "paused"), ("resume", "running")], ops
        commit = sdk_env.sql(f"SELECT detail FROM events WHERE sandbox_id = '{first.sandbox_id}' AND "
                             "operation = 'snapshot_commit' ORDER BY id DESC LIMIT 1")[0][0]
        assert '"quiesce_ms"' in commit and '"paused_ms"' in commit, commit  # the guest-visible part, recorded

        assert second.pause() is True
        assert Sandbox.kill(second.sandbox_id) is True
        assert sdk_env.sql(f"SELECT state FROM sandboxes WHERE id = '{second.sandbox_id}'") == [("killed",)]
        ops = sdk_env.sql(f"SELECT operation, to_state FROM events WHERE sandbox_id = '{second.sandbox_id}' "
                          "AND to_state IN ('paused', 'killed') ORDER BY id")
        assert ops == [("pause", "paused"), ("kill", "killed")], ops
        assert not _vmm_alive(sdk_env, second.sandbox_id)
    finally:
        for sb in (first, second):
            Sandbox.kill(sb.sandbox_id)


def test_memory_layers_are_incremental(sdk_env) -> None:
    sb = Sandbox.create()
    try:
        sb.pause()
        sdk_env.wait_state(sb.sandbox_id, "paused")
        snap = sdk_env.sql(f"SELECT snapshot_id FROM sandboxes WHERE id = '{sb.sandbox_id}'")[0][0]
        rows = sdk_env.sql(
            "SELECT l.kind, l.size_bytes, l.virtual_size_bytes FROM snapshot_layers sl "
            f"JOIN layers l ON l.digest = sl.layer_digest WHERE sl.snapshot_id = '{snap}' AND sl.kind = 'memory'")
        assert len(rows) == 1
        kind, size, vsize = rows[0]
        assert kind == "memory" and vsize == 512 * 2**20
        assert size < vsize / 4  # only the dirtied pages, not the guest's memory
    finally:
        Sandbox.kill(sb.sandbox_id)


def test_ttl_pauses_and_traffic_auto_resumes(sdk_env) -> None:
    sb = Sandbox.create(timeout=3, lifecycle={"on_timeout": "pause", "auto_resume": True})
    try:
        sb.files.write("/home/user/t.txt", "before timeout")
        _wait_state(sdk_env, sb.sandbox_id, "paused")
        # traffic for a paused autoResume sandbox resumes it first
        assert sb.files.read("/home/user/t.txt") == "before timeout"
        assert sdk_env.sql(f"SELECT state FROM sandboxes WHERE id = '{sb.sandbox_id}'") == [("running",)]
    finally:
        Sandbox.kill(sb.sandbox_id)


def _pause_in_background(sdk_env, sb: Sandbox) -> threading.Thread:
    """Dirty ~200 MiB of guest memory (so the pause has real work to do), start ``sb.pause()`` in a thread and
    return once the node has the sandbox in ``pausing``."""
    sb.commands.run("head -c 200M /dev/urandom > /dev/shm/ballast")
    t = threading.Thread(target=sb.pause)
    t.start()
    deadline = time.monotonic() + 30
    while sdk_env.sql(f"SELECT state FROM sandboxes WHERE id = '{sb.sandbox_id}'") != [("pausing",)]:
        assert t.is_alive() and time.monotonic() < deadline, "the pause ended before it was seen pausing"
        time.sleep(0.005)
    return t


def test_traffic_during_a_pause_waits_for_it_then_auto_resumes(sdk_env) -> None:
    """Traffic that reaches a sandbox while it is being paused must not be sent to a guest whose vCPUs are stopped
    (it would time out, or be cut when the pause ends): it waits for the pause, then auto-resumes the sandbox."""
    sb = Sandbox.create(lifecycle={"on_timeout": "pause", "auto_resume": True})
    try:
        sb.files.write("/home/user/t.txt", "written before the pause")
        pause = _pause_in_background(sdk_env, sb)
        assert sb.files.read("/home/user/t.txt") == "written before the pause"  # sent while pausing
        pause.join(60)
        assert sdk_env.sql(f"SELECT state FROM sandboxes WHERE id = '{sb.sandbox_id}'") == [("running",)]
        ops = [r for r in sdk_env.sql(f"SELECT operation, to_state FROM events WHERE sandbox_id = '{sb.sandbox_id}'"
                                      " AND to_state IN ('paused', 'running') ORDER BY id")]
        assert ops[-2:] == [("pause", "paused"), ("resume", "running")], ops
        # connect while pausing waits too, and resumes what the pause left
        pause = _pause_in_background(sdk_env, sb)
        again = Sandbox.connect(sb.sandbox_id)
        pause.join(60)
        assert again.files.read("/home/user/t.txt") == "written before the pause"
    finally:
        Sandbox.kill(sb.sandbox_id)


def test_paused_without_auto_resume_is_not_found_for_traffic(sdk_env) -> None:
    sb = Sandbox.create()
    try:
        sb.pause()
        r = httpx.get(sdk_env.url + "/health", headers={"E2b-Sandbox-Id": sb.sandbox_id,
                                                          "E2b-Sandbox-Port": "49983"})
        assert r.status_code == 502 and "was not found" in r.json()["message"]
    finally:
        Sandbox.kill(sb.sandbox_id)


def test_snapshot_then_create_from_it(sdk_env) -> None:
    sb = Sandbox.create(envs={"FROM": "parent"})
    try:
        sb.files.write("/home/user/state.txt", "snapshotted")
        snap = sb.create_snapshot()
        sb.files.write("/home/user/state.txt", "changed after")
        assert sb.commands.run("echo still running").stdout == "still running\n"
        assert snap.snapshot_id in [s.snapshot_id for s in Sandbox.list_snapshots().next_items()]
        child = Sandbox.create(template=snap.snapshot_id)
        try:
            assert child.files.read("/home/user/state.txt") == "snapshotted"
            assert child.commands.run("echo $FROM").stdout == "parent\n"
        finally:
            child.kill()
        src = sdk_env.sql(f"SELECT source_sandbox_id, parent_id FROM snapshots WHERE id = '{snap.snapshot_id}'")
        assert src[0][0] == sb.sandbox_id and src[0][1]
        # its flat memory image was made behind the answer, from its memory layers (capture.py
        # defer_flat_image); one a crash cut is made by the next restore from it
        [(detail, memory, from_layers)] = sdk_env.sql(
            "SELECT e.detail, s.memory_location, s.memory_from_layers FROM events e JOIN snapshots s ON s.id = "
            f"e.subject_id WHERE e.operation = 'snapshot_commit' AND e.subject_id = '{snap.snapshot_id}'")
        assert '"memory_deferred": true' in detail and from_layers == 1
        deadline = time.monotonic() + 60
        while not Path(memory).exists():
            assert time.monotonic() < deadline, "the flat image was not made behind the snapshot"
            time.sleep(0.2)
        made = _sha256(Path(memory))
        Path(memory).unlink()  # as a node killed before it was made leaves it
        again = Sandbox.create(template=snap.snapshot_id)
        try:
            assert again.files.read("/home/user/state.txt") == "snapshotted"
        finally:
            again.kill()
        assert _sha256(Path(memory)) == made  # the same image, from the layers
        assert Sandbox.delete_snapshot(snap.snapshot_id) is True
        assert Sandbox.delete_snapshot(snap.snapshot_id) is False
    finally:
        sb.kill()


def test_fork_children_inherit_and_diverge(sdk_env) -> None:
    """The issue's show: sandbox.fork(count=16) returns 16 running children that each see the
    parent's files and processes; they diverge independently and the parent keeps running."""
    parent = Sandbox.create(envs={"ROLE": "parent"})
    children: list = []
    try:
        # a long-lived process (idle, so 17 emulated guests on 2 cores stay responsive)
        parent.commands.run("nohup sleep 86400 >/dev/null 2>&1 &")
        parent.files.write("/home/user/shared.txt", "from the parent")
        children = parent.fork(count=16)
        assert len(children) == 16 and all(isinstance(c, Sandbox) for c in children), children
        ids = {c.sandbox_id for c in children}
        assert len(ids) == 16 and parent.sandbox_id not in ids
        for i, c in enumerate(children):
            assert c.files.read("/home/user/shared.txt") == "from the parent"
            # the parent's process runs in every child
            assert c.commands.run("pgrep -x sleep >/dev/null && echo inherited").stdout == "inherited\n"
            c.files.write("/home/user/mine.txt", f"child {i}")
        assert children[0].commands.run("echo $ROLE").stdout == "parent\n"
        for i, c in enumerate(children):
            assert c.files.read("/home/user/mine.txt") == f"child {i}"
        assert not parent.files.exists("/home/user/mine.txt")
        assert parent.commands.run("echo parent alive").stdout == "parent alive\n"
        rows = sdk_env.sql("SELECT parent_sandbox_id, state FROM sandboxes WHERE id IN (%s)"
                           % ",".join(f"'{i}'" for i in ids))
        assert {r[0] for r in rows} == {parent.sandbox_id} and {r[1] for r in rows} == {"running"}
    finally:
        for c in children:
            if isinstance(c, Sandbox):
                c.kill()
        parent.kill()


def test_long_chains_are_compacted_and_still_resume(sdk_env) -> None:
    """The session node compacts chains of more than 4 layers: disk (base, boot seal, one per pause) and
    memory (one layer of dirty pages per pause), so a sandbox paused and resumed forever stays bounded."""
    sb = Sandbox.create()
    try:
        sb.commands.run(COUNTER)
        for i in range(5):
            sb.files.write(f"/home/user/round{i}.txt", f"round {i}")
            sb.pause()
            sb = Sandbox.connect(sb.sandbox_id)
        deadline = time.monotonic() + 90
        kinds: set[str] = set()
        while time.monotonic() < deadline and kinds != {"disk", "memory"}:
            kinds = {r[0] for r in sdk_env.sql(
                "SELECT json_extract(detail, '$.kind') FROM events WHERE operation = 'compact' AND subject_id IN "
                f"(SELECT id FROM snapshots WHERE source_sandbox_id = '{sb.sandbox_id}')")}
            time.sleep(0.5)
        assert kinds == {"disk", "memory"}, f"compactions recorded: {kinds}"
        before = _counter(sb)
        sb.pause()  # the newest pause snapshot: its chains are compacted in the background too
        sdk_env.wait_state(sb.sandbox_id, "paused")
        snap = sdk_env.sql(f"SELECT snapshot_id FROM sandboxes WHERE id = '{sb.sandbox_id}'")[0][0]
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not sdk_env.sql(
                f"SELECT 1 FROM events WHERE operation = 'compact' AND subject_id = '{snap}' "
                "AND json_extract(detail, '$.kind') = 'memory'"):
            time.sleep(0.5)
        chain = dict(sdk_env.sql(f"SELECT kind, count(*) FROM snapshot_layers WHERE snapshot_id = '{snap}' "
                                 "GROUP BY kind"))
        assert chain["memory"] == 1 and chain["disk"] == 2, chain
        # the compacted memory layer over the template's RAM image is exactly the snapshot's flat image
        # (what another node would materialize from the repository)
        flat, base, layer_path = sdk_env.sql(
            "SELECT s.memory_location, s.memory_base_location, l.local_path "
            "FROM snapshots s JOIN snapshot_layers sl ON sl.snapshot_id = s.id AND sl.kind = 'memory' "
            f"JOIN layers l ON l.digest = sl.layer_digest WHERE s.id = '{snap}'")[0]
        rebuilt = bytearray(Path(base).read_bytes())
        with LayerReader.open(layer_path) as layer:
            for e in layer.iter_extents():
                rebuilt[e.offset : e.offset + e.length] = layer.read(e.offset, e.length)
        assert hashlib.sha256(rebuilt).digest() == hashlib.sha256(Path(flat).read_bytes()).digest()
        back = Sandbox.connect(sb.sandbox_id)
        for i in range(5):
            assert back.files.read(f"/home/user/round{i}.txt") == f"round {i}"
        time.sleep(1)
        assert _counter(back) > before
    finally:
        Sandbox.kill(sb.sandbox_id)


def test_failed_pause_leaves_the_sandbox_running(sdk_env) -> None:
    """A pause that cannot write its disk layer (the layer directory made read-only under the node) resumes the
    VM and reports running, with the error in its event; nothing half-written is left. The session's node has a
    data plane, so the pause answered before that write (once the guest was captured): the call succeeded, and
    the sandbox runs on after it (a pause without a data plane, or without room on the disk, answers the
    error instead: test_disk_full.py)."""
    sb = Sandbox.create()
    layers = sdk_env.state_dir / "layers"
    try:
        sb.commands.run(COUNTER)
        time.sleep(1)
        before = set(p.name for p in layers.iterdir())
        subprocess.run(["mount", "--bind", str(layers), str(layers)], check=True)
        try:
            subprocess.run(["mount", "-o", "remount,bind,ro", str(layers)], check=True)
            assert sb.pause() is True  # answered at the capture: the layer's write fails after it
            assert Sandbox.get_info(sb.sandbox_id).state.value == "paused"  # (pausing, as E2B shows it)
            sdk_env.wait_state(sb.sandbox_id, "running")
        finally:
            subprocess.run(["umount", "-l", str(layers)], check=True)  # lazy: the node may hold files open
        errors = sdk_env.sql(f"SELECT operation, to_state, error FROM events WHERE sandbox_id = '{sb.sandbox_id}' "
                             "AND error IS NOT NULL")
        assert errors and errors[-1][:2] == ("pause", "running"), errors
        first = _counter(sb)
        time.sleep(1)
        assert _counter(sb) > first  # the guest runs again
        assert set(p.name for p in layers.iterdir()) == before
        assert sdk_env.sql(f"SELECT count(*) FROM snapshots WHERE source_sandbox_id = '{sb.sandbox_id}'") == [(0,)]
        assert sb.pause() is True  # and it can pause once the disk is writable again
        sdk_env.wait_state(sb.sandbox_id, "paused")
    finally:
        Sandbox.kill(sb.sandbox_id)
