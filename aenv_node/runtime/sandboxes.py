"""The sandbox service: what the API (and the CLI through it) asks of the node's sandboxes.

Create, kill and resolve live here, on the registry of running sandboxes;
pause, snapshot, fork and resume are the snapshot operations'
(``snapshot/operations.py``). Every state-changing call is admitted by the
node's operation tracker first, so a draining node answers ``NodeDraining``
(503) and a shutdown waits for the calls in flight.
"""

from __future__ import annotations

import datetime as dt
import logging
import secrets
from dataclasses import asdict, dataclass
from typing import Optional

import trio
from sqlalchemy.orm import Session

from ..config import Config
from ..faults import crash_point
from ..net import EgressPolicy
from ..snapshot.envd import envd_metrics
from ..snapshot.operations import Launch, SnapshotOperations
from ..snapshot.share import forget_template
from ..snapshot.publish import forget_published, record_unsettled, settle_record, unpublished_pauses
from ..state import Database, Sandbox, SandboxState, utcnow
from ..state import repository as repo
from ..state.idempotency import prior_create, record, request_hash
from .errors import SandboxNotRunning
from .node import Node
from .parts import NodeParts
from .registry import LiveSandboxes, StoppedHook
from .sandbox import SandboxHandle
from .templates import TemplateService, envd_version

__all__ = ["CreateRequest", "DrainReport", "SandboxService"]

log = logging.getLogger(__name__)

S = SandboxState


@dataclass
class CreateRequest:
    template: str
    timeout_s: int
    metadata: dict[str, str]
    env_vars: dict[str, str]
    auto_pause: bool = True
    auto_resume: bool = False
    allow_internet_access: bool = True
    allow_out: Optional[list[str]] = None
    deny_out: Optional[list[str]] = None
    #: False: the proxy requires the sandbox's traffic token on every port but envd's
    allow_public_traffic: bool = True
    #: the client's Idempotency-Key: a retry with it gets the sandbox the first request made
    idempotency_key: Optional[str] = None


@dataclass(frozen=True)
class DrainReport:
    """What a drain left: sandboxes it paused now, ones still running (a pause failed), pauses not yet published
    to the repository (another node cannot resume those until they are; the node goes on publishing them)."""

    paused: int
    running: int
    unpublished: int


class SandboxService:
    """See the module docstring."""

    def __init__(self, node: Node, parts: NodeParts, registry: LiveSandboxes, ops: SnapshotOperations,
                 templates: TemplateService) -> None:
        self.node = node
        self.parts = parts
        self.registry = registry
        self.ops = ops
        self.templates = templates
        self.cfg: Config = node.cfg
        self.db: Database = node.db
        #: one lock per Idempotency-Key being created: a retry that arrives meanwhile waits for the first
        self._key_locks: dict[str, trio.Lock] = {}
        self._drain_lock = trio.Lock()
        #: sandboxes a ``kill`` is ending (how many kills): their repository record is the kill's to remove
        self._killing: dict[str, int] = {}
        registry.stopped_hooks.append(self._settle_record)
        node.drainers.append(self.on_stop)
        registry.lost_hooks.append(node.request_shutdown)

    @property
    def live(self) -> dict[str, SandboxHandle]:
        return self.registry.live

    @property
    def stopped_hooks(self) -> list[StoppedHook]:
        return self.registry.stopped_hooks

    # -- create, kill, resolve -------------------------------------------------------------------------
    async def create(self, req: CreateRequest) -> Sandbox:
        """Create a sandbox; with an idempotency key, the sandbox an earlier request with it made, if any."""
        key = req.idempotency_key
        if key is None:
            return await self._create(req, None)
        digest = request_hash({k: v for k, v in asdict(req).items() if k != "idempotency_key"})
        lock = self._key_locks.setdefault(key, trio.Lock())
        try:
            async with lock:
                prior = await self.db.run(prior_create, key, digest)
                if prior is not None:
                    log.info("create with Idempotency-Key %r: sandbox %s again", key, prior)
                    return await self.db.run(lambda s: repo.get_sandbox(s, prior, include_killed=True))
                return await self._create(req, digest)
        finally:
            if not lock.locked() and lock.statistics().tasks_waiting == 0:
                self._key_locks.pop(key, None)

    async def _create(self, req: CreateRequest, digest: Optional[str]) -> Sandbox:
        async with self.node.tracker.operation("create"), self.parts.gc.pin():
            t, sn, source = await self.templates.resolve_source(req.template)
            sid = "i" + secrets.token_hex(10)
            token = secrets.token_urlsafe(24)  # always secured, as E2B: envd requires it
            traffic = None if req.allow_public_traffic else secrets.token_urlsafe(24)
            now = utcnow()
            policy = EgressPolicy.from_e2b(req.allow_out, req.deny_out,
                                           allow_internet_access=req.allow_internet_access)
            # a snapshot used as a template carries the env vars of the sandbox it came from
            env_vars = {**source.env_vars, **req.env_vars}
            row = Sandbox(
                id=sid, template_id=t.id, alias=t.alias, node_id=self.node.node_id, client_id=self.node.node_id,
                cpu_count=t.cpu_count, memory_mb=t.memory_mb, disk_size_mb=t.disk_size_mb,
                # ("": a VM imported without envd, templates/import_vm.py)
                envd_version=(t.envd_version or envd_version()) if source.guest_agent else "",
                envd_access_token=token,
                traffic_access_token=traffic,
                metadata_=req.metadata, env_vars=env_vars, auto_pause=req.auto_pause,
                auto_resume=req.auto_resume, allow_internet_access=req.allow_internet_access,
                network_policy={k: v for k, v in (("allowOut", req.allow_out), ("denyOut", req.deny_out)) if v},
                snapshot_id=sn.id, vmm=self.parts.driver.name, started_at=now,
                end_at=now + dt.timedelta(seconds=req.timeout_s))
            def insert(s: Session) -> None:
                repo.insert_sandbox(s, row)
                if req.idempotency_key is not None and digest is not None:
                    record(s, req.idempotency_key, digest, sid)  # with the sandbox: never one without the other

            await self.db.run(insert)
            crash_point("create.inserted")
            handle = await self.registry.launch(Launch(sid, source, env_vars=env_vars, access_token=token,
                                                       previous_token=source.access_token, policy=policy,
                                                       operation="create", traffic_token=traffic))
            assert handle.record is not None  # (set before the launch returns it)
            return handle.record

    async def kill(self, sandbox_id: str, *, reason: str = "kill") -> bool:
        """Kill a sandbox; False if it does not exist (or is already killed)."""
        self._killing[sandbox_id] = self._killing.get(sandbox_id, 0) + 1
        try:
            killed = await self._kill(sandbox_id, reason=reason)
            if killed:
                # another node sharing the repository must not resume it any more (and ``_settle_record`` leaves
                # this to the kill)
                try:
                    await trio.to_thread.run_sync(forget_published, self.parts.repository, sandbox_id,
                                                  self.parts.owner)
                except Exception as exc:  # the kill stands; the record goes when the repository answers again
                    await self._unsettled(sandbox_id, exc)
                self.parts.gc.request("kill")
            return killed
        finally:
            self._killing[sandbox_id] -= 1
            if not self._killing[sandbox_id]:
                del self._killing[sandbox_id]

    async def _unsettled(self, sandbox_id: str, exc: Exception) -> None:
        log.warning("removing the repository record of %s failed (retried every %.0f s): %s", sandbox_id,
                    self.ops.publish_retry_s, exc)
        error = f"{type(exc).__name__}: {exc}"
        await self.db.run(record_unsettled, sandbox_id, error)

    async def _kill(self, sandbox_id: str, *, reason: str) -> bool:
        handle = self.registry.get(sandbox_id)
        if handle is not None:
            async with self.node.tracker.operation("kill"), handle.op_lock:
                if not handle.done.is_set():
                    await self.db.run(lambda s: repo.transition(s, sandbox_id, S.KILLING, operation=reason,
                                                                expect=[S.RUNNING, S.ERROR]))
                    handle.request_stop(reason)
                    await handle.done.wait()
                    return True
            # it stopped while the kill waited for the lock (a pause that had answered ended): it is paused
            # now, and the kill is recorded as for any paused sandbox

        def work(s: Session) -> bool:
            sb = s.get(Sandbox, sandbox_id)
            if sb is None or sb.state == S.KILLED:
                return False
            # no process on this node (paused, or error): just record the kill
            if sb.state != S.KILLING:
                repo.transition(s, sandbox_id, S.KILLING, operation=reason)
            repo.transition(s, sandbox_id, S.KILLED, operation=reason)
            return True

        return await self.db.run(work)

    async def _settle_record(self, sandbox_id: str) -> None:
        """A sandbox ended here without a pause or a kill (VMM died, node restarted): drop its repository
        ownership record if it still says running here (snapshot/publish.py ``settle_record``)."""
        if sandbox_id in self._killing:
            return  # the kill removes it itself
        try:
            await settle_record(self.db, self.parts.repository, sandbox_id, self.parts.owner)
        except Exception as exc:  # the repository may be unreachable: retried until it answers
            await self._unsettled(sandbox_id, exc)

    async def resolve(self, sandbox_id: str, port: int) -> SandboxHandle:
        """The live sandbox for proxied traffic; a paused one with autoResume is resumed first, and one being
        paused is waited for (then resumed, with autoResume) instead of being sent traffic it cannot answer."""
        await self.ops.wait_out_pause(sandbox_id)  # returns at once (no checkpoint) when no pause is in progress
        handle = self.registry.get(sandbox_id)
        if handle is not None:
            return handle

        def auto(s: Session) -> bool:
            sb = s.get(Sandbox, sandbox_id)
            return sb is not None and sb.auto_resume and sb.state in (S.PAUSED, S.RESUMING, S.PAUSING)

        if await self.db.run(auto):
            try:
                await self.resume(sandbox_id)
            except Exception as exc:
                raise SandboxNotRunning(f"The sandbox {sandbox_id} was not found ({exc})") from None
            handle = self.registry.get(sandbox_id)
            if handle is not None:
                return handle
        raise SandboxNotRunning(f"The sandbox {sandbox_id} was not found")

    # -- the snapshot operations, admitted ---------------------------------------------------------------
    async def on_stop(self) -> None:
        """What a graceful stop does with running sandboxes (``Node.drainers``): with a data plane they keep
        running there for the node's next run (unless ``node.pause_on_stop``); without one they are paused."""
        with trio.move_on_after(self.cfg.node.shutdown_grace_s):  # pauses that answered: persisted first
            await self.ops.wait_persisted()
        if self.parts.dataplane is not None and (not self.cfg.node.pause_on_stop or self.registry.dataplane_lost.is_set()):
            # (a lost data plane took the disks: nothing can be paused; the next start settles the sandboxes)
            self.registry.detach_all()
            return
        await self.pause_all()

    async def drain(self) -> DrainReport:
        """``aenv-node drain`` (a Kubernetes preStop, an operator before maintenance): admit no new operation
        (creates and resumes get 503, so a gateway places them elsewhere; reads go on), let the ones in flight
        finish, then pause and publish every running sandbox, so that any node of the cluster can resume it from
        the shared repository. The node stays drained until it stops: a drain is not undone. Calls made while
        one runs wait for it and find nothing left to pause."""
        async with self._drain_lock:
            if not self.node.tracker.draining:
                log.info("draining: no new sandbox operations; pausing and publishing every running sandbox")
            self.node.tracker.start_draining()
            with trio.move_on_after(self.cfg.node.shutdown_grace_s):
                await self.node.tracker.wait_idle()
            paused = await self.pause_all(reason="drain")
            unpublished = await self.db.run(unpublished_pauses)
            return DrainReport(paused=paused, running=len(self.live), unpublished=len(unpublished))

    async def pause_all(self, *, reason: str = "node_stop") -> int:
        """Pause every running sandbox, a few at a time, then wait for their publishes (``Node.drainers``:
        a graceful stop never kills a sandbox). Not admitted by the tracker: it runs while the node drains. A
        sandbox whose pause fails keeps running (the pause's own rollback) and ends with the node, its error
        recorded. Publishes are waited for ``node.shutdown_grace_s`` at most (the next start publishes the
        rest)."""
        limiter = trio.CapacityLimiter(4)
        paused: list[str] = []

        async def one(sid: str) -> None:
            async with limiter:
                handle = self.registry.get(sid)
                if handle is None or handle.stop_requested.is_set() or handle.pausing:
                    return  # (one pausing already: its persist is waited for below)
                try:
                    await self.ops.pause(sid, reason=reason)
                    paused.append(sid)
                except Exception as exc:
                    log.warning("pausing %s for the node's stop failed: %s", sid, exc)

        running = list(self.live)
        if not running:
            return 0
        log.info("pausing %d running sandboxes before stopping", len(running))
        async with trio.open_nursery() as nursery:
            for sid in running:
                nursery.start_soon(one, sid)
        with trio.move_on_after(self.cfg.node.shutdown_grace_s):
            await self.ops.wait_persisted()  # (each pause answered once its guest was captured)
            await self.ops.wait_published()
        log.info("paused %d of %d running sandboxes (%s)", len(paused), len(running), reason)
        return len(paused)

    async def pause(self, sandbox_id: str, *, reason: str = "pause") -> None:
        async with self.node.tracker.operation("pause"):
            await self.ops.pause(sandbox_id, reason=reason)

    async def resume(self, sandbox_id: str, *, timeout_s: Optional[int] = None) -> tuple[Sandbox, bool]:
        async with self.node.tracker.operation("resume"):
            return await self.ops.resume(sandbox_id, timeout_s=timeout_s)

    async def snapshot(self, sandbox_id: str, *, name: Optional[str] = None) -> str:
        async with self.node.tracker.operation("snapshot"):
            snapshot_id = await self.ops.snapshot(sandbox_id, name=name)
        self.templates.share(snapshot_id)  # a template for every node of the cluster (in the background)
        return snapshot_id

    async def fork(self, sandbox_id: str, *, count: int, timeout_s: Optional[int]) -> list[Sandbox | Exception]:
        async with self.node.tracker.operation("fork"):
            return await self.ops.fork(sandbox_id, count=count, timeout_s=timeout_s)

    async def periodic_snapshot(self, handle: SandboxHandle) -> Optional[str]:
        async with self.node.tracker.operation("periodic_snapshot"):
            return await self.ops.periodic_snapshot(handle)

    async def delete_snapshot(self, snapshot_id: str) -> bool:
        """Delete a user snapshot (a template built from a running sandbox)."""
        deleted = await self.parts.store.delete_user_snapshot(snapshot_id)
        if deleted:
            self.parts.gc.request("snapshot_delete")  # its files go once no sandbox runs from it
            try:  # no other node of the cluster creates sandboxes from it any more
                await forget_template(self.parts.repository, snapshot_id, None)
            except Exception as exc:
                log.warning("removing the repository record of snapshot %s failed: %s", snapshot_id, exc)
        return deleted

    # -- settings and observations ------------------------------------------------------------------------
    async def set_timeout(self, sandbox_id: str, timeout_s: int) -> None:
        """The sandbox now ends ``timeout_s`` seconds from now (E2B set_timeout semantics)."""
        await self.db.run(repo.set_end, sandbox_id, timeout_s)

    async def update_network(self, sandbox_id: str, *, allow_out: Optional[list[str]],
                             deny_out: Optional[list[str]]) -> None:
        """E2B PUT /sandboxes/{id}/network: replace the egress policy (live slots at once)."""
        sb = await self.db.run(lambda s: repo.get_sandbox(s, sandbox_id))
        policy = EgressPolicy.from_e2b(allow_out, deny_out, allow_internet_access=sb.allow_internet_access)
        handle = self.registry.get(sandbox_id)
        if handle is not None:
            await self.parts.running_pool().set_egress(handle.slot, policy)
            handle.policy = policy
        stored = {k: v for k, v in (("allowOut", allow_out), ("denyOut", deny_out)) if v}
        await self.db.run(lambda s: repo.update_sandbox(s, sandbox_id, operation="update_network",
                                                        detail=stored, network_policy=stored))

    async def guest_metrics(self, sandbox_id: str) -> Optional[dict[str, object]]:
        """envd's metrics of a running sandbox; None when it does not run on this node."""
        handle = self.registry.get(sandbox_id)
        if handle is None:
            return None
        return await envd_metrics(handle.address, access_token=handle.access_token)
