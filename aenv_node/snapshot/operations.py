"""Pause, snapshot, fork and resume: the operations that capture a running sandbox or restore one.

Each operation is a sequence of recorded transitions around a capture
(``capture.py``) or a restore: pause = capture, stop the VMM, then publish and
compact in the background; snapshot and periodic snapshots = capture and keep
running; fork = one capture of the parent, then N restores; resume = claim the
sandbox in the repository (one writer across nodes), load its pause snapshot
and restore it. A failed capture leaves the sandbox truthful (running again if
the VM runs, else ``error``); a failed restore hands the claim back.

Starting and stopping sandbox tasks is the runtime's (each sandbox is a task in
its nursery): operations reach them through the ``Launcher`` protocol and the
``LiveSandbox`` handles it returns, so this layer never imports the runtime.
Admission (the node's in-flight operation tracker, draining on shutdown) is the
runtime's too; the per-sandbox ``op_lock`` and the garbage collector's pins are
taken here, in that order.

Work that follows a pause (publish to the repository, then compaction) runs in
this object's own nursery (``run``, a service of the node), fed by a queue, so
the pause returns first and nothing runs unowned. With a data plane a pause
answers as soon as the guest is captured, and persists in that nursery too
(``pause``).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import math
import secrets
import shutil
import time
from dataclasses import dataclass
from typing import Callable, Optional, Protocol

import trio
from sqlalchemy.orm import Session

from ..faults import crash_point
from ..net import EgressPolicy, Slot
from ..state import (
    Database,
    EventSubject,
    Sandbox,
    SandboxState,
    SnapshotKind,
    Template,
    BuildStatus,
    TemplateKind,
    utcnow,
)
from ..state import repository as repo
from ..storage import LiveDisk
from ..storage.repository import Repository
from ..storage.repository.errors import OwnershipConflict
from ..vmm import CaptureResult, Vm
from ..vmm.capture_buffer import CaptureBufferPool
from .capture import CaptureOutcome, capture_running
from .compaction import compact_snapshot
from .envd import quiesce_guest, thaw_guest
from .errors import ForkLimit, SandboxConflict, SnapshotNotFound
from .gc import GarbageCollector
from .publish import (
    OwnerDead,
    claim_for_resume,
    publish_checkpoint,
    publish_snapshot,
    release_claim,
    retry_unsettled,
    unpublished_pauses,
)
from .source import SnapshotSource
from .store import SnapshotStore

__all__ = ["LiveSandbox", "Launch", "Launcher", "SnapshotOperations", "policy_of"]

log = logging.getLogger(__name__)

S = SandboxState


class LiveSandbox(Protocol):
    """What operations use of a running sandbox (the runtime's ``SandboxHandle``)."""

    sandbox_id: str
    address: str
    access_token: Optional[str]
    vm: Vm
    image: LiveDisk
    slot: Slot
    source: SnapshotSource
    env_vars: dict[str, str]
    op_lock: trio.Lock
    done: trio.Event
    paused_snapshot_id: Optional[str]
    pausing: bool

    def request_stop(self, reason: str = "kill") -> None: ...


@dataclass(frozen=True)
class Launch:
    """A sandbox to bring up from a snapshot (its row exists: creating, resuming)."""

    sandbox_id: str
    source: SnapshotSource
    env_vars: dict[str, str]
    access_token: Optional[str]
    previous_token: Optional[str]
    policy: EgressPolicy
    operation: str  # create | resume | fork
    #: required by the traffic proxy on every port but envd's (None: public traffic allowed)
    traffic_token: Optional[str] = None


class Launcher(Protocol):
    """The runtime's live-sandbox registry, as operations see it."""

    def get(self, sandbox_id: str) -> Optional[LiveSandbox]: ...

    async def launch(self, launch: Launch) -> LiveSandbox: ...


def policy_of(sb: Sandbox) -> EgressPolicy:
    """The egress policy a sandbox row records."""
    stored = sb.network_policy or {}
    return EgressPolicy.from_e2b(stored.get("allowOut"), stored.get("denyOut"),
                                 allow_internet_access=sb.allow_internet_access)


class SnapshotOperations:
    """Pause, snapshot, fork, resume and the background work after a pause (see the module docstring)."""

    name = "snapshot-operations"

    def __init__(self, db: Database, *, store: SnapshotStore, gc: GarbageCollector, repository: Repository,
                 buffers: CaptureBufferPool, launcher: Launcher, node_id: str, owner: str, vmm_name: str,
                 default_timeout_s: int, fork_max_count: int, compact_after_layers: int,
                 quiesce: str = "pause", publish_retry_s: float = 30.0, answer_early: bool = False) -> None:
        self.db = db
        self.store = store
        self.gc = gc
        self.repo = repository
        self.buffers = buffers
        self.launcher = launcher
        self.node_id = node_id
        self.owner = owner
        self.vmm_name = vmm_name
        self.default_timeout_s = default_timeout_s
        self.fork_max_count = fork_max_count
        self.compact_after_layers = compact_after_layers
        #: which captures freeze the guest's filesystem first: "pause" (pauses, whose sandbox stops) or "off"
        self.quiesce = quiesce
        #: held by a resume and around a publish's record update, so they never interleave
        self._resume_locks: dict[str, trio.Lock] = {}
        self._after_pause_send, self._after_pause_recv = trio.open_memory_channel[tuple[str, str]](math.inf)
        #: how often pauses whose publish failed are published again (0: only at the next start)
        self.publish_retry_s = publish_retry_s
        #: whether another node (an ownership record's owner) is dead, so that a sandbox it ran may be taken over
        #: from its checkpoint; None (a lone node): never (set by the node's cluster client when it joins one)
        self.owner_dead: Optional[OwnerDead] = None
        #: pause snapshots queued or being published (``wait_published``; the retry skips them)
        self._queued: set[str] = set()
        self._published = trio.Event()
        self._published.set()
        #: a pause answers once the guest is captured, before it is persisted (``pause``): only where the VMM
        #: outlives this process (a data plane), so that a crash before the commit can pause it again
        self.answer_early = answer_early
        #: sandboxes whose pause answered and is being persisted (``wait_persisted``)
        self._persisting: set[str] = set()
        self._persisted = trio.Event()
        self._persisted.set()
        #: the service's nursery (``run``): pauses that answered early persist there
        self._nursery: Optional[trio.Nursery] = None

    # -- background work after a pause ---------------------------------------------------------------
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The service: publish (then compact) each pause snapshot queued by ``after_pause``; the pauses that
        answered early persist in its nursery too."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                if self.publish_retry_s > 0:
                    nursery.start_soon(self._retry_failed_publishes)
                task_status.started()
                async for snapshot_id, sandbox_id in self._after_pause_recv:
                    nursery.start_soon(self._publish_then_compact, snapshot_id, sandbox_id)
        finally:
            self._nursery = None

    def after_pause(self, snapshot_id: str, sandbox_id: str) -> None:
        """Queue the publish and compaction of a pause snapshot (also for the reconciler's pauses)."""
        if snapshot_id in self._queued:
            return
        if not self._queued:
            self._published = trio.Event()
        self._queued.add(snapshot_id)
        self._after_pause_send.send_nowait((snapshot_id, sandbox_id))

    async def _retry_failed_publishes(self) -> None:
        """Every ``publish_retry_s``: queue again each pause still unpublished (its publish failed: the
        repository down, full or erroring), and delete the records ended sandboxes left in the repository
        (a kill while it was unreachable), so the repository catches up once the fault clears."""
        while True:
            await trio.sleep(self.publish_retry_s)
            try:
                for snapshot_id, sandbox_id in await self.db.run(unpublished_pauses):
                    self.after_pause(snapshot_id, sandbox_id)
                settled = await retry_unsettled(self.db, self.repo, self.owner)
                if settled:
                    log.info("removed the repository records of %d ended sandboxes: %s", len(settled), settled)
            except Exception:
                log.exception("retrying the repository's work failed; trying again in %.0f s", self.publish_retry_s)

    async def wait_published(self) -> None:
        """Until every pause queued so far is published (or its publish failed): a graceful stop waits here,
        so the repository's record of each sandbox it paused says paused. One cut short anyway is published
        again by the next start's reconcile."""
        await self._published.wait()

    async def _publish_then_compact(self, snapshot_id: str, sandbox_id: str) -> None:
        """In this order: a compaction replaces layers and the collection after it removes them, which must
        not happen under an upload of them."""
        try:
            await self._publish_quietly(snapshot_id, sandbox_id)
        finally:
            self._queued.discard(snapshot_id)
            if not self._queued:
                self._published.set()
        await self._compact_quietly(snapshot_id)

    def resume_lock(self, sandbox_id: str) -> trio.Lock:
        return self._resume_locks.setdefault(sandbox_id, trio.Lock())

    async def _publish_quietly(self, snapshot_id: str, sandbox_id: str) -> None:
        """Commit a pause snapshot to the repository (the pause has returned).

        The record goes ``paused`` (owned by this node) under the sandbox's resume lock, and only if the
        sandbox is still paused at this snapshot: a resume or a kill meanwhile wins (publish.py)."""
        try:
            summary = await publish_snapshot(self.db, self.repo, self.store.layers_dir, snapshot_id, sandbox_id,
                                             owner=self.owner, pointer_lock=self.resume_lock(sandbox_id))
            log.info("published snapshot %s of %s: %s", snapshot_id, sandbox_id, summary)
        except Exception as exc:
            def killed(s: Session) -> bool:
                sb = s.get(Sandbox, sandbox_id)
                return sb is None or sb.state in (S.KILLING, S.KILLED)

            if await self.db.run(killed):  # the kill's collection removed the files under the upload: moot
                log.info("publishing snapshot %s stopped: sandbox %s was killed meanwhile (%s)",
                         snapshot_id, sandbox_id, exc)
            else:
                log.warning("publishing snapshot %s failed (tried again in %.0f s): %s", snapshot_id,
                            self.publish_retry_s, exc)
                error = f"{type(exc).__name__}: {exc}"
                await self.db.run(lambda s: repo.record_event(
                    s, "snapshot_publish", sandbox_id=sandbox_id, subject=EventSubject.SNAPSHOT,
                    subject_id=snapshot_id, error=error))

    async def _compact_quietly(self, snapshot_id: str) -> None:
        try:
            async with self.gc.pin():  # it reads the chain's files and adds a layer
                compacted = await compact_snapshot(self.db, self.store.layers_dir, snapshot_id,
                                                   limit=self.compact_after_layers)
            if compacted:
                self.gc.request("compact")  # the layers it replaced are garbage now
        except Exception as exc:
            log.warning("compacting snapshot %s failed: %s", snapshot_id, exc)

    # -- captures ------------------------------------------------------------------------------------
    def _live_or_conflict(self, sandbox_id: str, op: str) -> LiveSandbox:
        handle = self.launcher.get(sandbox_id)
        if handle is None:
            raise SandboxConflict(f"sandbox {sandbox_id} is not running: cannot {op} it")
        return handle

    async def _capture_live(self, handle: LiveSandbox, *, kind: SnapshotKind, name: Optional[str],
                            state: SandboxState, operation: str) -> str:
        """Capture a sandbox that keeps running (snapshot, fork, periodic); the caller holds its op_lock."""
        sid = handle.sandbox_id
        await self.db.run(lambda s: repo.transition(s, sid, state, operation=operation, expect=[S.RUNNING]))
        def template_of(s: Session, snapshot_id: str) -> None:
            sb = repo.get_sandbox(s, sid)
            s.add(Template(id=snapshot_id, alias=None, kind=TemplateKind.SNAPSHOT, status=BuildStatus.READY,
                           cpu_count=sb.cpu_count, memory_mb=sb.memory_mb, disk_size_mb=sb.disk_size_mb,
                           envd_version=sb.envd_version, boot_snapshot_id=snapshot_id))

        try:
            # a fork's children restore from it at once: its flat image is made now; a user snapshot's is made
            # behind the answer (``_materialize_quietly``), a periodic one's only if a restore ever needs it
            out = await self._capture(handle, kind=kind, keep_running=True, name=name,
                                      also_commit=template_of if kind == SnapshotKind.USER else None,
                                      defer_flat_image=kind in (SnapshotKind.USER, SnapshotKind.PERIODIC))
        except BaseException as exc:
            with trio.CancelScope(shield=True):
                await self._after_failed_capture(handle, operation, exc)
            raise
        crash_point("snapshot.committed", vmm_pid=handle.vm.pid)
        handle.source.disk_layers = list(out.disk_layers)
        if out.rebase:
            # the VMM's next diff starts from this capture (Firecracker), not from the restore: lay it over
            # this snapshot's image, or the pages dirtied between the restore and now would be lost
            handle.source = await self.store.load(out.snapshot_id)

        def done(s: Session) -> None:
            repo.transition(s, sid, S.RUNNING, operation=operation, duration_ms=out.total_ms,
                            detail={"snapshot_id": out.snapshot_id, "paused_ms": round(out.paused_ms, 1),
                                    "dirty_bytes": out.dirty_bytes})

        await self.db.run(done)
        if out.memory_deferred and kind == SnapshotKind.USER and self._nursery is not None:
            self._nursery.start_soon(self._materialize_quietly, out.snapshot_id)
        return out.snapshot_id

    async def _materialize_quietly(self, snapshot_id: str) -> None:
        """A user snapshot's flat memory image, made after the snapshot answered (a create from it made
        meanwhile waits for this one, or makes it itself: ``SnapshotStore.load``)."""
        try:
            async with self.gc.pin():
                await self.store.load(snapshot_id)
        except SnapshotNotFound:
            pass  # deleted meanwhile
        except Exception as exc:  # the first restore from it tries again
            log.warning("materializing the memory image of snapshot %s failed: %s", snapshot_id, exc)

    async def _capture(self, handle: LiveSandbox, *, kind: SnapshotKind, keep_running: bool,
                       name: Optional[str] = None, take_source_memory: bool = False,
                       also_commit: Optional[Callable[[Session, str], None]] = None,
                       on_held: Optional[Callable[[CaptureResult], None]] = None,
                       detail: Optional[dict[str, float]] = None, defer_flat_image: bool = False) -> CaptureOutcome:
        return await capture_running(
            db=self.db, vm=handle.vm, image=handle.image, sandbox_id=handle.sandbox_id, source=handle.source,
            kind=kind, keep_running=keep_running, layers_dir=self.store.layers_dir,
            snapshots_dir=self.store.snapshots_dir, access_token=handle.access_token, env_vars=handle.env_vars,
            name=name, buffers=self.buffers, take_source_memory=take_source_memory, also_commit=also_commit,
            on_held=on_held, detail=detail, defer_flat_image=defer_flat_image)

    async def _after_failed_capture(self, handle: LiveSandbox, operation: str, exc: BaseException, *,
                                    thaw: bool = False) -> None:
        """Truthful state after a failed capture: running again if the VM runs (``thaw``: its filesystem thawed
        too), else error."""
        sid = handle.sandbox_id
        try:
            await handle.vm.resume()
            ok = True
        except Exception:
            ok = False
        if ok and thaw:
            await thaw_guest(handle.address, access_token=handle.access_token, sandbox_id=sid)
        message = f"{type(exc).__name__}: {exc}"
        await self.db.run(lambda s: repo.transition(s, sid, S.RUNNING if ok else S.ERROR, operation=operation,
                                                    error=message))
        if not ok:
            handle.request_stop("error")

    async def wait_out_pause(self, sandbox_id: str) -> None:
        """Return once no pause of ``sandbox_id`` is in progress (at once if none is).

        A pause holds the sandbox's ``op_lock`` from its PAUSING transition until the VMM is gone (or, after a
        failed capture, running again), so taking that lock is waiting for the outcome. Traffic and resumes
        that arrive meanwhile must not reach a guest whose vCPUs are stopped: they would time out, or be cut
        when the pause disconnects the sandbox's streams."""
        handle = self.launcher.get(sandbox_id)
        if handle is not None and handle.pausing:
            async with handle.op_lock:
                pass

    async def snapshot(self, sandbox_id: str, *, name: Optional[str] = None) -> str:
        """Snapshot a running sandbox (brief pause); the snapshot is also a template."""
        handle = self._live_or_conflict(sandbox_id, "snapshot")
        async with handle.op_lock, self.gc.pin():
            return await self._capture_live(handle, kind=SnapshotKind.USER, name=name, state=S.SNAPSHOTTING,
                                            operation="snapshot")

    async def periodic_snapshot(self, handle: LiveSandbox) -> Optional[str]:
        """A periodic snapshot of a running sandbox, retiring its older ones; None if it stopped meanwhile."""
        async with handle.op_lock, self.gc.pin():
            if handle.done.is_set():
                return None
            snap = await self._capture_live(handle, kind=SnapshotKind.PERIODIC, name=None, state=S.SNAPSHOTTING,
                                            operation="periodic_snapshot")
        sid = handle.sandbox_id
        await self.db.run(lambda s: SnapshotStore.retire_older_periodic(s, sid, keep=snap))
        self.gc.request("periodic_retire")
        if self.owner_dead is not None:
            # in a cluster, in the repository too, as the sandbox's checkpoint: another node resumes it from
            # there if this one dies (``SandboxMovedAway`` if one already did); a lone node has no one to hand
            # it to, and its own restart uses the local snapshot
            await publish_checkpoint(self.db, self.repo, self.store.layers_dir, snap, sid, owner=self.owner,
                                     pointer_lock=self.resume_lock(sid))
        return snap

    async def pause(self, sandbox_id: str, *, reason: str = "pause") -> None:
        """Capture the sandbox incrementally, stop its VMM and free its slot (E2B: 409 if paused).

        With ``answer_early`` (a data plane: the VMM outlives this process) the call returns once the guest
        is captured (its vCPUs stopped, its dirty pages in the capture buffer, its disk's upper frozen): the
        guest-visible part. Persisting the capture, the commit and the VMM's stop go on in this service's
        nursery under the sandbox's op_lock, so a resume, traffic or a kill that comes meanwhile waits for
        them (``wait_out_pause``). Nothing is lost if this process dies before the commit: the paused VMM and
        the frozen upper live on in the data plane, the row says pausing with no pause snapshot, and the next
        start takes the sandbox over and pauses it again (runtime/reconcile.py). The call answers early only
        when that holds: the capture holds every page dirtied since the restore (QEMU; Firecracker's dirty
        log restarts at each capture, so a capture again would miss pages) and the state disk has room for
        what is left to write; otherwise it returns after the commit, with the error if there is one."""
        handle = self.launcher.get(sandbox_id)
        if handle is None:
            sb = await self.db.run(lambda s: repo.get_sandbox(s, sandbox_id))
            raise SandboxConflict(f"sandbox {sandbox_id} is already {sb.state}" if sb.state == S.PAUSED else
                                  f"sandbox {sandbox_id} is {sb.state}: only a running sandbox can pause")
        if self.answer_early and self._nursery is not None:
            await self._nursery.start(self._pause, handle, reason)
        else:
            await self._pause(handle, reason)
        crash_point("pause.answered")

    def _room_to_persist(self, cap: CaptureResult) -> bool:
        """Whether the state disk has room for what a pause writes after it answered: its memory layer, its
        flat memory image (a copy where the filesystem cannot reflink), and a margin."""
        need = cap.mem_size + 2 * cap.dirty_bytes + (256 << 20)
        return shutil.disk_usage(self.store.layers_dir).free >= need

    async def _pause(self, handle: LiveSandbox, reason: str, *,
                     task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The pause (see ``pause``); ``task_status.started()`` is its answer, early or after the commit."""
        sandbox_id = handle.sandbox_id
        answered = False

        def answer(cap: CaptureResult) -> None:
            nonlocal answered
            if self.answer_early and cap.since_restore and self._room_to_persist(cap):
                answered = True
                self._persist_begins(sandbox_id)
                task_status.started()

        try:
            async with handle.op_lock, self.gc.pin():
                if handle.done.is_set():
                    raise SandboxConflict(f"sandbox {sandbox_id} stopped meanwhile")
                # traffic and resumes from now on wait for this pause (wait_out_pause): set before the PAUSING
                # transition commits, so nothing that sees the sandbox pausing can reach its guest first
                handle.pausing = True
                try:
                    await self.db.run(lambda s: repo.transition(s, sandbox_id, S.PAUSING, operation=reason,
                                                                expect=[S.RUNNING]))
                except BaseException:
                    handle.pausing = False
                    raise
                private = await self.db.run(SnapshotStore.memory_is_private, sandbox_id,
                                            handle.source.snapshot_id)
                # ``snapshot.quiesce``: the guest's filesystem synced and frozen, so the sealed layer holds every
                # acknowledged write; the guest stops frozen and the /init of its resume thaws it
                quiesced = self.quiesce == "pause" and handle.source.guest_agent
                detail: dict[str, float] = {}
                if quiesced:
                    t = time.monotonic()
                    await quiesce_guest(handle.address, access_token=handle.access_token, sandbox_id=sandbox_id)
                    detail["quiesce_ms"] = round((time.monotonic() - t) * 1000, 1)
                    crash_point("pause.quiesced", vmm_pid=handle.vm.pid)
                try:
                    out = await self._capture(handle, kind=SnapshotKind.PAUSE, keep_running=False,
                                              take_source_memory=private, on_held=answer, detail=detail)
                except BaseException as exc:
                    with trio.CancelScope(shield=True):
                        await self._after_failed_capture(handle, "pause", exc, thaw=quiesced)
                    handle.pausing = False
                    raise
                handle.paused_snapshot_id = out.snapshot_id
                crash_point("pause.committed", vmm_pid=handle.vm.pid)
                handle.request_stop(reason)
                await handle.done.wait()
            self.gc.request("pause")  # the snapshot it ran from is superseded
            self.after_pause(out.snapshot_id, sandbox_id)
        except Exception as exc:
            if not answered:
                raise
            # the caller was told it paused: the sandbox runs on instead, and its events say why
            log.warning("pausing %s failed after the pause answered (it runs on): %s", sandbox_id, exc)
        finally:
            if answered:
                self._persist_ends(sandbox_id)
        if not answered:
            task_status.started()

    def _persist_begins(self, sandbox_id: str) -> None:
        if not self._persisting:
            self._persisted = trio.Event()
        self._persisting.add(sandbox_id)

    def _persist_ends(self, sandbox_id: str) -> None:
        self._persisting.discard(sandbox_id)
        if not self._persisting:
            self._persisted.set()

    async def wait_persisted(self) -> None:
        """Until every pause that answered early has committed (or failed): a stop waits here before it
        leaves sandboxes to the data plane or pauses them."""
        await self._persisted.wait()

    # -- restores ------------------------------------------------------------------------------------
    async def fork(self, sandbox_id: str, *, count: int, timeout_s: Optional[int]) -> list[Sandbox | Exception]:
        """One capture of the parent, then ``count`` restores in parallel; per child its row, or the
        exception that stopped it."""
        if not 1 <= count <= self.fork_max_count:
            raise ForkLimit(f"count must be between 1 and {self.fork_max_count}")
        handle = self._live_or_conflict(sandbox_id, "fork")
        async with contextlib.AsyncExitStack() as pinned:
            async with handle.op_lock:
                # pinned until the children's rows name the fork snapshot; op_lock first, as pause does
                await pinned.enter_async_context(self.gc.pin())
                snap_id = await self._capture_live(handle, kind=SnapshotKind.FORK, name=None, state=S.FORKING,
                                                   operation="fork")
            parent = await self.db.run(lambda s: repo.get_sandbox(s, sandbox_id))
            source = await self.store.load(snap_id)
            timeout = timeout_s if timeout_s is not None else self.default_timeout_s
            results: list[Sandbox | Exception | None] = [None] * count

            async def child(i: int) -> None:
                try:
                    results[i] = await self._fork_child(parent, source, timeout)
                except Exception as exc:
                    log.warning("fork child %d of %s failed: %s", i, sandbox_id, exc)
                    results[i] = exc

            async with trio.open_nursery() as children:
                for i in range(count):
                    children.start_soon(child, i)
            return [r for r in results if r is not None]  # every child set its result

    async def _fork_child(self, parent: Sandbox, source: SnapshotSource, timeout_s: int) -> Sandbox:
        sid = "i" + secrets.token_hex(10)
        # a child gets tokens of its own (a traffic token where its parent has one)
        token = secrets.token_urlsafe(24)
        traffic = secrets.token_urlsafe(24) if parent.traffic_access_token else None
        now = utcnow()
        row = Sandbox(
            id=sid, template_id=parent.template_id, alias=parent.alias, node_id=self.node_id,
            client_id=self.node_id, cpu_count=parent.cpu_count, memory_mb=parent.memory_mb,
            disk_size_mb=parent.disk_size_mb, envd_version=parent.envd_version, envd_access_token=token,
            traffic_access_token=traffic,
            metadata_=dict(parent.metadata_ or {}), env_vars=dict(parent.env_vars or {}),
            auto_pause=parent.auto_pause, auto_resume=parent.auto_resume,
            allow_internet_access=parent.allow_internet_access, network_policy=dict(parent.network_policy or {}),
            snapshot_id=source.snapshot_id, parent_sandbox_id=parent.id, vmm=self.vmm_name, started_at=now,
            end_at=now + dt.timedelta(seconds=timeout_s))
        await self.db.run(lambda s: repo.insert_sandbox(s, row, operation="fork"))
        crash_point("fork.child_inserted")
        await self.launcher.launch(Launch(sid, source, env_vars=dict(parent.env_vars or {}), access_token=token,
                                          previous_token=parent.envd_access_token, policy=policy_of(parent),
                                          operation="fork", traffic_token=traffic))
        return await self.db.run(lambda s: repo.get_sandbox(s, sid))

    async def resume(self, sandbox_id: str, *, timeout_s: Optional[int] = None) -> tuple[Sandbox, bool]:
        """Running: (row, False). Paused: claim it in the repository, restore it from its pause
        snapshot, (row, True).

        The claim (publish.py ``claim_for_resume``) makes this node the sandbox's only runner
        before anything starts: a sandbox running on another node is a 409 naming that node; one paused
        on another node (unknown here, or newer there than this node's copy) is imported first.
        A sandbox being paused is resumed once the pause is done (E2B: connect during a pause succeeds)."""
        await self.wait_out_pause(sandbox_id)
        async with self.resume_lock(sandbox_id), self.gc.pin():
            known = await self.db.run(lambda s: s.get(Sandbox, sandbox_id) is not None)
            if known:
                sb = await self.db.run(lambda s: repo.get_sandbox(s, sandbox_id))
                if sb.state == S.RUNNING and self.launcher.get(sandbox_id) is not None:
                    if timeout_s is not None:
                        await self.db.run(repo.set_end, sandbox_id, timeout_s)
                    return await self.db.run(lambda s: repo.get_sandbox(s, sandbox_id)), False
                if sb.state != S.PAUSED or sb.snapshot_id is None:
                    raise SandboxConflict(f"sandbox {sandbox_id} is {sb.state}: it cannot be resumed")
            # paused here or on another node sharing the repository: this node claims it first
            try:
                claim = await claim_for_resume(self.db, self.repo, self.store.snapshots_dir, sandbox_id,
                                               self.node_id, self.owner, self.owner_dead)
            except OwnershipConflict as exc:
                raise SandboxConflict(str(exc)) from None
            if claim is not None and claim.imported and known:
                self.gc.request("import")  # the stale local snapshot may be garbage now
            try:
                sb = await self.db.run(lambda s: repo.get_sandbox(s, sandbox_id))
                if sb.state != S.PAUSED or sb.snapshot_id is None:
                    raise SandboxConflict(f"sandbox {sandbox_id} is {sb.state}: it cannot be resumed")
                source = await self.store.load(sb.snapshot_id)
                end = utcnow() + dt.timedelta(seconds=timeout_s if timeout_s is not None else self.default_timeout_s)
                await self.db.run(lambda s: repo.transition(s, sandbox_id, S.RESUMING, operation="resume",
                                                            expect=[S.PAUSED], end_at=end))
                await self.launcher.launch(Launch(
                    sandbox_id, source, env_vars=dict(sb.env_vars or {}),
                    access_token=sb.envd_access_token or secrets.token_urlsafe(24),
                    previous_token=sb.envd_access_token, policy=policy_of(sb), operation="resume",
                    traffic_token=sb.traffic_access_token))
            except BaseException:
                if claim is not None:  # not running here after all: hand the claim back
                    with trio.CancelScope(shield=True):
                        await trio.to_thread.run_sync(release_claim, self.repo, claim, self.owner)
                raise
            return await self.db.run(lambda s: repo.get_sandbox(s, sandbox_id)), True

