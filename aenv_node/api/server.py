"""The API server as a supervisor service: Hypercorn serving the Quart app."""

from __future__ import annotations

import contextlib
import logging

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve

from ..runtime import Node
from ..runtime.manager import SandboxManager
from ..runtime.manager import SandboxNotRunning as ManagerNotRunning
from .app import create_app
from .proxy import Resolution, SandboxNotRunning, SandboxProxy

__all__ = ["ApiServer"]

log = logging.getLogger(__name__)


class ApiServer:
    """Serves the E2B API; stops accepting on ``node.shutdown`` and drains requests."""

    name = "api"

    def __init__(self, node: Node) -> None:
        self.node = node
        self.app = create_app(node)
        self.bound: list[str] = []
        self.proxy: SandboxProxy | None = None
        manager = next((s for s in node.services if isinstance(s, SandboxManager)), None)
        if manager is not None:
            self.proxy = SandboxProxy(self.app, self._resolver(manager), node.cfg.api.domain)
            manager.stopped_hooks.append(self.proxy.disconnect)

    @staticmethod
    def _resolver(manager: SandboxManager):  # type: ignore[no-untyped-def]
        async def resolve(sandbox_id: str, port: int) -> Resolution:
            try:
                handle = await manager.resolve(sandbox_id, port)
            except ManagerNotRunning as exc:
                raise SandboxNotRunning(str(exc)) from None
            return Resolution(host=handle.address, access_token=handle.access_token,
                              traffic_token=handle.traffic_token)

        return resolve

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        hc = HypercornConfig()
        hc.bind = [self.node.cfg.api.listen]
        hc.accesslog = None
        hc.errorlog = logging.getLogger("hypercorn.error")
        hc.graceful_timeout = min(self.node.cfg.node.shutdown_grace_s, 30.0)
        hc.keep_alive_timeout = 75
        hc.read_timeout = None  # proxied Connect streams and idle stdin streams stay open
        hc.include_server_header = False
        async with contextlib.AsyncExitStack() as stack:
            if self.proxy is not None:
                await stack.enter_async_context(self.proxy)
            nursery = await stack.enter_async_context(trio.open_nursery())
            self.bound = await nursery.start(
                lambda task_status: serve(self.proxy or self.app, hc,
                                          shutdown_trigger=self.node.shutdown.wait,
                                          task_status=task_status)
            )
            log.info("API listening on %s", ", ".join(self.bound))
            task_status.started()
