"""Bounding a snapshot's layer chains: every pause adds a disk layer and a memory layer.

A sandbox paused and resumed forever would grow both chains without bound (each
read of its disk would search more indexes, each publish name more layers).
``compact_snapshot`` rewrites a chain longer than the limit into one layer, in
a worker thread, then swaps it into the snapshot's stack in one transaction
with its ``compact`` event: a disk chain becomes base + one layer (the base is
shared by every sandbox of the template), a memory chain one layer over the
template's RAM image. The replaced layers are garbage for ``gc.py``. Chains
holding layers that live only in the repository (imported) are left alone.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import trio
from sqlalchemy.orm import Session

from ..faults import crash_point
from ..state import Database, EventSubject, Layer, LayerKind, Snapshot, SnapshotStatus
from ..state.repository import record_event
from ..storage import LayerInfo, LayerReader, compact_layers
from .layers import replace_stack, stack_of

__all__ = ["compact_snapshot"]

log = logging.getLogger(__name__)


def _chains(s: Session, snapshot_id: str) -> dict[LayerKind, list[Layer]]:
    sn = s.get(Snapshot, snapshot_id)
    if sn is None or sn.status != SnapshotStatus.COMMITTED:
        return {}  # superseded and collected meanwhile: nothing to compact
    return {kind: stack_of(s, snapshot_id, kind) for kind in (LayerKind.DISK, LayerKind.MEMORY)}


def _rewrite(paths: list[Path], layers_dir: Path) -> LayerInfo:
    readers = [LayerReader.open(path) for path in paths]
    try:  # bottom=False: zeroed extents must keep shadowing what lies below
        return compact_layers(readers, layers_dir, bottom=False,
                              virtual_size=max(r.virtual_size for r in readers))
    finally:
        for r in readers:
            r.close()


async def compact_snapshot(db: Database, layers_dir: Path, snapshot_id: str, *, limit: int) -> bool:
    """Compact the snapshot's chains longer than ``limit`` (see the module docstring); True if one was."""
    compacted = False
    for kind, rows in (await db.run(_chains, snapshot_id)).items():
        keep = 1 if kind == LayerKind.DISK else 0  # the disk base layer stays (shared by every sandbox)
        paths = [Path(r.local_path) for r in rows[keep:] if r.local_path]
        if len(rows) <= limit or len(paths) < len(rows) - keep:
            continue  # short enough, or imported layers that live only in the repository
        t0 = time.monotonic()
        info = await trio.to_thread.run_sync(_rewrite, paths, layers_dir)
        digest = f"sha256:{info.digest}"
        crash_point("compaction.written")

        def swap(s: Session, kind: LayerKind = kind, keep: int = keep, before: int = len(rows),
                 t0: float = t0) -> None:
            if s.get(Layer, digest) is None:
                s.add(Layer(digest=digest, kind=kind, size_bytes=info.file_size,
                            virtual_size_bytes=info.virtual_size, local_path=str(info.path), refcount=1))
            replace_stack(s, snapshot_id, kind, keep, digest)
            record_event(s, "compact", subject=EventSubject.SNAPSHOT, subject_id=snapshot_id,
                         duration_ms=(time.monotonic() - t0) * 1000,
                         detail={"kind": kind.value, "layers_before": before, "layers_after": keep + 1})

        await db.run(swap)
        compacted = True
        log.info("compacted snapshot %s: %d %s layers -> %d", snapshot_id, len(rows), kind.value, keep + 1)
    return compacted
