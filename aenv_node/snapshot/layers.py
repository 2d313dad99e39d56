"""Recording layers and layer stacks in the state database.

Every writer of snapshot rows (a capture, a template build, an import, a compaction) records its
layers and the stack a snapshot is made of through these few functions, so a ``layers`` row and its
``snapshot_layers`` rows are always written the same way, in the writer's transaction.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from sqlalchemy import bindparam, delete, select
from sqlalchemy.orm import Session

from ..state import Layer, LayerKind, SnapshotLayer
from ..storage import LayerInfo, LayerRef

__all__ = ["layer_digest", "reference_layer", "record_stack", "replace_stack", "stack_of", "ref_of", "ensure_layers"]


def layer_digest(info: LayerInfo) -> str:
    """The digest as the database and repositories name it."""
    return f"sha256:{info.digest}"


def ref_of(row: Layer) -> LayerRef:
    return LayerRef(row.digest, Path(row.local_path) if row.local_path else None)


def reference_layer(s: Session, info: LayerInfo, kind: LayerKind) -> Layer:
    """Record a layer file this node wrote (once) and count one more snapshot referencing it."""
    row = s.get(Layer, layer_digest(info))
    if row is None:
        row = Layer(digest=layer_digest(info), kind=kind, size_bytes=info.file_size,
                    virtual_size_bytes=info.virtual_size, local_path=str(info.path), refcount=0)
        s.add(row)
    row.refcount += 1
    return row


def _ensure_layer(s: Session, ref: LayerRef, kind: LayerKind) -> None:
    """A row for a layer stacked by reference (from a source snapshot, recorded long ago)."""
    if s.get(Layer, ref.digest) is None:
        size = ref.path.stat().st_size if ref.path is not None else 0
        s.add(Layer(digest=ref.digest, kind=kind, size_bytes=size,
                    local_path=str(ref.path) if ref.path is not None else None, refcount=0))
        s.flush()


def ensure_layers(s: Session, refs: Sequence[LayerRef], kind: LayerKind) -> None:
    """A row for each layer of a live stack that has none (a layer a capture sealed and a restart of the node
    cut before it committed, now under a sandbox taken over: its row makes it the node's, not an orphan)."""
    for ref in refs:
        _ensure_layer(s, ref, kind)


def record_stack(s: Session, snapshot_id: str, disk: Sequence[LayerRef], memory: Sequence[str]) -> None:
    """The snapshot's disk stack and memory chain, bottom first."""
    for pos, ref in enumerate(disk):
        _ensure_layer(s, ref, LayerKind.DISK)
        s.add(SnapshotLayer(snapshot_id=snapshot_id, kind=LayerKind.DISK, position=pos, layer_digest=ref.digest))
    for pos, digest in enumerate(memory):
        s.add(SnapshotLayer(snapshot_id=snapshot_id, kind=LayerKind.MEMORY, position=pos, layer_digest=digest))


def replace_stack(s: Session, snapshot_id: str, kind: LayerKind, keep: int, digest: str) -> None:
    """Replace the layers of one stack from position ``keep`` up by the one layer ``digest`` (compaction)."""
    s.execute(delete(SnapshotLayer).where(SnapshotLayer.snapshot_id == snapshot_id, SnapshotLayer.kind == kind,
                                          SnapshotLayer.position >= keep))
    s.flush()
    s.add(SnapshotLayer(snapshot_id=snapshot_id, kind=kind, position=keep, layer_digest=digest))


#: built once: every create reads its source's two stacks (building the statement cost more than running it)
_STACK = (select(Layer).join(SnapshotLayer, SnapshotLayer.layer_digest == Layer.digest)
          .where(SnapshotLayer.snapshot_id == bindparam("snapshot_id"), SnapshotLayer.kind == bindparam("kind"))
          .order_by(SnapshotLayer.position))


def stack_of(s: Session, snapshot_id: str, kind: LayerKind) -> list[Layer]:
    """The layer rows of one of a snapshot's stacks, bottom first."""
    return list(s.scalars(_STACK, {"snapshot_id": snapshot_id, "kind": kind}))
