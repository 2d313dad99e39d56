"""The publish, kill and claim rules of snapshot/publish.py against a real database and a real posix_fs
repository: no guest is needed (moved out of tests/sandbox/test_restart.py, whose tests all boot VMs)."""

from __future__ import annotations

from pathlib import Path

import pytest

from aenv_node.snapshot.publish import _publish_pointer, claim_for_resume, forget_published, settle_record
from aenv_node.state import Database, Event, Sandbox, SandboxState, Snapshot
from aenv_node.state.repository import insert_sandbox, transition
from aenv_node.storage.repository import OwnershipConflict, OwnershipLost, PosixFsRepository


def _paused_sandbox_db(tmp_path: Path, sid: str, snap: str, *, published: bool = False) -> Database:
    db = Database(tmp_path / "aenv.db")
    db.upgrade()
    with db.session() as s:
        s.add(Snapshot(id=snap, kind="pause", status="committed", published=published))
        s.flush()
        insert_sandbox(s, Sandbox(id=sid, template_id="base", snapshot_id=snap,
                                  state=SandboxState.PAUSED.value))
    return db


def _kill_row(db: Database, sid: str) -> None:
    with db.session() as s:
        transition(s, sid, SandboxState.KILLING, operation="kill")
        transition(s, sid, SandboxState.KILLED, operation="kill")


@pytest.mark.parametrize("kill_at", ["before_publish", "during_write", "after_publish"])
async def test_publish_racing_a_kill_leaves_no_record(tmp_path: Path, kill_at: str) -> None:
    """The kill (row killed, then the owner's record deleted) lands before the publish looks at the row, between
    that look and the record write (forced with a repository whose write first lets the kill run), or after the
    write: in every order no record survives."""
    sid, snap, me = "irace0000000000000001", "pause-1", "node-a/abcd"
    db = _paused_sandbox_db(tmp_path, sid, snap)

    class KillDuringWrite(PosixFsRepository):
        def release_sandbox(self, *a, **kw):  # type: ignore[no-untyped-def]
            _kill_row(db, sid)  # the kill's two steps, both before this write
            assert forget_published(self, sid, me) is False  # nothing to delete yet
            return super().release_sandbox(*a, **kw)

    repo = (KillDuringWrite if kill_at == "during_write" else PosixFsRepository)(tmp_path / "repo")
    if kill_at == "before_publish":
        _kill_row(db, sid)
        assert forget_published(repo, sid, me) is False
    outcome, _ = await _publish_pointer(db, repo, sid, snap, me)
    if kill_at == "after_publish":
        assert outcome == "written" and repo.get_ownership(sid) is not None
        _kill_row(db, sid)
        assert forget_published(repo, sid, me) is True
    else:
        assert outcome == "killed"
    assert repo.get_ownership(sid) is None


async def test_publish_and_claim_rules(tmp_path: Path) -> None:
    """Publish only over an absent record or this node's own, only while the row is paused at that snapshot;
    a claim is refused while another node runs the sandbox, and a published copy whose record is gone is
    refused as killed elsewhere."""
    sid, snap = "irules000000000000001", "pause-1"
    db = _paused_sandbox_db(tmp_path, sid, snap)
    repo = PosixFsRepository(tmp_path / "repo")
    assert (await _publish_pointer(db, repo, sid, "pause-0", "a/1"))[0] == "superseded"  # not its snapshot
    assert repo.get_ownership(sid) is None
    assert await _publish_pointer(db, repo, sid, snap, "a/1") == ("written", 1)
    repo.claim_sandbox(sid, "b/2")
    assert (await _publish_pointer(db, repo, sid, snap, "a/1"))[0] == "moved"  # b runs it now
    with pytest.raises(OwnershipConflict, match=f"sandbox {sid} is running on node b/2"):
        await claim_for_resume(db, repo, tmp_path / "snapshots", sid, "a", "a/1")
    assert repo.get_ownership(sid).owner == "b/2"  # type: ignore[union-attr]
    repo.release_sandbox(sid, "b/2", snap)  # b paused it at the same snapshot: a's copy is current
    claim = await claim_for_resume(db, repo, tmp_path / "snapshots", sid, "a", "a/1")
    assert claim is not None and claim.imported is None and claim.record.owner == "a/1"
    assert claim.previous is not None and claim.previous.owner == "b/2"
    assert repo.drop_ownership(sid, "a/1")
    with pytest.raises(OwnershipLost, match="killed on another node"):  # a's snapshot was published
        await claim_for_resume(db, repo, tmp_path / "snapshots", sid, "a", "a/1")
    assert await claim_for_resume(db, repo, tmp_path / "snapshots", "inowhere", "a", "a/1") is None


async def test_settle_record_after_an_unplanned_end(tmp_path: Path) -> None:
    """A sandbox that ended here without a kill (VMM died, node shut down) leaves no record saying it runs
    here; a paused one keeps its record; another node's record is not ours to delete."""
    sid, snap = "isettle00000000000001", "pause-1"
    db = _paused_sandbox_db(tmp_path, sid, snap)
    repo = PosixFsRepository(tmp_path / "repo")
    repo.claim_sandbox(sid, "a/1")
    assert await settle_record(db, repo, sid, "a/1") is False  # paused: left to the publish
    assert repo.get_ownership(sid) is not None
    _kill_row(db, sid)
    assert await settle_record(db, repo, sid, "b/2") is False  # not b's
    assert repo.get_ownership(sid).owner == "a/1"  # type: ignore[union-attr]
    assert await settle_record(db, repo, sid, "a/1") is True
    assert repo.get_ownership(sid) is None


async def test_a_sandbox_running_on_a_dead_node_is_taken_over_from_its_checkpoint_only(tmp_path: Path) -> None:
    """A record ``running`` on another node is taken over only when that node is known dead and the record names
    a checkpoint to resume from; the take-over is a compare-and-swap (the first taker wins) and the dead node's
    next checkpoint is refused."""
    sid, snap = "itakeover00000000001", "pause-1"
    db = _paused_sandbox_db(tmp_path, sid, snap)
    repo = PosixFsRepository(tmp_path / "repo")
    snapshots = tmp_path / "snapshots"
    asked: list[str] = []

    async def dead(owner: str) -> bool:
        asked.append(owner)
        return owner.startswith("b/")

    async def alive(owner: str) -> bool:
        return False

    repo.claim_sandbox(sid, "b/2")  # b runs it and never checkpointed: nothing to resume from
    with pytest.raises(OwnershipConflict, match="running on node b/2"):
        await claim_for_resume(db, repo, snapshots, sid, "a", "a/1", dead)
    assert asked == []  # no checkpoint: not even asked
    repo.checkpoint_sandbox(sid, "b/2", snap)  # b's periodic snapshot, published
    rec = repo.get_ownership(sid)
    assert rec is not None and (rec.state, rec.owner, rec.snapshot_id) == ("running", "b/2", snap)
    with pytest.raises(OwnershipConflict):  # b is alive: never two runners
        await claim_for_resume(db, repo, snapshots, sid, "a", "a/1", alive)
    with pytest.raises(OwnershipConflict):  # a lone node (no cluster) never takes over
        await claim_for_resume(db, repo, snapshots, sid, "a", "a/1")
    claim = await claim_for_resume(db, repo, snapshots, sid, "a", "a/1", dead)
    assert claim is not None and claim.record.owner == "a/1" and claim.record.state == "running"
    assert claim.previous is not None and claim.previous.owner == "b/2" and asked == ["b/2"]
    with db.session() as s:
        detail = s.query(Event).filter_by(operation="ownership_claim", sandbox_id=sid).one().detail
    assert detail["taken_over_from"] == "b/2"
    with pytest.raises(OwnershipConflict):  # b back (or cut off and running on): its checkpoint is refused
        repo.checkpoint_sandbox(sid, "b/2", snap)
    with pytest.raises(OwnershipConflict):  # nor can b take it back from a live a
        repo.claim_sandbox(sid, "b/2", take_over_from="c/3")
