"""One sandbox = one task with its own scope, owning everything the sandbox holds.

``run_sandbox`` is started in the sandbox manager's nursery. Until it reports
ready it builds the sandbox up (network slot, disk image over the snapshot's
layers with a fresh upper, NBD server, VMM restored from the snapshot, envd
``/init``); then it waits until the sandbox is asked to stop (kill, pause) or
its VMM dies. Whatever ends it, it tears everything down in reverse order in
shielded cleanup and writes the final state with its event, so after a kill
no process, socket, namespace or upper file is left and the database says
why.

Operations on a live sandbox (pause, snapshot, fork) borrow its VM and image
through the handle under ``op_lock``; the task keeps owning them.
"""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import trio

from ..net import EgressPolicy, SlotPool
from ..snapshot.capture import SnapshotSource
from ..snapshot.envd import init_envd
from ..snapshot.machine import open_machine
from ..state import Database, SandboxState
from ..state import repository as repo
from ..storage.image import Image
from ..vmm import SnapshotFiles, SnapshotFormat, VmmDriver

__all__ = ["SandboxSpec", "SandboxHandle", "run_sandbox"]

log = logging.getLogger(__name__)

S = SandboxState


@dataclass(frozen=True)
class SandboxSpec:
    """Everything needed to bring one sandbox up from a snapshot."""

    sandbox_id: str
    source: SnapshotSource
    vmstate: Path
    snapshot_format: str
    env_vars: dict[str, str]
    access_token: Optional[str]
    previous_token: Optional[str]
    default_user: str
    policy: EgressPolicy
    workdir: Path
    run_dir: Path
    operation: str = "create"  # create | resume | fork


@dataclass
class SandboxHandle:
    """The live part of a sandbox that other tasks may touch."""

    sandbox_id: str
    address: str
    access_token: Optional[str]
    slot_index: int
    vmm_pid: int
    source: SnapshotSource
    vm: Any = None
    image: Any = None
    slot: Any = None
    traffic_token: Optional[str] = None
    env_vars: dict[str, str] = field(default_factory=dict)
    op_lock: trio.Lock = field(default_factory=trio.Lock)
    stop_requested: trio.Event = field(default_factory=trio.Event)
    done: trio.Event = field(default_factory=trio.Event)
    stop_reason: str = "kill"
    #: Set by a pause: the snapshot the sandbox is paused in.
    paused_snapshot_id: Optional[str] = None

    def request_stop(self, reason: str = "kill") -> None:
        if not self.stop_requested.is_set():
            self.stop_reason = reason
            self.stop_requested.set()


async def run_sandbox(
    spec: SandboxSpec,
    *,
    db: Database,
    driver: VmmDriver,
    pool: SlotPool,
    live: dict[str, SandboxHandle],
    cache: Any = None,
    task_status: trio.TaskStatus[SandboxHandle] = trio.TASK_STATUS_IGNORED,
) -> None:
    sid = spec.sandbox_id
    src = spec.source
    t0 = time.monotonic()
    handle: SandboxHandle | None = None
    error: str | None = None
    vm_exit: int | None = None
    try:
        slot = await pool.acquire(spec.policy)
        try:
            image = await trio.to_thread.run_sync(
                lambda: open_disk(src.disk_layers, spec.workdir / "upper", cache))
            try:
                snapshot = SnapshotFiles(spec.vmstate, src.memory, SnapshotFormat(spec.snapshot_format))
                async with open_machine(driver, src.shape, disk=image, slot=slot, workdir=spec.workdir,
                                        run_dir=spec.run_dir, snapshot=snapshot,
                                        name=f"aenv-{sid}") as m:
                    t_restored = time.monotonic()
                    await init_envd(slot.address, env_vars=spec.env_vars,
                                    access_token=spec.access_token,
                                    previous_token=spec.previous_token,
                                    default_user=spec.default_user)
                    duration_ms = (time.monotonic() - t0) * 1000
                    handle = SandboxHandle(
                        sid, slot.address, spec.access_token, slot.index, m.vm.pid,
                        source=SnapshotSource(
                            snapshot_id=src.snapshot_id, memory=src.memory,
                            memory_layers=list(src.memory_layers), memory_base=src.memory_base,
                            shape=src.shape, template_id=src.template_id,
                            disk_layers=list(src.disk_layers)),
                        vm=m.vm, image=image, slot=slot, env_vars=dict(spec.env_vars))

                    def ready(s) -> None:  # type: ignore[no-untyped-def]
                        repo.claim_slot(s, slot.index, sid)
                        repo.transition(s, sid, S.RUNNING, operation=spec.operation,
                                        duration_ms=duration_ms, vmm_pid=m.vm.pid,
                                        slot_index=slot.index, workdir=str(spec.workdir),
                                        snapshot_id=src.snapshot_id,
                                        detail={"restore_ms": round((t_restored - t0) * 1000, 1)})

                    await db.run(ready)
                    live[sid] = handle
                    task_status.started(handle)
                    async with trio.open_nursery() as watch:
                        async def vmm_watch() -> None:
                            nonlocal vm_exit
                            vm_exit = await m.vm.wait()
                            handle.request_stop("vmm_exit")

                        watch.start_soon(vmm_watch)
                        await handle.stop_requested.wait()
                        watch.cancel_scope.cancel()
                    if handle.stop_reason == "vmm_exit":
                        error = f"the VMM exited unexpectedly (status {vm_exit}); see {spec.workdir}/console.log"
            finally:
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(image.close)
        finally:
            with trio.CancelScope(shield=True):
                await pool.release(slot)
    except BaseException as exc:
        if _only_cancelled(exc):
            if handle is not None and not handle.stop_requested.is_set():
                handle.stop_reason = "node_shutdown"
            raise
        error = _describe(exc)
        log.warning("sandbox %s failed: %s", sid, error)
        if handle is None:
            raise  # not started yet: the caller of nursery.start gets the error
        # started: the error is this sandbox's alone (recorded below); it must not take down the
        # manager's nursery and with it every other sandbox
    finally:
        with trio.CancelScope(shield=True):
            live.pop(sid, None)
            # keep the console log of a sandbox that failed; remove everything of one that ended
            shutil.rmtree(spec.workdir if error is None else spec.workdir / "upper", ignore_errors=True)
            shutil.rmtree(spec.run_dir, ignore_errors=True)
            reason = handle.stop_reason if handle is not None else spec.operation
            paused_in = handle.paused_snapshot_id if handle is not None else None

            def final(s) -> None:  # type: ignore[no-untyped-def]
                repo.release_slot_of(s, sid)
                sb = s.get(repo.Sandbox, sid)
                if sb is None:
                    return
                _record_end(s, sb, S(sb.state), reason=reason, error=error, paused_in=paused_in,
                            operation=spec.operation)

            try:
                await db.run(final)
            except Exception:
                log.exception("recording the end of sandbox %s failed", sid)
            if handle is not None:
                handle.done.set()


def open_disk(layers: list[Any], upper_dir: Path, cache: Any) -> Image:
    """The sandbox's disk: its snapshot's layers (local files, or ``repo:<digest>`` read on demand
    through the layer cache) with a fresh writable upper."""
    if not any(isinstance(l, str) for l in layers):
        return Image.open(layers, upper_dir)
    from ..storage.layer import LayerReader
    from ..storage.upper import Upper

    readers: list[Any] = []
    try:
        for l in layers:
            if isinstance(l, str):
                digest = l.split(":", 1)[1] if l.startswith("repo:") else l
                readers.append(LayerReader(cache.source(digest), digest=digest.split(":", 1)[1]))
            else:
                readers.append(LayerReader.open(l))
        size = readers[-1].virtual_size
        return Image(readers, Upper(upper_dir, size), size=size, own_layers=True)
    except BaseException:
        for r in readers:
            r.close()
        raise


def _record_end(s: Any, sb: Any, current: SandboxState, *, reason: str, error: Optional[str],
                paused_in: Optional[str], operation: str) -> None:
    """The final, truthful state of a sandbox whose task ended."""
    sid = sb.id
    gone = {"vmm_pid": None, "slot_index": None}
    if current == S.PAUSING and paused_in is not None:
        repo.transition(s, sid, S.PAUSED, operation="pause", snapshot_id=paused_in, **gone)
        return
    if current == S.RESUMING:
        # the paused snapshot is intact: the sandbox is still paused
        repo.transition(s, sid, S.PAUSED, operation="resume", error=error, **gone)
        return
    if error is not None and current in (S.CREATING, S.RUNNING, S.PAUSING, S.SNAPSHOTTING, S.FORKING):
        repo.transition(s, sid, S.ERROR, operation=reason if current != S.CREATING else operation,
                        error=error, **gone)
        return
    if current in (S.RUNNING, S.CREATING, S.ERROR, S.PAUSING, S.SNAPSHOTTING, S.FORKING):
        repo.transition(s, sid, S.KILLING, operation=reason)
        current = S.KILLING
    if current == S.KILLING:
        repo.transition(s, sid, S.KILLED, operation=reason, error=error, **gone)


def _only_cancelled(exc: BaseException) -> bool:
    """True for a trio.Cancelled, or an exception group holding nothing else."""
    if isinstance(exc, BaseExceptionGroup):
        return all(_only_cancelled(e) for e in exc.exceptions)
    return isinstance(exc, trio.Cancelled)


def _describe(exc: BaseException) -> str:
    """The first real error inside (possibly nested) exception groups, as one line."""
    while isinstance(exc, BaseExceptionGroup):
        inner = [e for e in exc.exceptions if not _only_cancelled(e)]
        exc = inner[0] if inner else exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}"
