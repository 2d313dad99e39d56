"""One sandbox = one task with its own scope, owning everything the sandbox holds.

``run_sandbox`` is started in the sandbox registry's nursery (``registry.py``). Until it reports
ready it builds the sandbox up (network slot, disk image over the snapshot's
layers with a fresh upper, NBD server, VMM restored from the snapshot, envd
``/init``); then it waits until the sandbox is asked to stop (kill, pause) or
its VMM dies. Whatever ends it, it tears everything down in reverse order in
shielded cleanup and writes the final state with its event, so after a kill
no process, socket, namespace or upper file is left and the database says
why.

Operations on a live sandbox (pause, snapshot, fork) borrow its VM and image
through the handle under ``op_lock``; the task keeps owning them.

With a data plane (``node.data_plane``) the disk is served there and the VMM is its child, so both outlive
this process; ``adopt`` then takes over a sandbox a previous run of the node left running (``Adoption``,
found by the reconciler): the same task, entered at the point where the sandbox runs.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Awaitable, Callable, Optional

import trio
from sqlalchemy.orm import Session

from ..config import LogsSection
from ..dataplane import DataPlaneClient, vmm_key
from ..faults import crash_point
from ..net import EgressPolicy, Slot, SlotPool
from ..snapshot.envd import init_envd, thaw_guest
from ..snapshot.machine import Machine, attach_machine, open_machine
from ..snapshot.source import SnapshotSource
from ..state import Database, Sandbox, SandboxState
from ..state import repository as repo
from ..storage import LayerRef, LayerSourceProvider, LiveDisk, open_image
from ..storage.frontends import DiskFrontend
from ..vmm import Vm, VmmDriver, VmmExited, VmState
from .console_log import ConsoleLog

__all__ = ["Adoption", "SandboxSpec", "SandboxHandle", "run_sandbox"]

log = logging.getLogger(__name__)

S = SandboxState


@dataclass(frozen=True)
class SandboxSpec:
    """Everything needed to bring one sandbox up from a snapshot."""

    sandbox_id: str
    source: SnapshotSource
    env_vars: dict[str, str]
    access_token: Optional[str]
    previous_token: Optional[str]
    default_user: str
    default_workdir: Optional[str]
    policy: EgressPolicy
    workdir: Path
    run_dir: Path
    operation: str = "create"  # create | resume | fork
    traffic_token: Optional[str] = None


@dataclass(frozen=True)
class Adoption:
    """A sandbox a previous run of the node left running in the data plane, to be taken over (the reconciler
    found its VMM by the pid it recorded, alive and the data plane's child, and its disk open there)."""

    vmm_pid: int
    slot: Slot
    #: the state its row was left in (running, or a capture the restart cut: the VM may be stopped and its
    #: filesystem frozen)
    left_in: SandboxState
    #: its disk in the data plane: where it is served, and its stack (an upper a cut capture froze sealed)
    disk_source: str
    layers: tuple[LayerRef, ...]
    #: the snapshot it was restored from (its VMM maps that snapshot's memory image)
    snapshot_id: str


@dataclass
class SandboxHandle:
    """The live part of a sandbox that other tasks may touch (``snapshot.operations.LiveSandbox``)."""

    sandbox_id: str
    address: str
    access_token: Optional[str]
    slot_index: int
    vmm_pid: int
    source: SnapshotSource
    vm: Vm
    image: LiveDisk
    slot: Slot
    traffic_token: Optional[str] = None
    env_vars: dict[str, str] = field(default_factory=dict)
    #: its egress policy as its slot has it now (the node's DNS forwarder and egress proxy read it)
    policy: EgressPolicy = field(default_factory=EgressPolicy)
    #: when it started running (``time.monotonic()``): right after a restore the guest's network may need
    #: a moment before a port accepts connections
    started_at: float = field(default_factory=time.monotonic)
    op_lock: trio.Lock = field(default_factory=trio.Lock)
    stop_requested: trio.Event = field(default_factory=trio.Event)
    done: trio.Event = field(default_factory=trio.Event)
    stop_reason: str = "kill"
    #: Set by a pause: the snapshot the sandbox is paused in.
    paused_snapshot_id: Optional[str] = None
    #: True while a pause runs (from its PAUSING transition until the VMM is gone or runs again): traffic waits
    pausing: bool = False
    #: the node stops and leaves this sandbox running in the data plane for its next run (``detach``)
    detached: bool = False
    #: its row as the transaction that made it running left it (what the create that started it answers)
    record: Optional[Sandbox] = None

    def request_stop(self, reason: str = "kill") -> None:
        if not self.stop_requested.is_set():
            self.stop_reason = reason
            self.stop_requested.set()

    def detach(self) -> None:
        """Keep the sandbox running when the node stops: its VMM and its disk live in the data plane, and the
        node's next run takes it over. Its task then ends without killing, closing or recording anything."""
        self.detached = True
        self.vm.detach()


async def run_sandbox(
    spec: SandboxSpec,
    *,
    db: Database,
    driver: VmmDriver,
    frontend: DiskFrontend,
    pool: SlotPool,
    live: dict[str, SandboxHandle],
    cache: Optional[LayerSourceProvider] = None,
    logs: LogsSection,
    dataplane: Optional[DataPlaneClient] = None,
    adopt: Optional[Adoption] = None,
    task_status: trio.TaskStatus[SandboxHandle] = trio.TASK_STATUS_IGNORED,
) -> None:
    sid = spec.sandbox_id
    src = spec.source
    t0 = time.monotonic()
    handle: SandboxHandle | None = None
    error: str | None = None
    vm_exit: int | None = None
    try:
        async with contextlib.AsyncExitStack() as stack:
            def unless_detached(fn: Callable[..., Awaitable[object]], *args: object) -> Callable[[], Awaitable[None]]:
                async def cleanup() -> None:
                    if handle is None or not handle.detached:
                        await _shielded(fn, *args)
                return cleanup

            # the slot and the disk are given back together once the VMM is gone (neither waits for the other)
            releases: list[Callable[[], Awaitable[None]]] = []
            stack.push_async_callback(_all_at_once, releases)
            slot = adopt.slot if adopt is not None else await pool.acquire(spec.policy)
            releases.append(unless_detached(pool.release, slot))
            image: LiveDisk
            if adopt is not None:
                assert dataplane is not None
                remote = dataplane.attach_disk(sid, adopt.disk_source, adopt.layers)
                image = remote
                releases.append(unless_detached(remote.aclose))
                src.disk_layers = list(adopt.layers)
                m = await stack.enter_async_context(attach_machine(
                    driver, src.shape, disk_source=remote.source, slot=slot, workdir=spec.workdir,
                    run_dir=spec.run_dir, restored_from=src.files, proc=dataplane.adopt(adopt.vmm_pid),
                    name=vmm_key(sid)))
                await _take_over(m, adopt, spec)
                t_restored = time.monotonic()
            else:
                if dataplane is None:
                    local = await trio.to_thread.run_sync(open_image, src.disk_layers, spec.workdir / "upper", cache)
                    image = local
                    releases.append(functools.partial(_shielded, trio.to_thread.run_sync, local.close))
                    disk_args: dict[str, object] = {"disk": local}
                else:
                    remote = await dataplane.open_disk(sid, src.disk_layers, spec.workdir / "upper", spec.run_dir)
                    image = remote
                    releases.append(unless_detached(remote.aclose))
                    disk_args = {"disk_source": remote.source}
                m = await stack.enter_async_context(open_machine(
                    driver, src.shape, slot=slot, workdir=spec.workdir, run_dir=spec.run_dir, snapshot=src.files,
                    name=vmm_key(sid), frontend=frontend, **disk_args))  # type: ignore[arg-type]
                t_restored = time.monotonic()
                crash_point("launch.vmm_started", vmm_pid=m.vm.pid)
                if src.guest_agent:  # (a guest without envd runs once its VMM does)
                    await _init_or_exit(m.vm, slot.address, spec)
                crash_point("launch.envd_ready", vmm_pid=m.vm.pid)
            duration_ms = (time.monotonic() - t0) * 1000
            handle = SandboxHandle(
                sid, slot.address, spec.access_token, slot.index, m.vm.pid, source=src.copy(),
                vm=m.vm, image=image, slot=slot, env_vars=dict(spec.env_vars),
                traffic_token=spec.traffic_token, policy=spec.policy)
            started = handle

            def ready(s: Session) -> Sandbox:
                repo.claim_slot(s, slot.index, sid)
                detail: dict[str, object] = {"restore_ms": round((t_restored - t0) * 1000, 1)}
                if adopt is not None:
                    detail = {"reason": "taken over after a restart of the node", "left_in": adopt.left_in.value}
                repo.transition(s, sid, S.RUNNING, operation=spec.operation, duration_ms=duration_ms,
                                vmm_pid=m.vm.pid, slot_index=slot.index, workdir=str(spec.workdir),
                                snapshot_id=src.snapshot_id, detail=detail)
                return repo.get_sandbox(s, sid)

            handle.record = await db.run(ready)
            live[sid] = handle
            task_status.started(handle)
            async with trio.open_nursery() as watch:
                async def vmm_watch() -> None:
                    nonlocal vm_exit
                    vm_exit = await m.vm.wait()
                    if started.pausing:
                        # the pause keeps the disk open for its seal and ends the run itself if its
                        # capture was whole before the VMM died; if it failed, the run ends here
                        log.warning("sandbox %s: its VMM exited (status %s) during its pause", sid, vm_exit)
                        async with started.op_lock:
                            pass
                    started.request_stop("vmm_exit")

                watch.start_soon(vmm_watch)
                # the console into the sandbox's logs, read to its end when the watch is cancelled
                watch.start_soon(ConsoleLog(db, sid, m.config.console_path, logs, vmm_pid=m.vm.pid,
                                            taken_over=adopt is not None).run)
                await handle.stop_requested.wait()
                watch.cancel_scope.cancel()
            if handle.stop_reason == "vmm_exit":
                error = f"the VMM exited unexpectedly (status {vm_exit}); see {spec.workdir}/console.log"
                disk_error = await dataplane.disk_error(sid) if dataplane is not None else None
                if disk_error is not None:  # the data plane killed it: its disk's server failed
                    error = disk_error
                log.warning("sandbox %s failed: %s", sid, error)
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
            # a detached sandbox runs on in the data plane: nothing of it is removed or recorded as ended
            if handle is None or not handle.detached:
                # keep the console log of a sandbox that failed; remove everything of one that ended (in a
                # thread: unlinking its files blocked the loop every other sandbox runs in for milliseconds)
                await trio.to_thread.run_sync(_remove_dirs, spec.workdir if error is None else spec.workdir / "upper",
                                              spec.run_dir)
                reason = handle.stop_reason if handle is not None else spec.operation
                paused_in = handle.paused_snapshot_id if handle is not None else None

                def final(s: Session) -> None:
                    repo.release_slot_of(s, sid)
                    state = repo.state_of(s, sid)
                    if state is None:
                        return
                    _record_end(s, sid, state, reason=reason, error=error, paused_in=paused_in,
                                operation=spec.operation)

                try:
                    await db.run(final)
                except Exception:
                    log.exception("recording the end of sandbox %s failed", sid)
            if handle is not None:
                handle.done.set()


def _remove_dirs(*dirs: Path) -> None:
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)


async def _shielded(fn: Callable[..., Awaitable[object]], *args: object) -> None:
    with trio.CancelScope(shield=True):
        await fn(*args)


async def _all_at_once(releases: list[Callable[[], Awaitable[None]]]) -> None:
    """Run each release (each shields itself) concurrently, and every one of them whatever another raises."""
    with trio.CancelScope(shield=True):
        async with trio.open_nursery() as nursery:
            for release in releases:
                nursery.start_soon(release)


async def _take_over(m: Machine, adopt: Adoption, spec: SandboxSpec) -> None:
    """A taken-over VM runs again: a capture the restart cut may have left its vCPUs stopped and (a pause's
    quiesce) its filesystem frozen."""
    if m.vm.state is VmState.PAUSED:
        await m.vm.resume()
    if adopt.left_in == S.PAUSING and spec.source.guest_agent:
        await thaw_guest(m.slot.address, access_token=spec.access_token, sandbox_id=spec.sandbox_id)


async def _init_or_exit(vm: Vm, address: str, spec: SandboxSpec) -> None:
    """envd's ``/init``, unless the VMM exits first: then ``VmmExited`` says so at once (instead of envd's
    retries running out against a guest that is gone)."""
    exit_status: int | None = None
    failure: Exception | None = None
    async with trio.open_nursery() as nursery:
        async def watch() -> None:
            nonlocal exit_status
            exit_status = await vm.wait()
            nursery.cancel_scope.cancel()

        nursery.start_soon(watch)
        try:
            await init_envd(address, env_vars=spec.env_vars, access_token=spec.access_token,
                            previous_token=spec.previous_token, default_user=spec.default_user,
                            default_workdir=spec.default_workdir)
        except Exception as exc:  # raised below, unwrapped: the caller maps it to its answer
            failure = exc
        nursery.cancel_scope.cancel()
    if exit_status is not None:
        raise VmmExited(f"the VMM exited (status {exit_status}) before envd answered /init; see "
                        f"{spec.workdir}/console.log") from failure
    if failure is not None:
        raise failure


def _record_end(s: Session, sid: str, current: SandboxState, *, reason: str, error: Optional[str],
                paused_in: Optional[str], operation: str) -> None:
    """The final, truthful state of a sandbox whose task ended."""
    if current == S.PAUSING and paused_in is not None:
        repo.transition(s, sid, S.PAUSED, operation="pause", snapshot_id=paused_in, vmm_pid=None, slot_index=None)
        return
    if current == S.ERROR and reason in ("error", "vmm_exit"):
        # a failed capture found the VMM gone and recorded why (snapshot/operations.py): it stays in error
        repo.update_sandbox(s, sid, operation=operation, vmm_pid=None, slot_index=None)
        return
    if current == S.RESUMING:
        # the paused snapshot is intact: the sandbox is still paused
        repo.transition(s, sid, S.PAUSED, operation="resume", error=error, vmm_pid=None, slot_index=None)
        return
    if error is not None and current in (S.CREATING, S.RUNNING, S.PAUSING, S.SNAPSHOTTING, S.FORKING):
        repo.transition(s, sid, S.ERROR, operation=reason if current != S.CREATING else operation,
                        error=error, vmm_pid=None, slot_index=None)
        return
    if current in (S.RUNNING, S.CREATING, S.ERROR, S.PAUSING, S.SNAPSHOTTING, S.FORKING):
        repo.transition(s, sid, S.KILLING, operation=reason)
        current = S.KILLING
    if current == S.KILLING:
        repo.transition(s, sid, S.KILLED, operation=reason, error=error, vmm_pid=None, slot_index=None)


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
