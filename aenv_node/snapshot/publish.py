"""Snapshots in the shared repository: publish after a pause (and as checkpoints), import on another node.

A node keeps what it needs locally (layer files, each snapshot's flat memory
image). For a sandbox to outlive its node, every pause is also **published**
to the configured repository (posix_fs, possibly on a shared filesystem, or
s3): its disk layers, its memory chain as layers (the template's RAM image at
the bottom, imported as a layer once, then one layer of dirty pages per
capture), and a manifest holding the device state and everything a restore
needs, written last (``Repository.commit_snapshot``), then a small
``sandbox-<id>`` manifest naming the sandbox's newest snapshot. A reader never
sees a manifest whose layers are missing.

A node asked to resume a sandbox it does not know looks for that manifest,
**imports** the sandbox and its snapshot into its own database (layers
recorded as repository-only layers (no local path)), and restores it with a cold local cache:
disk layers are read on demand in 256 KiB ranges through the LRU cache, and
the memory chain is materialized into a local file through the same cache.

**Single writer.** Only one node runs a given sandbox at a time, enforced
through the ``sandbox-<id>`` manifest, which is also the sandbox's ownership
record (storage/repository/base.py): owner (``<node id>/<state-dir tag>``:
node ids default to the hostname, and two nodes on one host differ by their
state directory), state (``paused``: any node may claim it; ``running``: its
owner runs it) and a generation, all changed by compare-and-swap:

* resume (``claim_for_resume``) claims the record (``paused`` -> ``running``,
  owner = this node) before restoring; a sandbox running on another node is
  refused (``OwnershipConflict``, a 409 "sandbox X is running on node Y"). If
  the record names a snapshot published by another node, this node's copy is
  stale: that newer snapshot is imported (the local row moves to it) and the
  sandbox resumes from it, so a sandbox paused on B resumes on A with B's
  changes. If the record is gone although this node's snapshot had been
  published, the sandbox was killed elsewhere: refused (``OwnershipLost``,
  404), the local row left as it is for the operator. A failed restore hands
  the claim back;
* publish (``publish_snapshot``) writes the record ``paused`` at the new
  snapshot only if it is absent or owned by this node, and only while the
  local row is still paused at that snapshot (under the caller's per-sandbox
  lock, which resume holds too). A kill racing it is caught by reading the
  row again after the write: if it was killed meanwhile the record is removed
  (the kill removes it too if it came after the write), so no pointer
  survives a kill;
* checkpoint (``publish_checkpoint``, after each periodic snapshot) commits
  the snapshot and points the record at it while it stays ``running`` here,
  only if the record is absent or this node's; a record another node holds
  means that node took the sandbox over (``SandboxMovedAway``: this copy
  stops). A resume elsewhere takes over a sandbox ``running`` on a node the
  cluster's scheduler counts dead (``owner_dead``), from that checkpoint: the
  compare-and-swap against the exact record read keeps it to one taker;
* kill (``forget_published``) deletes the record only if this node owns it;
  ``settle_record`` does the same after a sandbox ended here without a
  kill (VMM died, node shut down), so no record says it still runs here.

The pointer and the ownership are one document rather than a separate
``owner-<id>`` manifest because they change together (a publish moves the
newest snapshot and hands the sandbox back in one step): one object is one
compare-and-swap, and a reader never sees them disagree. Old pointers without
an owner read as paused and unowned, so a node upgraded in place claims them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Awaitable, Callable
from typing import Any, AsyncContextManager, Optional

import trio
from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from ..faults import crash_point
from ..state import (
    Database,
    Event,
    EventSubject,
    Layer,
    LayerKind,
    Sandbox,
    SandboxState,
    Snapshot,
    SnapshotConfig,
    SnapshotKind,
    SnapshotStatus,
    utcnow,
)
from ..state.repository import insert_sandbox, record_event, update_sandbox
from ..storage import LayerRef, import_raw
from ..storage.repository.base import CAS_RETRIES, Ownership, Repository, layer_key
from ..storage.repository.ownership import OWNER_RUNNING
from ..storage.repository.errors import ManifestCorrupt, OwnershipChanged, OwnershipConflict, OwnershipLost
from .errors import SandboxMovedAway
from .layers import record_stack, ref_of, stack_of
from .manifest import DiskLayerRef, SandboxRecord, SnapshotManifest

__all__ = ["publish_snapshot", "publish_checkpoint", "upload_snapshot", "published_event", "fetch_snapshot",
           "write_vmstate", "record_published_snapshot", "OwnerDead", "import_sandbox", "owner_id", "Claim", "claim_for_resume", "release_claim",
           "forget_published", "settle_record", "unpublished_pauses", "record_unsettled", "unsettled_records",
           "retry_unsettled"]

log = logging.getLogger(__name__)


def unpublished_pauses(s: Session) -> list[tuple[str, str]]:
    """(snapshot, sandbox) of every sandbox paused here at a snapshot not yet published: its publish was cut
    (a stop, a crash) or failed (the repository down, full or erroring), so it is published again."""
    return [(snap, sid) for sid, snap in s.execute(
        select(Sandbox.id, Sandbox.snapshot_id).join(Snapshot, Snapshot.id == Sandbox.snapshot_id)
        .where(Sandbox.state == SandboxState.PAUSED, Snapshot.published.is_(False))) if snap is not None]


def owner_id(node_id: str, instance: str) -> str:
    """A node's name in ownership records: its node id and a tag of its state directory (node ids default
    to the hostname, so two nodes on one host would otherwise look like one)."""
    return f"{node_id}/{instance}"


async def _memory_base_layer(db: Database, layers_dir: Path, memory_base: str) -> LayerRef:
    """The template RAM image at the bottom of a memory chain, as a layer (imported once)."""
    def find(s: Session) -> Optional[LayerRef]:
        for sn in s.scalars(select(Snapshot).where(Snapshot.kind == SnapshotKind.BOOT,
                                                   Snapshot.memory_location == memory_base,
                                                   Snapshot.memory_base_layer.is_not(None))):
            layer = s.get(Layer, sn.memory_base_layer)
            if layer is not None:
                return ref_of(layer)
        return None

    found = await db.run(find)
    if found is not None:
        return found
    info = await trio.to_thread.run_sync(lambda: import_raw(memory_base, layers_dir))
    digest = f"sha256:{info.digest}"

    def record(s: Session) -> None:
        if s.get(Layer, digest) is None:
            s.add(Layer(digest=digest, kind=LayerKind.MEMORY, size_bytes=info.file_size,
                        virtual_size_bytes=info.virtual_size, local_path=str(info.path), refcount=1))
        s.execute(update(Snapshot).where(Snapshot.kind == SnapshotKind.BOOT,
                                         Snapshot.memory_location == memory_base)
                  .values(memory_base_layer=digest))

    await db.run(record)
    return LayerRef.local(info.path, digest)


async def upload_snapshot(db: Database, repo: Repository, layers_dir: Path, snapshot_id: str,
                          sandbox_id: Optional[str]) -> dict[str, Any]:
    """Upload the snapshot's layers and write its manifest (``Repository.commit_snapshot``: atomic); the summary
    of what went up. ``sandbox_id`` None: a template's boot snapshot (no sandbox ran it)."""
    t0 = time.monotonic()

    def gather(s: Session) -> tuple[Snapshot, Optional[Sandbox], list[Layer], list[Layer]]:
        sn = s.get(Snapshot, snapshot_id)
        sb = s.get(Sandbox, sandbox_id) if sandbox_id is not None else None
        if sn is None or sn.config is None or (sandbox_id is not None and sb is None):
            raise OwnershipLost(sandbox_id or snapshot_id)
        return sn, sb, stack_of(s, snapshot_id, LayerKind.DISK), stack_of(s, snapshot_id, LayerKind.MEMORY)

    sn, sb, disk, memory = await db.run(gather)
    assert sn.config is not None
    layer_paths = {l.digest: l.local_path for l in disk + memory if l.local_path}
    memory_chain = [l.digest for l in memory]
    # a chain over a template's RAM file (or a boot snapshot's own RAM file): that file goes up as the chain's
    # bottom layer
    ram_file = sn.memory_base_location or (sn.memory_location if sn.kind == SnapshotKind.BOOT and not memory
                                           else None)
    if ram_file:
        base = await _memory_base_layer(db, layers_dir, ram_file)
        memory_chain.insert(0, base.digest)
        if base.path is not None:
            layer_paths[base.digest] = str(base.path)
    require = [l.digest for l in disk + memory if not l.local_path]
    vmstate = await trio.to_thread.run_sync(Path(sn.vmstate_location or "").read_bytes)
    manifest = SnapshotManifest(
        snapshot_id=sn.id, kind=sn.kind.value, parent_id=sn.parent_id, source_sandbox_id=sn.source_sandbox_id,
        template_id=sn.template_id, vmm=sn.vmm, shape=sn.config.shape, format=sn.vmstate_format,
        vmstate_b64=SnapshotManifest.encode_vmstate(vmstate),
        disk_layers=[DiskLayerRef(digest=l.digest, size=l.size_bytes, virtual_size=l.virtual_size_bytes)
                     for l in disk],
        memory_layers=memory_chain, memory_mb=sn.memory_mb, access_token=sn.config.access_token,
        env_vars=dict(sn.config.env_vars), default_user=sn.config.default_user,
        default_workdir=sn.config.default_workdir, guest_agent=sn.config.guest_agent,
        sandbox=SandboxRecord.of(sb) if sb is not None else None)

    result = await trio.to_thread.run_sync(
        lambda: repo.commit_snapshot(sn.id, manifest.model_dump(mode="json"), layer_paths, require=require))
    stored = result.uploaded + result.already_present
    crash_point("publish.manifest_written")

    def mark_stored(s: Session) -> None:
        for digest in stored:
            s.execute(update(Layer).where(Layer.digest == digest, Layer.repository_key.is_(None))
                      .values(repository_key=layer_key(digest)))

    await db.run(mark_stored)
    return {"uploaded": len(result.uploaded), "already_present": len(result.already_present),
            "ms": round((time.monotonic() - t0) * 1000, 1)}


async def published_event(db: Database, sandbox_id: str, snapshot_id: str, summary: dict[str, Any]) -> None:
    await db.run(lambda s: record_event(s, "snapshot_publish", sandbox_id=sandbox_id,
                                        subject=EventSubject.SNAPSHOT, subject_id=snapshot_id,
                                        duration_ms=summary["ms"], detail=summary))


async def publish_snapshot(db: Database, repo: Repository, layers_dir: Path, snapshot_id: str,
                           sandbox_id: str, *, owner: str,
                           pointer_lock: Optional[AsyncContextManager[Any]] = None) -> dict[str, Any]:
    """Commit one snapshot, then point the sandbox's record at it (``paused``, owned by ``owner``); returns
    the commit summary (``pointer``: written | superseded | killed | moved).

    ``pointer_lock`` is held around the record update: the caller's per-sandbox lock that resume holds too,
    so "the row is still paused at this snapshot" stays true until the record says so."""
    t0 = time.monotonic()
    summary = await upload_snapshot(db, repo, layers_dir, snapshot_id, sandbox_id)
    async with (pointer_lock or contextlib.nullcontext()):
        pointer, generation = await _publish_pointer(db, repo, sandbox_id, snapshot_id, owner)
    summary.update(pointer=pointer, generation=generation, ms=round((time.monotonic() - t0) * 1000, 1))
    await published_event(db, sandbox_id, snapshot_id, summary)
    return summary


async def publish_checkpoint(db: Database, repo: Repository, layers_dir: Path, snapshot_id: str,
                             sandbox_id: str, *, owner: str,
                             pointer_lock: Optional[AsyncContextManager[Any]] = None) -> dict[str, Any]:
    """Publish a running sandbox's periodic snapshot and point its record at it, still ``running`` here: if
    this node dies, another node of the cluster resumes the sandbox from it (what ran after it is lost: the
    period bounds the loss). ``SandboxMovedAway`` if another node holds the record (it took the sandbox over
    while this node was thought dead: this copy must stop).

    The record is written under ``pointer_lock`` (the lock a pause's publish holds) and only while the row
    still says running: a pause that came meanwhile publishes ``paused``, which a late checkpoint must not undo."""
    t0 = time.monotonic()
    summary = await upload_snapshot(db, repo, layers_dir, snapshot_id, sandbox_id)

    def running(s: Session) -> bool:
        sb = s.get(Sandbox, sandbox_id)
        return sb is not None and sb.state == SandboxState.RUNNING

    async with (pointer_lock or contextlib.nullcontext()):
        if not await db.run(running):
            summary.update(pointer="superseded", ms=round((time.monotonic() - t0) * 1000, 1))
            await published_event(db, sandbox_id, snapshot_id, summary)
            return summary
        try:
            rec = await trio.to_thread.run_sync(lambda: repo.checkpoint_sandbox(sandbox_id, owner, snapshot_id))
        except OwnershipConflict as exc:
            raise SandboxMovedAway(sandbox_id, exc.owner) from None

    def mark(s: Session) -> None:
        sn = s.get(Snapshot, snapshot_id)
        if sn is not None:
            sn.published = True

    await db.run(mark)
    summary.update(pointer="checkpoint", generation=rec.generation, ms=round((time.monotonic() - t0) * 1000, 1))
    await published_event(db, sandbox_id, snapshot_id, summary)
    return summary


async def _publish_pointer(db: Database, repo: Repository, sandbox_id: str, snapshot_id: str,
                           owner: str) -> tuple[str, Optional[int]]:
    """Record ``paused`` at ``snapshot_id`` if the local row is still paused there; undo it if a kill came."""
    def local(s: Session) -> tuple[Optional[SandboxState], Optional[str]]:
        sb = s.get(Sandbox, sandbox_id)
        return (sb.state, sb.snapshot_id) if sb is not None else (None, None)

    gone = (None, SandboxState.KILLING, SandboxState.KILLED)
    state, current = await db.run(local)
    if state in gone:
        return "killed", None
    if state != SandboxState.PAUSED or current != snapshot_id:
        return "superseded", None  # resumed (and maybe paused again) meanwhile: that pause publishes
    try:
        rec = await trio.to_thread.run_sync(lambda: repo.release_sandbox(sandbox_id, owner, snapshot_id))
    except OwnershipConflict as exc:
        log.warning("not publishing sandbox %s as paused at %s: %s (this node's copy is stale)",
                    sandbox_id, snapshot_id, exc)
        return "moved", None
    state, _ = await db.run(local)
    if state in gone:
        # a kill ran between the check above and the write (its delete came first): undo the write
        await trio.to_thread.run_sync(forget_published, repo, sandbox_id, owner)
        return "killed", None

    def mark(s: Session) -> None:
        sn = s.get(Snapshot, snapshot_id)
        if sn is not None:
            sn.published = True

    await db.run(mark)
    return "written", rec.generation


#: the event of a record left in the repository by a kill or an end that could not delete it (``error`` set), and
#: of its deletion by a later retry (no error)
SETTLE_EVENT = "ownership_settle"


def record_unsettled(s: Session, sandbox_id: str, error: str) -> None:
    """A sandbox ended (killed, or in error) but its record still names this node: the repository could not be
    reached. ``retry_unsettled`` deletes it once it can."""
    record_event(s, SETTLE_EVENT, sandbox_id=sandbox_id, error=error)


def unsettled_records(s: Session) -> list[str]:
    """Ended sandboxes whose newest ``ownership_settle`` event is a failure."""
    newest = (select(Event.sandbox_id, func.max(Event.id).label("last")).where(Event.operation == SETTLE_EVENT)
              .group_by(Event.sandbox_id).subquery())
    return list(s.scalars(
        select(Sandbox.id).join(newest, newest.c.sandbox_id == Sandbox.id).join(Event, Event.id == newest.c.last)
        .where(Event.error.is_not(None), Sandbox.state.in_((SandboxState.KILLED, SandboxState.ERROR)))))


async def retry_unsettled(db: Database, repo: Repository, owner: str) -> list[str]:
    """Delete the records ``unsettled_records`` names (each deletion an ``ownership_settle`` event without an
    error); the ones that fail again stay for the next retry. Returns the sandboxes settled."""
    settled = []
    for sid in await db.run(unsettled_records):
        try:
            await trio.to_thread.run_sync(forget_published, repo, sid, owner)
        except Exception as exc:
            log.info("the record of %s is still in the repository: %s", sid, exc)
            continue
        await db.run(_record_settled, sid)
        settled.append(sid)
    return settled


def _record_settled(s: Session, sandbox_id: str) -> None:
    record_event(s, SETTLE_EVENT, sandbox_id=sandbox_id, detail={"settled": True})


def forget_published(repo: Repository, sandbox_id: str, owner: str) -> bool:
    """Delete the sandbox's record if this node owns it (blocking: run it in a thread); True if deleted."""
    try:
        return repo.drop_ownership(sandbox_id, owner)
    except OwnershipConflict as exc:
        log.info("leaving the record of sandbox %s in the repository: %s", sandbox_id, exc)
        return False


async def _fetch_snapshot(repo: Repository, snapshot_id: str) -> SnapshotManifest:
    doc = await trio.to_thread.run_sync(repo.get_manifest, snapshot_id)
    try:
        return SnapshotManifest.model_validate(doc)
    except ValueError as exc:  # pydantic's ValidationError
        raise ManifestCorrupt(snapshot_id, str(exc).splitlines()[0]) from exc


def record_published_snapshot(s: Session, manifest: SnapshotManifest, snap_dir: Path) -> None:
    """The rows of a snapshot another node published (its vmstate written to ``snap_dir`` already): its layers as
    repository-only references (read on demand through the cache), the snapshot, its stacks; nothing if known."""
    snap_id = manifest.snapshot_id

    def known(digest: str) -> bool:
        """Whether the layer has a row here already; a row whose file this node's collector removed (rows
        outlive their files) is pointed at the repository again."""
        row = s.get(Layer, digest)
        if row is not None and row.local_path and not os.path.exists(row.local_path):
            row.local_path, row.repository_key = None, layer_key(digest)
        return row is not None

    for l in manifest.disk_layers:
        if not known(l.digest):
            s.add(Layer(digest=l.digest, kind=LayerKind.DISK, size_bytes=l.size,
                        virtual_size_bytes=l.virtual_size, local_path=None, repository_key=layer_key(l.digest),
                        refcount=1))
    for d in manifest.memory_layers:
        if not known(d):
            s.add(Layer(digest=d, kind=LayerKind.MEMORY, size_bytes=0, local_path=None,
                        repository_key=layer_key(d), refcount=1))
    if s.get(Snapshot, snap_id) is None:
        s.add(Snapshot(
            id=snap_id, kind=SnapshotKind(manifest.kind), status=SnapshotStatus.COMMITTED, parent_id=None,
            source_sandbox_id=manifest.source_sandbox_id, template_id=manifest.template_id,
            vmm=manifest.vmm, vmstate_location=str(snap_dir / "vmstate"), vmstate_format=manifest.format,
            memory_location=str(snap_dir / "memory"), memory_base_location=None, memory_from_layers=True,
            imported_parent_id=manifest.parent_id, published=True,
            config=SnapshotConfig(shape=manifest.shape, access_token=manifest.access_token,
                                  env_vars=dict(manifest.env_vars), default_user=manifest.default_user,
                                  default_workdir=manifest.default_workdir, guest_agent=manifest.guest_agent),
            memory_mb=manifest.memory_mb, committed_at=utcnow()))
        s.flush()
        record_stack(s, snap_id, [LayerRef.remote(l.digest) for l in manifest.disk_layers],
                     manifest.memory_layers)


async def write_vmstate(snapshots_dir: Path, manifest: SnapshotManifest) -> Path:
    """The directory of an imported snapshot, with its device state written there."""
    snap_dir = snapshots_dir / manifest.snapshot_id
    snap_dir.mkdir(parents=True, exist_ok=True)
    await trio.to_thread.run_sync((snap_dir / "vmstate").write_bytes, manifest.vmstate)
    return snap_dir


async def fetch_snapshot(repo: Repository, snapshot_id: str) -> SnapshotManifest:
    """A published snapshot's manifest (``ManifestCorrupt`` if it is not one)."""
    return await _fetch_snapshot(repo, snapshot_id)


async def _record_import(db: Database, snapshots_dir: Path, sandbox_id: str, node_id: str,
                         manifest: SnapshotManifest, *, replace: bool) -> None:
    """Record a published snapshot (its layers as repository-only references) and point the sandbox at it: a
    new row (``replace=False``; nothing if one exists) or, for a newer snapshot of a sandbox known here, the
    existing paused row, with the settings the other node had."""
    snap_id = manifest.snapshot_id
    snap_dir = await write_vmstate(snapshots_dir, manifest)
    info = manifest.sandbox
    if info is None:
        raise ManifestCorrupt(snap_id, "a sandbox's snapshot names no sandbox")

    def record(s: Session) -> None:
        existing = s.get(Sandbox, sandbox_id)
        if existing is not None and not replace:
            return
        record_published_snapshot(s, manifest, snap_dir)
        if existing is not None:
            update_sandbox(
                s, sandbox_id, operation="import",
                detail={"snapshot_id": snap_id, "replaces": existing.snapshot_id,
                        "reason": "a newer snapshot was published by another node"},
                snapshot_id=snap_id, vmm=manifest.vmm, metadata_=info.metadata, env_vars=info.env_vars,
                envd_access_token=info.envd_access_token, traffic_access_token=info.traffic_access_token,
                auto_pause=info.auto_pause, auto_resume=info.auto_resume, network_policy=info.network_policy)
            return
        row = Sandbox(
            id=sandbox_id, template_id=info.template_id, alias=info.alias, node_id=node_id,
            client_id=node_id, cpu_count=info.cpu_count, memory_mb=info.memory_mb,
            disk_size_mb=info.disk_size_mb, envd_version=info.envd_version,
            envd_access_token=info.envd_access_token, traffic_access_token=info.traffic_access_token,
            metadata_=info.metadata,
            env_vars=info.env_vars, auto_pause=info.auto_pause, auto_resume=info.auto_resume,
            allow_internet_access=info.allow_internet_access,
            network_policy=info.network_policy, snapshot_id=snap_id, vmm=manifest.vmm,
            state=SandboxState.PAUSED, paused_at=utcnow(), end_at=utcnow())
        insert_sandbox(s, row, operation="import")

    await db.run(record)
    log.info("imported sandbox %s (snapshot %s) from the repository%s", sandbox_id, snap_id,
             " (newer than this node's copy)" if replace else "")


async def import_sandbox(db: Database, repo: Repository, snapshots_dir: Path, sandbox_id: str,
                         node_id: str) -> bool:
    """Make a sandbox paused on another node known here (False if the repository has none).

    It only reads; resume goes through ``claim_for_resume``, which imports and claims."""
    rec = await trio.to_thread.run_sync(repo.get_ownership, sandbox_id)
    if rec is None or not rec.snapshot_id:
        return False
    await _record_import(db, snapshots_dir, sandbox_id, node_id, await _fetch_snapshot(repo, rec.snapshot_id),
                         replace=False)
    return True


@dataclass(frozen=True)
class Claim:
    """What ``claim_for_resume`` did: the record as claimed, as it was before, and a snapshot it imported."""

    record: Ownership
    previous: Optional[Ownership]
    imported: Optional[str] = None

#: ``await owner_dead(owner)``: whether the node named by an ownership record's ``owner`` is known to be dead
#: (the cluster's scheduler missed its heartbeats for its TTL); the node's cluster client answers it
OwnerDead = Callable[[str], Awaitable[bool]]


async def claim_for_resume(db: Database, repo: Repository, snapshots_dir: Path, sandbox_id: str,
                           node_id: str, owner: str, owner_dead: Optional[OwnerDead] = None) -> Optional[Claim]:
    """Claim a paused sandbox for this node before restoring it; None if neither this node nor the
    repository knows it.

    The caller has checked that a local row, if any, is paused.  Raises ``OwnershipConflict`` if another
    node runs it, ``OwnershipLost`` if it was killed elsewhere; imports the snapshot first when the record
    names one another node published (a sandbox unknown here, or a local copy that is stale).  A sandbox
    running on a node that ``owner_dead`` says is dead is taken over from the last snapshot that node published
    (a periodic snapshot, a checkpoint): what ran after it is lost, the rest resumes here.  Every claim
    swaps against exactly the record that was read and judged, so a concurrent claim elsewhere either lands
    first (seen on the next round) or fails.
    """
    def local(s: Session) -> Optional[tuple[SandboxState, Optional[str], bool]]:
        sb = s.get(Sandbox, sandbox_id)
        if sb is None:
            return None
        sn = s.get(Snapshot, sb.snapshot_id) if sb.snapshot_id else None
        return sb.state, sb.snapshot_id, bool(sn is not None and sn.published)

    for _ in range(CAS_RETRIES):
        rec = await trio.to_thread.run_sync(repo.get_ownership, sandbox_id)
        dead_owner: Optional[str] = None
        if rec is not None and rec.held_by_other(owner):
            if not (rec.state == OWNER_RUNNING and rec.snapshot_id and owner_dead is not None
                    and await owner_dead(rec.owner)):
                raise OwnershipConflict(sandbox_id, rec.owner, rec.state, "resume")
            dead_owner = rec.owner
            log.warning("sandbox %s runs on node %s, which is dead: taking it over from its checkpoint %s",
                        sandbox_id, rec.owner, rec.snapshot_id)
        mine = await db.run(local)
        imported = None
        if mine is None:
            if rec is None or not rec.snapshot_id:
                return None
            await _record_import(db, snapshots_dir, sandbox_id, node_id,
                                 await _fetch_snapshot(repo, rec.snapshot_id), replace=False)
            imported = rec.snapshot_id
        elif rec is None:
            if mine[2]:
                raise OwnershipLost(sandbox_id)
        elif rec.snapshot_id and rec.snapshot_id != mine[1] and rec.owner not in ("", owner):
            # paused on another node after it ran there: this node's copy is older
            await _record_import(db, snapshots_dir, sandbox_id, node_id,
                                 await _fetch_snapshot(repo, rec.snapshot_id), replace=True)
            imported = rec.snapshot_id
        try:
            claimed = await trio.to_thread.run_sync(lambda: repo.claim_sandbox(sandbox_id, owner, expect=rec,
                                                                               take_over_from=dead_owner))
        except OwnershipChanged:
            continue  # someone wrote it since it was read: judge it again
        await db.run(lambda s: record_event(
            s, "ownership_claim", sandbox_id=sandbox_id, subject=EventSubject.SANDBOX, subject_id=sandbox_id,
            detail={"owner": owner, "generation": claimed.generation, "snapshot_id": claimed.snapshot_id,
                    "previous_owner": rec.owner if rec is not None else None, "imported": imported,
                    **({"taken_over_from": dead_owner} if dead_owner else {})}))
        return Claim(claimed, rec, imported)
    raise OwnershipChanged(sandbox_id, f"lost {CAS_RETRIES} claims in a row to other writers")


def release_claim(repo: Repository, claim: Claim, owner: str) -> None:
    """Hand back a claim whose restore failed (blocking): the record as it was before (absent, or paused at
    the snapshot it named), unless it moved on meanwhile."""
    try:
        if claim.previous is None:
            repo.drop_ownership(claim.record.sandbox_id, owner, expect=claim.record)
        else:
            repo.release_sandbox(claim.record.sandbox_id, owner, claim.record.snapshot_id, expect=claim.record)
    except (OwnershipChanged, OwnershipConflict) as exc:
        log.warning("handing back the claim on sandbox %s failed: %s", claim.record.sandbox_id, exc)


async def settle_record(db: Database, repo: Repository, sandbox_id: str, owner: str) -> bool:
    """After a sandbox stopped running here without a pause or a kill (its VMM died, the node shut down, the
    guest powered off): a record still saying ``running`` here would make every other node refuse it, so
    it is deleted if the sandbox ended killed or in error.  True if a record was deleted.

    For the sandbox registry's ``stopped_hooks`` and the start-up reconcile (which may find records of sandboxes it
    marked killed); a paused sandbox's record is the publish's business and is left alone."""
    def state(s: Session) -> Optional[SandboxState]:
        sb = s.get(Sandbox, sandbox_id)
        return sb.state if sb is not None else None

    if await db.run(state) not in (SandboxState.KILLED, SandboxState.ERROR):
        return False
    return await trio.to_thread.run_sync(forget_published, repo, sandbox_id, owner)
