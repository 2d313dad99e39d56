"""Capturing a running sandbox into an incremental snapshot (pause, snapshot, fork).

A sandbox always runs restored from a snapshot whose memory image it maps
copy-on-write, so a capture only has to save what changed since that restore:

1. the VMM pauses the vCPUs and writes the device state, and copies the guest
   pages dirtied since the restore (QEMU: the pagemap method; Firecracker: a
   Diff snapshot) into a pre-faulted capture buffer lent by the node (a
   memcpy: ~65 ms for 300 MiB here), or, when none is free or they do not
   fit, into a sparse diff file;
2. the disk's writable upper is frozen (`Image.freeze`: writes go to a fresh
   upper from here on; no data is read or synced);
3. the VM resumes at once when it keeps running (snapshot, fork), so the
   guest-visible pause is steps 1-2 only; the rest happens while it runs:
   the frozen upper is sealed into a disk layer (checksums, digest, fsync;
   no data copy) and
4. the dirty pages become a **memory layer** (zeroed pages recorded as zeroed
   extents, so they shadow the base) and the snapshot's own flat memory image
   is materialized: the source image copied (reflinked where the filesystem
   can) with the dirty ranges patched in. Every sandbox later restored from
   this snapshot maps that one file, so they share its page cache. A user or
   periodic snapshot may leave that image for later (``defer_flat_image``):
   nothing restores from it yet, its memory layer holds the pages, and the
   copy (a second of a loaded disk for 512 MiB on ext4) is the largest part
   of the persist; the first restore materializes it (``SnapshotStore.load``);
5. one transaction records the layers, the snapshot (parent = the snapshot the
   sandbox was restored from, so the lineage shows what each memory layer is a
   diff against) and its layer stack.

Until that transaction commits nothing refers to the new files; a failure
removes them, and the caller puts the sandbox back into a truthful state.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import trio

from sqlalchemy.orm import Session

from ..faults import crash_point
from ..state import (
    Database,
    EventSubject,
    LayerKind,
    Snapshot,
    SnapshotConfig,
    SnapshotKind,
    SnapshotStatus,
    new_id,
    utcnow,
)
from ..state.repository import record_event
from ..storage import LayerInfo, LayerRef, LayerWriter, LiveDisk
from ..vmm import CaptureKind, CaptureResult, Vm, VmState, memfile
from ..vmm.capture_buffer import CaptureBuffer, CaptureBufferPool
from .errors import StateDiskFull
from .layers import layer_digest, record_stack, reference_layer
from .source import SnapshotSource

__all__ = ["CaptureOutcome", "capture_running"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CaptureOutcome:
    snapshot_id: str
    vmstate: Path
    memory: Path
    disk_layers: tuple[LayerRef, ...]
    dirty_bytes: int
    paused_ms: float  # how long the guest's vCPUs were stopped
    total_ms: float
    #: the next capture of this VM will hold only pages dirtied after this one (``CaptureResult``): the
    #: sandbox must then use this snapshot as its memory source
    rebase: bool = False
    #: the flat memory image was left for later (``defer_flat_image``): ``SnapshotStore.load`` makes it
    memory_deferred: bool = False


def _write_memory_layer(cap: CaptureResult, layers_dir: Path) -> LayerInfo:
    """The dirty pages as a memory layer, from the capture buffer or the sparse diff file."""
    with LayerWriter(layers_dir, cap.mem_size, zero_blocks="zeroed") as w:
        if cap.buffer is not None:
            data, pos = cap.buffer.view, 0
            for r in cap.dirty_ranges:
                for off in range(0, r.length, 4 << 20):
                    n = min(4 << 20, r.length - off)
                    w.add_data(r.offset + off, data[pos + off : pos + off + n])
                pos += r.length
            return w.finish()
        fd = os.open(cap.memory, os.O_RDONLY)
        try:
            for r in cap.dirty_ranges:
                pos = r.offset
                while pos < r.end:
                    n = min(4 << 20, r.end - pos)
                    w.add_data(pos, os.pread(fd, n, pos))
                    pos += n
            return w.finish()
        finally:
            os.close(fd)


@asynccontextmanager
async def _borrow(buffers: Optional[CaptureBufferPool]) -> AsyncIterator[Optional[CaptureBuffer]]:
    if buffers is None:
        yield None
    else:
        async with buffers.borrow() as buf:
            yield buf


async def capture_running(
    *,
    db: Database,
    vm: Vm,
    image: LiveDisk,
    sandbox_id: str,
    source: SnapshotSource,
    kind: SnapshotKind,
    keep_running: bool,
    layers_dir: Path,
    snapshots_dir: Path,
    access_token: Optional[str],
    env_vars: dict[str, str],
    name: Optional[str] = None,
    buffers: Optional[CaptureBufferPool] = None,
    take_source_memory: bool = False,
    also_commit: Optional[Callable[[Session, str], None]] = None,
    on_held: Optional[Callable[[CaptureResult], None]] = None,
    detail: Optional[dict[str, Any]] = None,
    defer_flat_image: bool = False,
) -> CaptureOutcome:
    """Capture `vm` into a new snapshot (see the module docstring); returns when it is committed.

    `take_source_memory`: the source snapshot's flat memory image is this sandbox's alone and superseded
    by this capture (a pause of a sandbox resumed from its own previous pause, nothing else restored from
    it): instead of copying it, move it into the new snapshot and patch the dirty pages in place. The VM
    does not notice: every page patched is one it holds a private copy of. Moved back if the capture
    fails.

    `also_commit(session, snapshot_id)`: more rows committed in the snapshot's own transaction (a user
    snapshot's template: a snapshot is never committed without what makes it visible).

    `on_held(capture)`: called once the guest-visible part is done (its memory captured, the disk's upper
    frozen, the VM running again if it keeps running) and before anything is persisted: a pause may answer
    there (snapshot/operations.py). `detail`: more keys for the commit event (a pause's quiesce time).

    `defer_flat_image`: commit without the snapshot's flat memory image (step 4), to be made from its memory
    layers when something restores from it. Only where the VM goes on from its restore (the next capture's
    diff does not start at this one) and the source's image is not being taken over."""
    t0 = time.monotonic()
    snapshot_id = new_id("snp_")
    snap_dir = snapshots_dir / snapshot_id
    snap_dir.mkdir(parents=True, exist_ok=True)
    diff = snap_dir / "memory.diff"
    resumed = False
    try:
        steps: dict[str, float] = {}
        async with _borrow(buffers) as buf:
            tp = time.monotonic()  # the vCPUs stop in capture()
            cap = await vm.capture(snap_dir / "vmstate", diff, kind=CaptureKind.DIFF, buffer=buf)
            steps["capture_ms"] = (time.monotonic() - tp) * 1000
            crash_point("capture.captured", vmm_pid=vm.pid)
            frozen = await trio.to_thread.run_sync(image.freeze)
            crash_point("capture.frozen", vmm_pid=vm.pid)
            if keep_running:
                await vm.resume()
                resumed = True
            paused_ms = (time.monotonic() - tp) * 1000
            steps["freeze_ms"] = paused_ms - steps["capture_ms"]
            if on_held is not None:
                on_held(cap)
            # Three independent jobs, run at once (hashing and writing release the GIL): seal the disk
            # layer, write the memory layer, build the flat memory image.
            done: dict[str, Any] = {}

            async def timed(name: str, fn: Any, *args: Any) -> None:
                t = time.monotonic()
                done[name] = await trio.to_thread.run_sync(fn, *args)
                steps[f"{name}_ms"] = (time.monotonic() - t) * 1000

            def flat_image() -> None:
                if cap.buffer is not None:
                    memfile.materialize_packed(source.memory, cap.dirty_ranges, cap.buffer.view[: cap.dirty_bytes],
                                               snap_dir / "memory", in_place=take_source_memory)
                else:
                    memfile.materialize(source.memory, [(diff, cap.dirty_ranges)], snap_dir / "memory",
                                        in_place=take_source_memory)

            deferred = defer_flat_image and cap.since_restore and not take_source_memory
            t1 = time.monotonic()
            async with trio.open_nursery() as jobs:
                jobs.start_soon(timed, "seal", image.seal_frozen, frozen, layers_dir)
                jobs.start_soon(timed, "memory_layer", _write_memory_layer, cap, layers_dir)
                if not deferred:
                    jobs.start_soon(timed, "flat_image", flat_image)
            steps["persist_ms"] = (time.monotonic() - t1) * 1000
            sealed, mem_layer = done["seal"], done["memory_layer"]
            diff.unlink(missing_ok=True)
            crash_point("capture.sealed", vmm_pid=vm.pid)
        disk_layers = tuple(source.disk_layers) + (LayerRef.local(sealed.path, layer_digest(sealed)),)
        memory_layers = source.memory_layers + [layer_digest(mem_layer)]

        def commit(s: Session) -> None:
            reference_layer(s, sealed, LayerKind.DISK)
            reference_layer(s, mem_layer, LayerKind.MEMORY)
            s.add(Snapshot(
                id=snapshot_id, kind=kind, status=SnapshotStatus.COMMITTED, name=name,
                parent_id=source.snapshot_id, source_sandbox_id=sandbox_id,
                template_id=source.template_id, vmm=cap.vmm,
                vmstate_location=str(cap.vmstate), vmstate_format=cap.format.value,
                memory_location=str(snap_dir / "memory"), memory_base_location=source.memory_base or None,
                memory_from_layers=deferred,
                dirty_bytes=cap.dirty_bytes,
                config=SnapshotConfig(shape=source.shape, access_token=access_token, env_vars=env_vars,
                                      default_user=source.default_user,
                                      default_workdir=source.default_workdir, guest_agent=source.guest_agent),
                memory_mb=source.shape.mem_mib, committed_at=utcnow(),
            ))
            s.flush()
            record_stack(s, snapshot_id, disk_layers, memory_layers)
            if also_commit is not None:
                also_commit(s, snapshot_id)
            record_event(s, "snapshot_commit", sandbox_id=sandbox_id, subject=EventSubject.SNAPSHOT,
                         subject_id=snapshot_id, to_state=SnapshotStatus.COMMITTED,
                         duration_ms=(time.monotonic() - t0) * 1000,
                         detail={"kind": kind.value, "dirty_bytes": cap.dirty_bytes,
                                 "paused_ms": round(paused_ms, 1), "parent_id": source.snapshot_id,
                                 "memory_deferred": deferred,
                                 **{k: round(v, 1) for k, v in steps.items()}, **(detail or {})})

        await db.run(commit)
        return CaptureOutcome(snapshot_id, cap.vmstate, snap_dir / "memory", disk_layers, cap.dirty_bytes,
                              paused_ms, (time.monotonic() - t0) * 1000, rebase=not cap.since_restore,
                              memory_deferred=deferred)
    except BaseException as exc:
        with trio.CancelScope(shield=True):
            if take_source_memory and not source.memory.exists() and (snap_dir / "memory").exists():
                # give the source its image back (any page patched is one the VM holds privately)
                os.rename(snap_dir / "memory", source.memory)
            shutil.rmtree(snap_dir, ignore_errors=True)
            if keep_running and not resumed and vm.state is VmState.PAUSED:
                try:
                    await vm.resume()
                except Exception:
                    log.exception("resuming %s after a failed capture failed", sandbox_id)
        full = _no_space(exc)
        if full is not None:
            raise StateDiskFull(f"the node's state disk is full: {full.strerror} writing "
                                f"{full.filename or layers_dir}; the capture was not kept") from exc
        raise


def _no_space(exc: BaseException) -> OSError | None:
    """The ENOSPC (or EDQUOT) error inside ``exc`` (possibly in exception groups), if any."""
    if isinstance(exc, BaseExceptionGroup):
        return next((e for e in map(_no_space, exc.exceptions) if e is not None), None)
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return exc
    return None
