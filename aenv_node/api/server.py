"""The API server as a supervisor service: Hypercorn serving the Quart app."""

from __future__ import annotations

import logging

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve

from ..runtime import Node
from .app import create_app

__all__ = ["ApiServer"]

log = logging.getLogger(__name__)


class ApiServer:
    """Serves the E2B API; stops accepting on ``node.shutdown`` and drains requests."""

    name = "api"

    def __init__(self, node: Node) -> None:
        self.node = node
        self.app = create_app(node)
        self.bound: list[str] = []

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        hc = HypercornConfig()
        hc.bind = [self.node.cfg.api.listen]
        hc.accesslog = None
        hc.errorlog = logging.getLogger("hypercorn.error")
        hc.graceful_timeout = min(self.node.cfg.node.shutdown_grace_s, 30.0)
        hc.keep_alive_timeout = 75
        hc.read_timeout = None
        async with trio.open_nursery() as nursery:
            self.bound = await nursery.start(
                lambda task_status: serve(self.app, hc, shutdown_trigger=self.node.shutdown.wait,
                                          task_status=task_status)
            )
            log.info("API listening on %s", ", ".join(self.bound))
            task_status.started()
