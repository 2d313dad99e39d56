"""The live-sandbox registry: every running sandbox is a task in this service's nursery.

``launch`` starts one (``sandbox.run_sandbox``) and returns its handle once it
runs; ``get`` finds a running one. It is the ``Launcher`` the snapshot
operations restore sandboxes through, and what the garbage collector asks for
the layers running sandboxes use. Cancelling the service (node shutdown) ends
every sandbox through its shielded cleanup. ``stopped_hooks`` are called with
a sandbox id after it stopped running (the API's proxy cuts its streams).
"""

from __future__ import annotations

import logging
import os
from typing import Awaitable, Callable, Optional

import trio
from sqlalchemy.orm import Session

from ..net import EgressPolicy
from ..snapshot.gc import LiveStack
from ..snapshot.operations import Launch
from ..snapshot.source import SnapshotSource, load_source
from ..state import Sandbox
from .errors import NodeNotReady
from .parts import NodeParts
from .sandbox import Adoption, SandboxHandle, SandboxSpec, run_sandbox

__all__ = ["LiveSandboxes"]

log = logging.getLogger(__name__)

StoppedHook = Callable[[str], Awaitable[object]]


class LiveSandboxes:
    name = "sandboxes"

    def __init__(self, parts: NodeParts) -> None:
        self.parts = parts
        self.live: dict[str, SandboxHandle] = {}
        self.stopped_hooks: list[StoppedHook] = []
        #: set when the data plane exits under a running node: every sandbox lost its disk, and the node stops
        #: (``lost_hooks`` are called); its next start settles them as after a crash (last periodic snapshot)
        self.dataplane_lost = trio.Event()
        self.lost_hooks: list[Callable[[], None]] = []
        self._nursery: Optional[trio.Nursery] = None
        #: sandboxes left running in the data plane by a stop (``detach_all``)
        self._detached: set[str] = set()
        parts.live_stacks = self.stacks

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                if self.parts.dataplane is not None and self.parts.dataplane.pid is not None:
                    nursery.start_soon(self._watch_dataplane, self.parts.dataplane.pid)
                await self._take_over()
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._nursery = None

    async def _watch_dataplane(self, pid: int) -> None:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            fd = None
        try:
            if fd is not None:
                await trio.lowlevel.wait_readable(fd)
        finally:
            if fd is not None:
                trio.lowlevel.notify_closing(fd)
                os.close(fd)
        log.critical("the data plane (pid %d) exited: %d running sandboxes lost their disks; the node stops, and its "
                     "next start settles them at their last periodic snapshot", pid, len(self.live))
        self.dataplane_lost.set()
        for hook in self.lost_hooks:
            hook()

    async def _take_over(self) -> None:
        """Take over the sandboxes the previous run left running in the data plane (found by the reconciler);
        one that cannot be is recorded as ended (its VMM killed, its disk closed), as a crash would leave it."""
        for sid, adopt in list(self.parts.adoptions.items()):
            try:
                self.parts.running_pool().adopt(adopt.slot)
                await self._start(sid, adopt)
            except Exception as exc:
                log.warning("taking over sandbox %s failed: %s", sid, exc)
            else:
                log.info("took over sandbox %s (VMM %d) from the previous run", sid, adopt.vmm_pid)
            finally:  # its layers were the collector's to keep until now (``stacks``)
                del self.parts.adoptions[sid]

    async def _start(self, sid: str, adopt: Adoption) -> None:
        assert self._nursery is not None
        cfg = self.parts.cfg
        source, row = await self.parts.db.run(self._adoption_source, sid)
        spec = SandboxSpec(
            sandbox_id=sid, source=source, env_vars=dict(row.env_vars), access_token=row.envd_access_token,
            previous_token=None, default_user=source.default_user or "user",
            default_workdir=source.default_workdir, policy=EgressPolicy.from_e2b(
                row.network_policy.get("allowOut"), row.network_policy.get("denyOut"),
                allow_internet_access=row.allow_internet_access),
            workdir=cfg.sandboxes_dir / sid, run_dir=cfg.run_dir / sid, operation="adopt",
            traffic_token=row.traffic_access_token)
        await self._nursery.start(self._run, spec, adopt)

    @staticmethod
    def _adoption_source(s: Session, sid: str) -> tuple[SnapshotSource, Sandbox]:
        row = s.get(Sandbox, sid)
        source = load_source(s, row.snapshot_id) if row is not None and row.snapshot_id else None
        if row is None or source is None:
            raise NodeNotReady(f"sandbox {sid} has no row or no committed snapshot to take over from")
        s.expunge(row)
        return source, row

    def detach_all(self) -> None:
        """Leave every running sandbox running in the data plane when the node stops (``Node.drainers``)."""
        for handle in list(self.live.values()):
            handle.detach()
            self._detached.add(handle.sandbox_id)
            if self.parts.pool is not None:  # its network stays as it is, for the next run to adopt
                self.parts.pool.disown(handle.slot)
        if self.live:
            log.info("leaving %d sandboxes running in the data plane", len(self.live))

    def get(self, sandbox_id: str) -> Optional[SandboxHandle]:
        return self.live.get(sandbox_id)

    def policy_of_slot(self, index: int) -> Optional[EgressPolicy]:
        """The egress policy of the sandbox running in slot ``index``, None when none runs there."""
        for handle in list(self.live.values()):
            if handle.slot_index == index:
                return handle.policy
        return None

    async def launch(self, launch: Launch) -> SandboxHandle:
        """Bring a sandbox up from ``launch.source``; returns once it runs (its row says running)."""
        if self._nursery is None:
            raise NodeNotReady("the sandbox service is not running")
        cfg = self.parts.cfg
        sid = launch.sandbox_id
        spec = SandboxSpec(
            sandbox_id=sid, source=launch.source, env_vars=launch.env_vars, access_token=launch.access_token,
            previous_token=launch.previous_token, default_user=launch.source.default_user or "user",
            default_workdir=launch.source.default_workdir, policy=launch.policy,
            workdir=cfg.sandboxes_dir / sid, run_dir=cfg.run_dir / sid, operation=launch.operation,
            traffic_token=launch.traffic_token)
        handle: SandboxHandle = await self._nursery.start(self._run, spec)
        return handle

    async def _run(self, spec: SandboxSpec, adopt: Optional[Adoption] = None, *,
                   task_status: trio.TaskStatus[SandboxHandle]) -> None:
        try:
            await run_sandbox(spec, db=self.parts.db, driver=self.parts.driver, frontend=self.parts.frontend,
                              pool=self.parts.running_pool(),
                              live=self.live, cache=self.parts.cache, logs=self.parts.cfg.logs,
                              dataplane=self.parts.dataplane, adopt=adopt, task_status=task_status)
        finally:
            with trio.CancelScope(shield=True):
                # one left running in the data plane did not stop: its repository record stays as it is
                hooks = [] if spec.sandbox_id in self._detached else self.stopped_hooks
                for hook in hooks:
                    try:
                        await hook(spec.sandbox_id)
                    except Exception:
                        log.exception("stopped hook for %s failed", spec.sandbox_id)

    def stacks(self) -> list[LiveStack]:
        """What the sandboxes live on this node use (for the garbage collector)."""
        stacks = []
        for adopt in list(self.parts.adoptions.values()):  # found by the reconciler, not taken over yet
            stacks.append(LiveStack(adopt.snapshot_id, tuple(r.digest for r in adopt.layers), ()))
        for h in list(self.live.values()):
            disk = [ref.digest for ref in h.source.disk_layers if ref.is_local]
            disk += [f"sha256:{r.digest}" for r in h.image.layers if r.digest]  # the image's own view
            stacks.append(LiveStack(h.source.snapshot_id, tuple(disk), tuple(h.source.memory_layers)))
        return stacks
