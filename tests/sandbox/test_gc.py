"""Local garbage collection: superseded snapshots and unreferenced layers leave the disk, through
the unmodified E2B SDK against a real node (snapshot/gc.py)."""

from __future__ import annotations

import datetime as dt
import json
import os
import secrets
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest
from e2b import Sandbox
from sqlalchemy import text

from aenv_node.snapshot.gc import REACHABLE_CTE, GarbageCollector, LiveStack
from aenv_node.state import Database, Layer, Snapshot, SnapshotLayer, Template, utcnow
from aenv_node.state import Sandbox as SandboxRow

from .conftest import DOMAIN, NodeProcess, start_node, stop_node
from .test_lifecycle import COUNTER, _counter

vm = pytest.mark.vm  # the tests that boot guests (the rule tests below do not)


def _snap_of(node: NodeProcess, sid: str) -> str:
    """The snapshot of a sandbox just paused, once its pause is persisted (a pause answers before)."""
    node.wait_state(sid, "paused")
    return node.sql(f"SELECT snapshot_id FROM sandboxes WHERE id = '{sid}'")[0][0]


def _status(node: NodeProcess, snap: str) -> str:
    return node.sql(f"SELECT status FROM snapshots WHERE id = '{snap}'")[0][0]


def _stack(node: NodeProcess, snap: str) -> dict[str, Path]:
    """digest -> local file of every layer (disk and memory) a snapshot stacks."""
    rows = node.sql("SELECT l.digest, l.local_path FROM snapshot_layers sl JOIN layers l ON l.digest = sl.layer_digest "
                    f"WHERE sl.snapshot_id = '{snap}' AND l.local_path IS NOT NULL")
    return {d: Path(loc) for d, loc in rows}


def _needed(node: NodeProcess) -> set[str]:
    """Digests some snapshot not collected still stacks."""
    return {d for (d,) in node.sql(
        "SELECT DISTINCT sl.layer_digest FROM snapshot_layers sl JOIN snapshots s ON s.id = sl.snapshot_id "
        "WHERE s.status <> 'collected'")}


def _gc_events(node: NodeProcess) -> list[dict]:
    return [json.loads(d) for (d,) in node.sql("SELECT detail FROM events WHERE operation = 'gc' ORDER BY id")]


def _wait(cond, what: str, node: NodeProcess, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}:\n{node.log()[-3000:]}")


def _collected(node: NodeProcess, snap: str) -> None:
    """Wait until a snapshot is collected: files gone, row kept, one gc event naming it."""
    snap_dir = node.state_dir / "snapshots" / snap
    _wait(lambda: not snap_dir.exists() and _status(node, snap) == "collected", f"{snap} collected", node)
    events = [e for e in _gc_events(node) if snap in e["snapshots"]]
    assert len(events) == 1 and events[0]["bytes_freed"] > 0 and events[0]["files"] >= 1, events


@vm
def test_pause_resume_cycles_leave_only_the_newest_pause_snapshot(sdk_env) -> None:
    node = sdk_env
    sb = Sandbox.create()
    try:
        sb.commands.run(COUNTER)
        sb.files.write("/home/user/one.txt", "first round")
        sb.pause()
        p1 = _snap_of(node, sb.sandbox_id)
        p1_stack = _stack(node, p1)
        assert (node.state_dir / "snapshots" / p1 / "memory").exists()
        assert all(p.exists() for p in p1_stack.values())

        sb = Sandbox.connect(sb.sandbox_id)  # resume: it runs from p1, so p1 stays
        assert (node.state_dir / "snapshots" / p1 / "memory").exists()
        sb.files.write("/home/user/two.txt", "second round")
        sb.pause()
        p2 = _snap_of(node, sb.sandbox_id)
        assert p2 != p1
        _collected(node, p1)  # superseded by p2: its vmstate and flat memory image are gone

        # the layers only p1 stacked are gone; everything p2 stacks is there
        exclusive = {d: p for d, p in p1_stack.items() if d not in _needed(node)}
        assert all(not p.exists() for p in exclusive.values()), exclusive
        p2_stack = _stack(node, p2)
        assert p2_stack and all(p.exists() for p in p2_stack.values())
        assert (node.state_dir / "snapshots" / p2 / "vmstate").exists()
        # refcounts were made truthful: every layer p2 stacks is counted at least once
        counts = dict(node.sql("SELECT digest, refcount FROM layers"))
        assert all(counts[d] >= 1 for d in p2_stack)

        # lineage still answers (rows are history), the collected one is no longer listed
        r = httpx.get(f"{node.url}/snapshots/{p2}/lineage", headers={"X-API-KEY": node.api_key}).json()
        assert [x["snapshotID"] for x in r][:2] == [p2, p1] and [x["kind"] for x in r] == ["pause", "pause", "boot"]
        assert r[1]["status"] == "collected"
        assert p1 not in [s.snapshot_id for s in Sandbox.list_snapshots().next_items()]

        back = Sandbox.connect(sb.sandbox_id)
        assert back.files.read("/home/user/one.txt") == "first round"
        assert back.files.read("/home/user/two.txt") == "second round"
        first = _counter(back)
        time.sleep(1)
        assert _counter(back) > first  # the process started before the first pause still runs
    finally:
        Sandbox.kill(sb.sandbox_id)


@vm
def test_deleted_snapshot_outlives_its_last_sandbox_only(sdk_env) -> None:
    node = sdk_env
    parent = Sandbox.create()
    child = None
    try:
        parent.files.write("/home/user/state.txt", "snapshotted")
        snap = parent.create_snapshot().snapshot_id
        snap_dir = node.state_dir / "snapshots" / snap
        parent_layers = {d for (d,) in node.sql(  # the disk layer sealed from the parent at the snapshot
            f"SELECT layer_digest FROM snapshot_layers WHERE snapshot_id = '{snap}' AND kind = 'disk'")}
        parent_layers -= _stack_of_template(node)
        child = Sandbox.create(template=snap)
        assert Sandbox.delete_snapshot(snap) is True
        time.sleep(3)  # the collection the delete asked for has run: the child still runs from it
        assert snap_dir.exists() and _status(node, snap) == "deleted"
        assert child.files.read("/home/user/state.txt") == "snapshotted"
        child.files.write("/home/user/child.txt", "mine")
        child.pause()
        child = Sandbox.connect(child.sandbox_id)
        assert child.files.read("/home/user/child.txt") == "mine"
        assert child.commands.run("echo alive").stdout == "alive\n"
        child.kill()
        child = None
        _collected(node, snap)
        assert snap not in [s.snapshot_id for s in Sandbox.list_snapshots().next_items()]
        # the layer sealed from the parent's disk at the snapshot: still under the running parent
        files = dict(node.sql("SELECT digest, local_path FROM layers"))
        assert parent_layers and all(Path(files[d]).exists() for d in parent_layers)
        assert parent.files.read("/home/user/state.txt") == "snapshotted"
        parent.kill()
        _wait(lambda: all(not Path(files[d]).exists() for d in parent_layers), "the parent's layers gone", node)
    finally:
        if child is not None:
            child.kill()
        Sandbox.kill(parent.sandbox_id)


def _stack_of_template(node: NodeProcess) -> set[str]:
    return {d for (d,) in node.sql(
        "SELECT sl.layer_digest FROM snapshot_layers sl JOIN templates t ON t.boot_snapshot_id = sl.snapshot_id "
        "WHERE t.kind = 'template'")}


@vm
def test_killing_a_paused_sandbox_removes_its_files(sdk_env) -> None:
    node = sdk_env
    sb = Sandbox.create()
    try:
        sb.files.write("/home/user/x.txt", "x" * 100000)
        sb.pause()
        snap = _snap_of(node, sb.sandbox_id)
        own = {d: p for d, p in _stack(node, snap).items() if d not in _stack_of_template(node)}
        assert len(own) >= 2 and all(p.exists() for p in own.values())  # its disk and memory layers
    finally:
        Sandbox.kill(sb.sandbox_id)
    _collected(node, snap)
    assert all(not p.exists() for p in own.values())
    event = next(e for e in _gc_events(node) if snap in e["snapshots"])
    assert set(own) <= set(event["layers"]) and "kill" in event["reason"]
    # the template is untouched
    assert all(Path(loc).exists() for (loc,) in node.sql(
        "SELECT l.local_path FROM snapshot_layers sl JOIN layers l ON l.digest = sl.layer_digest "
        "JOIN templates t ON t.boot_snapshot_id = sl.snapshot_id WHERE t.kind = 'template'"))


@vm
def test_compaction_removes_the_layers_it_replaced(sdk_env) -> None:
    """The session node compacts chains of more than 4 disk layers: the third pause's."""
    node = sdk_env
    sb = Sandbox.create()
    try:
        snaps = []
        for i in range(3):
            sb.files.write(f"/home/user/round{i}.txt", f"round {i}")
            sb.pause()
            snaps.append(_snap_of(node, sb.sandbox_id))
            if i < 2:
                sb = Sandbox.connect(sb.sandbox_id)
        p2_disk = [d for (d,) in node.sql(f"SELECT layer_digest FROM snapshot_layers WHERE snapshot_id = "
                                          f"'{snaps[1]}' AND kind = 'disk' ORDER BY position")]
        replaced = [d for d in p2_disk if d not in _stack_of_template(node)]
        assert len(p2_disk) == 4 and len(replaced) == 2  # the first two pauses' disk layers
        files = dict(node.sql("SELECT digest, local_path FROM layers"))
        _wait(lambda: node.sql(f"SELECT 1 FROM events WHERE operation = 'compact' AND subject_id = '{snaps[2]}'"),
              "compaction", node)
        _wait(lambda: all(not Path(files[d]).exists() for d in replaced), "replaced layers removed", node)
        assert any(set(replaced) <= set(e["layers"]) for e in _gc_events(node))
        now = _stack(node, snaps[2])
        assert len([1 for (k,) in node.sql(f"SELECT kind FROM snapshot_layers WHERE snapshot_id = '{snaps[2]}'")
                    if k == "disk"]) == 2
        assert all(p.exists() for p in now.values())
        assert all(_status(node, s) == "collected" for s in snaps[:2])
        back = Sandbox.connect(sb.sandbox_id)
        for i in range(3):
            assert back.files.read(f"/home/user/round{i}.txt") == f"round {i}"
    finally:
        Sandbox.kill(sb.sandbox_id)


@vm
def test_startup_sweeps_old_orphan_files(node: NodeProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """Files no row names (a crash between a commit and the unlinks, or before a commit) go at the next
    start once older than the grace period, recent ones stay; temporary files (a seal or a materialization
    a crash cut) go whatever their age, also inside a committed snapshot's directory. Restarts the session
    node in place (same state, port and settings)."""
    for k, v in node.sdk_env().items():
        monkeypatch.setenv(k, v)
    layers, snaps = node.state_dir / "layers", node.state_dir / "snapshots"
    old = time.time() - 3 * 3600
    orphan_layer = layers / f"{secrets.token_hex(32)}.layer"
    orphan_layer.write_bytes(os.urandom(1 << 20))
    os.utime(orphan_layer, (old, old))
    orphan_dir = snaps / "snp_orphan0000000000000"
    orphan_dir.mkdir()
    (orphan_dir / "memory").write_bytes(os.urandom(1 << 20))
    os.utime(orphan_dir / "memory", (old, old))
    os.utime(orphan_dir, (old, old))
    recent = layers / f"{secrets.token_hex(32)}.layer"
    recent.write_bytes(b"recent")
    temp = layers / f".tmp-{secrets.token_hex(8)}.layer"
    temp.write_bytes(b"cut by a crash")
    keep = Sandbox.create()
    keep.files.write("/home/user/kept.txt", "across the restart")
    keep.pause()
    node.wait_state(keep.sandbox_id, "paused")
    [(state, snap_id)] = node.sql(f"SELECT state, snapshot_id FROM sandboxes WHERE id = '{keep.sandbox_id}'")
    assert state == "paused"
    inner_temp = snaps / snap_id / f".memory.tmp-{secrets.token_hex(4)}"
    inner_temp.write_bytes(b"a materialization cut by a crash")
    try:
        stop_node(node.proc)
        port = urlparse(node.url).port
        fresh = start_node(node.state_dir, port=port, AENV_API_DOMAIN=DOMAIN,
                           AENV_SANDBOX_TTL_CHECK_INTERVAL_S="0.5", AENV_SNAPSHOT_COMPACT_AFTER_LAYERS="4")
        node.proc, node.log_path = fresh.proc, fresh.log_path
        assert not orphan_layer.exists() and not orphan_dir.exists()
        assert recent.exists() and not temp.exists() and not inner_temp.exists()
        sweep = [e for e in _gc_events(node) if e["reason"] == "startup-sweep"][-1]
        assert {str(orphan_layer), str(orphan_dir), str(temp), str(inner_temp)} <= set(sweep["orphans"])
        assert sweep["bytes_freed"] >= 2 << 20
        back = Sandbox.connect(keep.sandbox_id)  # nothing reachable was swept
        assert back.files.read("/home/user/kept.txt") == "across the restart"
    finally:
        Sandbox.kill(keep.sandbox_id)
        for p in (recent, temp, orphan_layer):
            p.unlink(missing_ok=True)


# -- the rules on a real database and real files, without guests ------------------------------------------



class _World:
    """A node's state directory and database with hand-made rows, and the collector over them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.layers, self.snaps = root / "layers", root / "snapshots"
        self.layers.mkdir()
        self.snaps.mkdir()
        self.db = Database(root / "aenv.db")
        self.db.upgrade()
        self.live: list[LiveStack] = []
        self._clock = 0
        self.gc = GarbageCollector(self.db, layers_dir=self.layers, snapshots_dir=self.snaps,
                                   live=lambda: self.live, orphan_grace_s=3600)

    def layer(self, name: str, kind: str = "disk") -> str:
        digest = "sha256:" + name.encode().hex().ljust(64, "0")
        path = self.layers / f"{digest[7:]}.layer"
        path.write_bytes(b"L" * 8192)
        with self.db.session() as s:
            s.add(Layer(digest=digest, kind=kind, size_bytes=8192, local_path=str(path), refcount=0))
        return digest

    def snapshot(self, sid: str, kind: str, disk: list[str], memory: list[str] = (), *, status: str = "committed",
                 source: str | None = None, memory_base: str | None = None, parent: str | None = None) -> None:
        d = self.snaps / sid
        d.mkdir()
        (d / "vmstate").write_bytes(b"v" * 4096)
        (d / "memory").write_bytes(b"m" * 65536)
        with self.db.session() as s:
            # one second apart, in the order made: "newest pause snapshot" must not depend on timer resolution
            self._clock += 1
            s.add(Snapshot(id=sid, kind=kind, status=status, source_sandbox_id=source, parent_id=parent,
                           vmstate_location=str(d / "vmstate"), memory_location=str(d / "memory"),
                           memory_base_location=memory_base or str(d / "memory"),
                           created_at=utcnow() + dt.timedelta(seconds=self._clock)))
            s.flush()
            for k, chain in (("disk", disk), ("memory", memory)):
                for pos, dg in enumerate(chain):
                    s.add(SnapshotLayer(snapshot_id=sid, kind=k, position=pos, layer_digest=dg))

    def sandbox(self, sid: str, state: str, snapshot: str) -> None:
        with self.db.session() as s:
            row = s.get(SandboxRow, sid)
            if row is None:
                s.add(SandboxRow(id=sid, template_id="base", state=state, snapshot_id=snapshot))
            else:
                row.state, row.snapshot_id = state, snapshot

    def status(self, sid: str) -> str:
        with self.db.session() as s:
            return s.get(Snapshot, sid).status

    def exists(self, digest: str) -> bool:
        return (self.layers / f"{digest[7:]}.layer").exists()


@pytest.fixture
def world(tmp_path: Path):
    w = _World(tmp_path)
    yield w
    w.db.close()


async def test_rules_superseded_pause_killed_sandbox_and_rebuilt_template(world: _World) -> None:
    base, boot_up, old_boot_up = world.layer("base"), world.layer("bootup"), world.layer("oldboot")
    world.snapshot("snp_oldboot", "boot", [base, old_boot_up])
    old_mem = str(world.snaps / "snp_oldboot" / "memory")
    world.snapshot("snp_boot", "boot", [base, boot_up])
    with world.db.session() as s:
        s.add(Template(id="base", status="ready", boot_snapshot_id="snp_boot"))
    u1, m1, u2, m2 = world.layer("u1"), world.layer("m1", "memory"), world.layer("u2"), world.layer("m2", "memory")
    # a sandbox created from the template before its rebuild, paused twice
    world.snapshot("snp_p1", "pause", [base, old_boot_up, u1], [m1], source="isb", memory_base=old_mem,
                   parent="snp_oldboot")
    world.snapshot("snp_p2", "pause", [base, old_boot_up, u1, u2], [m1, m2], source="isb", memory_base=old_mem,
                   parent="snp_p1")
    world.sandbox("isb", "paused", "snp_p2")
    out = await world.gc.collect("test")
    assert out.snapshots == ["snp_p1"] and out.layers == []  # p2 stacks everything p1 did
    assert not (world.snaps / "snp_p1").exists() and world.status("snp_p1") == "collected"
    # the rebuilt-away boot snapshot stays: its RAM image is the bottom of p2's memory chain
    assert (world.snaps / "snp_oldboot").exists() and world.status("snp_oldboot") == "committed"
    with world.db.session() as s:
        assert s.get(Layer, u1).refcount == 1 and s.get(Layer, base).refcount == 3  # p2, boot, oldboot
        ev = [json.loads(d) for d in s.execute(text("SELECT detail FROM events WHERE operation = 'gc'")).scalars()]
    assert len(ev) == 1 and ev[0]["snapshots"] == ["snp_p1"] and ev[0]["bytes_freed"] >= 65536

    world.sandbox("isb", "killed", "snp_p2")
    out = await world.gc.collect("kill")
    assert sorted(out.snapshots) == ["snp_oldboot", "snp_p2"]
    assert sorted(out.layers) == sorted([old_boot_up, u1, u2, m1, m2])
    assert not any(world.exists(d) for d in (old_boot_up, u1, u2, m1, m2))
    assert world.exists(base) and world.exists(boot_up) and (world.snaps / "snp_boot" / "memory").exists()
    assert (await world.gc.collect("again")).empty  # nothing twice, no event for nothing


async def test_rules_live_stacks_deleted_snapshots_and_periodic(world: _World) -> None:
    base = world.layer("base")
    world.snapshot("snp_boot", "boot", [base])
    with world.db.session() as s:
        s.add(Template(id="base", status="ready", boot_snapshot_id="snp_boot"))
    us, up1, up2 = world.layer("us"), world.layer("up1"), world.layer("up2")
    world.sandbox("iparent", "running", "snp_boot")
    world.snapshot("snp_user", "user", [base, us], source="iparent", status="deleted")
    world.sandbox("ichild", "running", "snp_user")
    world.snapshot("snp_per1", "periodic", [base, us, up1], source="iparent", status="deleted")
    world.snapshot("snp_per2", "periodic", [base, us, up2], source="iparent")
    out = await world.gc.collect("test")
    # the deleted user snapshot: a sandbox runs from it; the newest periodic: kept for crash recovery
    assert out.snapshots == ["snp_per1"] and out.layers == [up1]
    world.sandbox("ichild", "killed", "snp_user")
    world.live = [LiveStack("snp_boot", (world.layers / f"{us[7:]}.layer",))]  # the parent's disk stack
    out = await world.gc.collect("kill")
    assert out.snapshots == ["snp_user"] and out.layers == []  # "us" is under the running parent
    world.live = []
    world.sandbox("iparent", "killed", "snp_boot")
    out = await world.gc.collect("kill")
    assert out.snapshots == ["snp_per2"] and sorted(out.layers) == sorted([us, up2])


async def test_a_collection_waits_for_pins(world: _World) -> None:
    import trio

    base, u = world.layer("base"), world.layer("u")
    world.snapshot("snp_gone", "pause", [base, u], source="ix")
    done = trio.Event()

    async def collect() -> None:
        await world.gc.collect("test")
        done.set()

    world.gc.patience_s = 1.0
    async with trio.open_nursery() as n:
        async with world.gc.pin():
            n.start_soon(collect)
            await trio.sleep(0.3)
            assert not done.is_set() and world.exists(u)  # an open in progress: nothing goes
            async with world.gc.pin():  # within its patience, new opens go first
                pass
            await trio.sleep(1.0)
            with trio.move_on_after(0.2) as cs:  # then a waiting collection holds them back
                async with world.gc.pin():
                    pass
            assert cs.cancelled_caught and not done.is_set()
        await done.wait()
    assert not world.exists(u) and world.status("snp_gone") == "collected"


async def test_requests_within_the_minimum_gap_wait_and_share_one_collection(world: _World) -> None:
    """A kill requests a collection; under a churn of kills the loop collects at most once per ``min_gap_s``,
    every request of the gap served by the next one (its reasons joined)."""
    import trio

    gc_events = "SELECT detail FROM events WHERE operation = 'gc' ORDER BY id"
    base = world.layer("base")
    world.gc.min_gap_s = 1.0
    async with trio.open_nursery() as n:
        n.start_soon(world.gc.run)
        world.snapshot("snp_a", "pause", [base, world.layer("a")], source="ia")
        world.gc.request("kill")
        with trio.fail_after(5):
            while world.status("snp_a") != "collected":  # the first request of a quiet loop: collected at once
                await trio.sleep(0.02)
        t0 = trio.current_time()
        world.snapshot("snp_b", "pause", [base, world.layer("b")], source="ib")
        world.gc.request("kill")
        await trio.sleep(0.3)
        world.snapshot("snp_c", "pause", [base, world.layer("c")], source="ic")
        world.gc.request("snapshot_delete")
        await trio.sleep(0.3)
        assert world.status("snp_b") == "committed"  # within the gap: not yet
        with trio.fail_after(5):
            while world.status("snp_c") != "collected":
                await trio.sleep(0.02)
        assert trio.current_time() - t0 >= 0.9 and world.status("snp_b") == "collected"
        n.cancel_scope.cancel()
    with world.db.session() as s:
        ev = [json.loads(d) for d in s.execute(text(gc_events)).scalars()]
    assert [(e["reason"], sorted(e["snapshots"])) for e in ev] == [
        ("kill", ["snp_a"]), ("kill,snapshot_delete", ["snp_b", "snp_c"])]


async def test_startup_sweep_rules(world: _World) -> None:
    base = world.layer("base")
    world.snapshot("snp_boot", "boot", [base])
    with world.db.session() as s:
        s.add(Template(id="base", status="ready", boot_snapshot_id="snp_boot"))
    world.snapshot("snp_was", "pause", [base], status="collected")  # crash between commit and unlink
    old = time.time() - 7200
    orphan = world.layers / ("ab" * 32 + ".layer")
    orphan.write_bytes(b"x")
    young = world.layers / ("cd" * 32 + ".layer")
    young.write_bytes(b"x")
    temp = world.layers / ".tmp-0123.layer"
    temp.write_bytes(b"x")
    part = world.snaps / "snp_new.part"
    part.mkdir()
    for p in (orphan, temp, part):
        os.utime(p, (old, old))
    inner = world.snaps / "snp_boot" / ".memory.tmp-0a1b"  # a materialization a crash cut
    inner.write_bytes(b"x")
    done = await world.gc.startup()
    # temporaries go whatever their age: nothing of this run is in progress before the start-up pass
    assert sorted(done[0].orphans) == sorted([str(orphan), str(world.snaps / "snp_was"), str(temp), str(part),
                                              str(inner)])
    assert young.exists() and not temp.exists() and not part.exists() and not inner.exists()
    assert world.exists(base)
    assert (world.snaps / "snp_boot").exists()


def test_the_documented_sql_is_the_sql_the_node_runs() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "operations.md").read_text()
    section = doc.split("What a collection would remove now", 1)[1].split("```sql", 1)[1].split("```", 1)[0]
    def norm(q: str) -> str:
        return " ".join(q.split())

    assert norm(REACHABLE_CTE) in norm(section)
