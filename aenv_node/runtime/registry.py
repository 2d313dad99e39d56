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
from typing import Awaitable, Callable, Optional

import trio

from ..snapshot.gc import LiveStack
from ..snapshot.operations import Launch
from .errors import NodeNotReady
from .parts import NodeParts
from .sandbox import SandboxHandle, SandboxSpec, run_sandbox

__all__ = ["LiveSandboxes"]

log = logging.getLogger(__name__)

StoppedHook = Callable[[str], Awaitable[object]]


class LiveSandboxes:
    name = "sandboxes"

    def __init__(self, parts: NodeParts) -> None:
        self.parts = parts
        self.live: dict[str, SandboxHandle] = {}
        self.stopped_hooks: list[StoppedHook] = []
        self._nursery: Optional[trio.Nursery] = None
        parts.live_stacks = self.stacks

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._nursery = None

    def get(self, sandbox_id: str) -> Optional[SandboxHandle]:
        return self.live.get(sandbox_id)

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

    async def _run(self, spec: SandboxSpec, *, task_status: trio.TaskStatus[SandboxHandle]) -> None:
        try:
            await run_sandbox(spec, db=self.parts.db, driver=self.parts.driver, frontend=self.parts.frontend,
                              pool=self.parts.running_pool(),
                              live=self.live, cache=self.parts.cache, logs=self.parts.cfg.logs,
                              task_status=task_status)
        finally:
            with trio.CancelScope(shield=True):
                for hook in self.stopped_hooks:
                    try:
                        await hook(spec.sandbox_id)
                    except Exception:
                        log.exception("stopped hook for %s failed", spec.sandbox_id)

    def stacks(self) -> list[LiveStack]:
        """What the sandboxes live on this node use (for the garbage collector)."""
        stacks = []
        for h in list(self.live.values()):
            disk = [ref.digest for ref in h.source.disk_layers if ref.is_local]
            disk += [f"sha256:{r.digest}" for r in h.image.layers if r.digest]  # the image's own view
            stacks.append(LiveStack(h.source.snapshot_id, tuple(disk), tuple(h.source.memory_layers)))
        return stacks
