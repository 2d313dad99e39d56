"""Capturing a running sandbox into an incremental snapshot (pause, snapshot, fork).

A sandbox always runs restored from a snapshot whose memory image it maps
copy-on-write, so a capture only has to save what changed since that restore:

1. the VMM pauses the vCPUs and writes the device state plus the guest pages
   dirtied since the restore (QEMU: the pagemap method; Firecracker: a Diff
   snapshot) into a sparse diff file;
2. the disk's writable upper is sealed into a new layer (no data copy) and a
   fresh upper goes on top;
3. the VM resumes at once when it keeps running (snapshot, fork); the rest
   happens while it runs:
4. the dirty pages become a **memory layer** (zeroed pages recorded as zeroed
   extents, so they shadow the base) and the snapshot's own flat memory image
   is materialized: the source image copied (reflinked where the filesystem
   can) with the dirty ranges patched in. Every sandbox later restored from
   this snapshot maps that one file, so they share its page cache;
5. one transaction records the layers, the snapshot (parent = the snapshot the
   sandbox was restored from, so the lineage shows what each memory layer is a
   diff against) and its layer stack.

Until that transaction commits nothing refers to the new files; a failure
removes them, and the caller puts the sandbox back into a truthful state.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import trio

from ..state import Database, Layer, Snapshot, SnapshotLayer, utcnow
from ..state.repository import record_event
from ..storage.layer import LayerInfo, LayerWriter
from ..vmm import CaptureKind, MemoryRange, Vm, VmState
from ..vmm import memfile
from .machine import MachineShape
from .templates import layer_digest, new_id, reference_layer

__all__ = ["SnapshotSource", "CaptureOutcome", "capture_running"]

log = logging.getLogger(__name__)


@dataclass
class SnapshotSource:
    """What a running sandbox was restored from (the base of its next diff)."""

    snapshot_id: str
    memory: Path  # the flat memory image the VM maps copy-on-write
    memory_layers: list[str]  # digests, bottom first, over memory_base
    memory_base: str  # the flat image at the bottom of the memory chain (a template's RAM file)
    shape: MachineShape
    template_id: str
    disk_layers: list[Path] = field(default_factory=list)


@dataclass(frozen=True)
class CaptureOutcome:
    snapshot_id: str
    vmstate: Path
    memory: Path
    disk_layers: tuple[Path, ...]
    dirty_bytes: int
    paused_ms: float  # how long the guest's vCPUs were stopped
    total_ms: float


def _write_memory_layer(diff: Path, ranges: tuple[MemoryRange, ...], size: int, layers_dir: Path) -> LayerInfo:
    fd = os.open(diff, os.O_RDONLY)
    try:
        with LayerWriter(layers_dir, size, zero_blocks="zeroed") as w:
            for r in ranges:
                pos = r.offset
                while pos < r.end:
                    n = min(4 << 20, r.end - pos)
                    w.add_data(pos, os.pread(fd, n, pos))
                    pos += n
            return w.finish()
    finally:
        os.close(fd)


async def capture_running(
    *,
    db: Database,
    vm: Vm,
    image: Any,  # storage.Image
    sandbox_id: str,
    source: SnapshotSource,
    kind: str,
    keep_running: bool,
    layers_dir: Path,
    snapshots_dir: Path,
    access_token: Optional[str],
    env_vars: dict[str, str],
    name: Optional[str] = None,
) -> CaptureOutcome:
    t0 = time.monotonic()
    snapshot_id = new_id("snp_")
    snap_dir = snapshots_dir / snapshot_id
    snap_dir.mkdir(parents=True, exist_ok=True)
    diff = snap_dir / "memory.diff"
    resumed = False
    try:
        cap = await vm.capture(snap_dir / "vmstate", diff, kind=CaptureKind.DIFF)
        sealed = await trio.to_thread.run_sync(image.seal, layers_dir)
        if keep_running:
            await vm.resume()
            resumed = True
        paused_ms = (time.monotonic() - t0) * 1000

        def memory_work() -> LayerInfo:
            layer = _write_memory_layer(diff, cap.dirty_ranges, cap.mem_size, layers_dir)
            memfile.materialize(source.memory, [(diff, cap.dirty_ranges)], snap_dir / "memory")
            diff.unlink()
            return layer

        mem_layer = await trio.to_thread.run_sync(memory_work)
        disk_layers = tuple(source.disk_layers) + (Path(sealed.path),)  # entries: Path or "repo:<digest>"

        def commit(s) -> None:  # type: ignore[no-untyped-def]
            reference_layer(s, sealed, "disk")
            reference_layer(s, mem_layer, "memory")
            s.add(Snapshot(
                id=snapshot_id, kind=kind, status="committed", name=name,
                parent_id=source.snapshot_id, source_sandbox_id=sandbox_id,
                template_id=source.template_id, vmm=cap.vmm,
                vmstate_location=str(cap.vmstate),
                config={"shape": source.shape.to_json(), "format": cap.format.value,
                        "memory": str(snap_dir / "memory"),
                        "memory_base": source.memory_base,
                        "memory_layers": source.memory_layers + [layer_digest(mem_layer)],
                        "access_token": access_token, "env_vars": env_vars,
                        "dirty_bytes": cap.dirty_bytes},
                memory_mb=source.shape.mem_mib, committed_at=utcnow(),
            ))
            s.flush()
            for pos, path in enumerate(disk_layers):
                if isinstance(path, str) and path.startswith("repo:"):
                    digest = path[len("repo:"):]  # recorded when the snapshot was imported
                else:
                    digest = "sha256:" + Path(path).name.split(".")[0]
                if s.get(Layer, digest) is None:  # layers from before this node recorded them
                    s.add(Layer(digest=digest, kind="disk", size_bytes=Path(path).stat().st_size,
                                location=str(path), refcount=0))
                    s.flush()
                s.add(SnapshotLayer(snapshot_id=snapshot_id, kind="disk", position=pos, layer_digest=digest))
            for pos, digest in enumerate(source.memory_layers + [layer_digest(mem_layer)]):
                s.add(SnapshotLayer(snapshot_id=snapshot_id, kind="memory", position=pos, layer_digest=digest))
            record_event(s, "snapshot_commit", sandbox_id=sandbox_id, subject="snapshot",
                         subject_id=snapshot_id, to_state="committed",
                         duration_ms=(time.monotonic() - t0) * 1000,
                         detail={"kind": kind, "dirty_bytes": cap.dirty_bytes,
                                 "paused_ms": round(paused_ms, 1), "parent_id": source.snapshot_id})

        await db.run(commit)
        return CaptureOutcome(snapshot_id, cap.vmstate, snap_dir / "memory", disk_layers, cap.dirty_bytes,
                              paused_ms, (time.monotonic() - t0) * 1000)
    except BaseException:
        with trio.CancelScope(shield=True):
            shutil.rmtree(snap_dir, ignore_errors=True)
            if keep_running and not resumed and vm.state is VmState.PAUSED:
                try:
                    await vm.resume()
                except Exception:
                    log.exception("resuming %s after a failed capture failed", sandbox_id)
        raise
