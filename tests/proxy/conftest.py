"""Fixtures: a real upstream server, and a node-like app wrapped by SandboxProxy, both on loopback.

Everything runs in the test's Trio run under Hypercorn, as in production: the
proxy wraps a small Quart-trio app, and its resolver maps test sandbox ids to
the upstream server (or to a closed port, or raises SandboxNotRunning).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import httpx
import pytest
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve
from quart_trio import QuartTrio

from aenv_node.api.proxy import Resolution, SandboxNotRunning, SandboxProxy
from aenv_node.api.server import serve_api
from aenv_node.runtime.errors import NodeDraining
from aenv_node.state.errors import NotFound

from ..conftest import free_port
from .upstream import Upstream, UpstreamState

DOMAIN = "example.test"
TRAFFIC_TOKEN = "traffic-secret"


def hypercorn_config(port: int) -> HypercornConfig:
    config = HypercornConfig()
    config.bind = [f"127.0.0.1:{port}"]
    config.accesslog = None
    config.keep_alive_timeout = 75
    config.read_timeout = None
    return config


async def serve_asgi_on(app: Any, port: int, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve an ASGI app with Hypercorn on a given loopback port (until cancelled)."""
    await serve(app, hypercorn_config(port), task_status=task_status)


@asynccontextmanager
async def serve_asgi(app: Any) -> AsyncIterator[int]:
    """Serve an ASGI app with Hypercorn on a free loopback port until the block ends."""
    port = free_port()
    async with trio.open_nursery() as nursery:
        await nursery.start(partial(serve_asgi_on, app, port))
        try:
            yield port
        finally:
            nursery.cancel_scope.cancel()


@asynccontextmanager
async def serve_proxy(proxy: SandboxProxy) -> AsyncIterator[int]:
    """Serve the proxy as the node does (``serve_api``: the raw relay first, Hypercorn for the rest) on a free
    loopback port until the block ends."""
    port = free_port()
    async with trio.open_nursery() as nursery:
        await nursery.start(partial(serve_api, proxy.app, proxy, hypercorn_config(port),
                                    shutdown_trigger=trio.sleep_forever))
        try:
            yield port
        finally:
            nursery.cancel_scope.cancel()


def node_app() -> QuartTrio:
    app = QuartTrio("proxy-test-node")

    @app.route("/hello")
    async def hello() -> str:
        return "hello from the node app"

    return app


@dataclass
class Sandboxes:
    """The resolver's table: sandbox id -> Resolution (None: not running)."""

    table: dict[str, Resolution | Exception | None] = field(default_factory=dict)
    calls: list[tuple[str, int]] = field(default_factory=list)

    async def resolve(self, sandbox_id: str, port: int) -> Resolution:
        self.calls.append((sandbox_id, port))
        resolution = self.table.get(sandbox_id)
        if resolution is None:
            raise SandboxNotRunning(f"sandbox {sandbox_id} is not running")
        if isinstance(resolution, Exception):
            raise resolution
        return resolution


@dataclass
class ProxyEnv:
    url: str
    upstream_port: int
    closed_port: int
    state: UpstreamState
    sandboxes: Sandboxes
    proxy: SandboxProxy

    def client(self, **kwargs: Any) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, timeout=30, **kwargs)


def sandbox_headers(sandbox_id: str = "abc", port: int = 49983, **extra: str) -> dict[str, str]:
    return {"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": str(port), **extra}


@pytest.fixture
async def proxy_env() -> AsyncIterator[ProxyEnv]:
    upstream = Upstream()
    async with serve_asgi(upstream) as up_port:
        closed_port = free_port()
        ports = {49983: up_port, 8080: up_port, 9999: closed_port}

        def port_map(port: int) -> int:
            return ports.get(port, closed_port)

        sandboxes = Sandboxes({
            "abc": Resolution(host="127.0.0.1", port_map=port_map),
            "sec": Resolution(host="127.0.0.1", port_map=port_map, traffic_token=TRAFFIC_TOKEN),
            "gone": None,
            "deleted": NotFound("sandbox deleted not found"),
            "draining": NodeDraining(),
            "broken": RuntimeError("resolver bug"),
        })
        async with SandboxProxy(node_app(), sandboxes.resolve, DOMAIN) as proxy, serve_proxy(proxy) as port:
            yield ProxyEnv(f"http://127.0.0.1:{port}", up_port, closed_port, upstream.state, sandboxes, proxy)
