"""The snapshot store: loading a snapshot to restore from, and the snapshot rows' housekeeping.

It answers the questions operations ask of committed snapshots (load one, with its memory image
materialized from the repository if it was imported; is a pause snapshot's memory image this sandbox's
alone; which periodic snapshots a newer one supersedes) and makes the changes that retire snapshots
(a user snapshot deleted, older periodic snapshots superseded), each with its event. Their files go
with the next garbage collection (``snapshot/gc.py``); chains are bounded by ``compaction.py``.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Optional

import trio
from sqlalchemy import select
from sqlalchemy.orm import Session

from ..state import (
    Database,
    EventSubject,
    Sandbox,
    SandboxState,
    Snapshot,
    SnapshotKind,
    SnapshotStatus,
    Template,
    TemplateKind,
)
from ..state.repository import record_event
from ..storage import LayerReader, materialize, open_reader
from ..storage.cache import LayerCache
from .errors import SnapshotNotFound
from .source import SnapshotSource, load_source

__all__ = ["SnapshotStore"]

log = logging.getLogger(__name__)


class SnapshotStore:
    """Committed snapshots of this node (rows in the database, files in ``snapshots_dir``/``layers_dir``).

    ``cache`` is the layer cache repository layers are read through; the node sets it once the cache is
    open (imported snapshots need it to materialize their memory)."""

    def __init__(self, db: Database, *, layers_dir: Path, snapshots_dir: Path) -> None:
        self.db = db
        self.layers_dir = layers_dir
        self.snapshots_dir = snapshots_dir
        self.cache: Optional[LayerCache] = None
        #: one materialization of a snapshot's memory image at a time (a create and the background one)
        self._materializing: dict[str, trio.Lock] = {}

    async def load(self, snapshot_id: str) -> SnapshotSource:
        """The snapshot to restore from, its flat memory image present (``SnapshotNotFound`` if it is not
        committed)."""
        return await self.prepared(await self.db.run(load_source, snapshot_id), snapshot_id)

    async def prepared(self, source: Optional[SnapshotSource], snapshot_id: str) -> SnapshotSource:
        """``source`` (``load_source`` read it, in a transaction of the caller's) with its flat memory image
        present; ``SnapshotNotFound`` when it is None."""
        if source is None:
            raise SnapshotNotFound(f"snapshot {snapshot_id} not found")
        if source.memory_from_layers and not source.memory.exists():
            lock = self._materializing.setdefault(snapshot_id, trio.Lock())
            try:
                async with lock:
                    if not source.memory.exists():
                        await self._materialize_memory(source)
            finally:
                if not lock.locked() and lock.statistics().tasks_waiting == 0:
                    self._materializing.pop(snapshot_id, None)
        return source

    async def _materialize_memory(self, source: SnapshotSource) -> None:
        """A snapshot's flat memory image from its memory layers (local files, or the repository's through the
        local cache), laid over its base image (a template's RAM file) when its chain has one."""
        cache, dest = self.cache, source.memory
        base = (source.memory_base, 0) if source.memory_base else None
        t0 = time.monotonic()

        def work() -> None:
            readers: list[LayerReader] = []
            try:
                for ref in source.memory_refs:
                    readers.append(open_reader(ref, cache))
                materialize(readers, dest, base=base)
            finally:
                for r in readers:
                    r.close()

        dest.parent.mkdir(parents=True, exist_ok=True)
        await trio.to_thread.run_sync(work)
        log.info("materialized %s from %d memory layers in %.2fs", dest, len(source.memory_refs),
                 time.monotonic() - t0)

    async def delete_user_snapshot(self, snapshot_id: str) -> bool:
        """Delete a user snapshot (a template made from a running sandbox); False if there is none."""
        def work(s: Session) -> bool:
            t = s.get(Template, snapshot_id)
            sn = s.get(Snapshot, snapshot_id)
            if t is None or t.kind != TemplateKind.SNAPSHOT or sn is None or sn.status != SnapshotStatus.COMMITTED:
                return False
            s.delete(t)
            sn.status = SnapshotStatus.DELETED
            record_event(s, "snapshot_delete", subject=EventSubject.SNAPSHOT, subject_id=snapshot_id,
                         from_state=SnapshotStatus.COMMITTED, to_state=SnapshotStatus.DELETED)
            return True

        return await self.db.run(work)

    @staticmethod
    def retire_older_periodic(s: Session, sandbox_id: str, keep: str) -> None:
        """Mark the sandbox's periodic snapshots older than ``keep`` deleted (unless a sandbox runs from one)."""
        for sn in s.scalars(select(Snapshot).where(Snapshot.source_sandbox_id == sandbox_id,
                                                   Snapshot.kind == SnapshotKind.PERIODIC,
                                                   Snapshot.status == SnapshotStatus.COMMITTED,
                                                   Snapshot.id != keep)):
            in_use = s.scalars(select(Sandbox.id).where(Sandbox.snapshot_id == sn.id,
                                                        Sandbox.state != SandboxState.KILLED)).first()
            if in_use is None:
                sn.status = SnapshotStatus.DELETED
                record_event(s, "snapshot_delete", subject=EventSubject.SNAPSHOT, subject_id=sn.id,
                             from_state=SnapshotStatus.COMMITTED, to_state=SnapshotStatus.DELETED,
                             detail={"reason": "superseded"})

    @staticmethod
    def memory_is_private(s: Session, sandbox_id: str, snapshot_id: str) -> bool:
        """Is the flat memory image of ``snapshot_id`` (the one the running sandbox was restored from) this
        sandbox's alone, so that its pause may take the file over instead of copying it? True for the
        sandbox's own previous pause snapshot when nothing else can restore from it: pause snapshots are
        not templates, and only their sandbox resumes them (checked: no other live sandbox points at it)."""
        sn = s.get(Snapshot, snapshot_id)
        if sn is None or sn.kind != SnapshotKind.PAUSE or sn.source_sandbox_id != sandbox_id:
            return False
        if s.scalar(select(Template.id).where(Template.boot_snapshot_id == snapshot_id).limit(1)) is not None:
            return False
        others = s.scalar(select(Sandbox.id).where(Sandbox.snapshot_id == snapshot_id, Sandbox.id != sandbox_id,
                                                   Sandbox.state != SandboxState.KILLED).limit(1))
        return others is None and Path(sn.memory_location or "").parent.name == snapshot_id

    @staticmethod
    def latest_periodic(s: Session, sandbox_id: str) -> Optional[Snapshot]:
        """The sandbox's newest committed periodic snapshot (what a crash falls back to)."""
        return s.scalars(select(Snapshot).where(
            Snapshot.source_sandbox_id == sandbox_id, Snapshot.kind == SnapshotKind.PERIODIC,
            Snapshot.status == SnapshotStatus.COMMITTED).order_by(Snapshot.created_at.desc())).first()
