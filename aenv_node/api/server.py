"""The API server as a supervisor service: Hypercorn serving the Quart app (and the traffic proxy).

The sandbox service is passed in (``ApiServer(node, sandboxes=service)``), not looked up among the
node's services: without one the server answers the state-only routes and the lifecycle routes'
501, and proxies no sandbox traffic.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Optional, cast

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve

from ..runtime import Node
from .app import create_app
from .context import SandboxService
from .listener import serve_with_relay
from .proxy import ASGIApp, Resolution, Resolver, SandboxProxy
from .request_head import limit_request_head
from .traffic import Message, Receive, Scope, Send

__all__ = ["ApiServer", "api_hypercorn_config", "serve_api", "shield_last_send"]

log = logging.getLogger(__name__)


#: a sandbox that started running (created, resumed, forked) this recently gets its refused connections
#: retried (100 ms, 200 ms, ... apart: 2.8 s in all), as E2B's proxy does while a restored guest's network
#: comes back; later, a refused connection is a closed port at once
JUST_RESTORED_S = 10.0
JUST_RESTORED_ATTEMPTS = 8


def shield_last_send(app: ASGIApp) -> ASGIApp:
    """``app`` whose last message of a response is sent shielded from cancellation.

    Hypercorn runs its end-of-response bookkeeping (recycle the connection for the next request, or close it)
    inside that send. Quart-trio cancels its request nursery as soon as the request's messages end, which,
    when it answered before reading the body (a 401, a 405, a 413), is right then: the bookkeeping was cut
    and the connection stayed open answering nothing, so a keep-alive client's next request on it hung.
    """

    async def shielded(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return

        async def send_last_shielded(message: Message) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                with trio.CancelScope(shield=True):
                    await send(message)
            else:
                await send(message)

        await app(scope, receive, send_last_shielded)

    return shielded


def sandbox_resolver(sandboxes: SandboxService) -> Resolver:
    """The proxy's resolver over the sandbox service (which resumes an autoResume sandbox first and
    raises ``SandboxNotRunning`` for one that does not run)."""

    async def resolve(sandbox_id: str, port: int) -> Resolution:
        handle = await sandboxes.resolve(sandbox_id, port)
        fresh = time.monotonic() - handle.started_at < JUST_RESTORED_S
        return Resolution(host=handle.address, access_token=handle.access_token,
                          traffic_token=handle.traffic_token,
                          connect_attempts=JUST_RESTORED_ATTEMPTS if fresh else 1)

    return resolve


def api_hypercorn_config(listen: str, graceful_timeout: float | None = None) -> HypercornConfig:
    """Hypercorn's settings for the node's API and traffic listener, and the gateway's (``graceful_timeout``:
    None keeps Hypercorn's)."""
    hc = HypercornConfig()
    hc.bind = [listen]
    hc.accesslog = None
    hc.errorlog = logging.getLogger("hypercorn.error")
    if graceful_timeout is not None:
        hc.graceful_timeout = graceful_timeout
    hc.keep_alive_timeout = 75
    hc.read_timeout = None  # proxied Connect streams and idle stdin streams stay open
    hc.include_server_header = False
    return hc


async def serve_api(asgi: ASGIApp, proxy: SandboxProxy | None, hc: HypercornConfig, *,
                    shutdown_trigger: Callable[[], Awaitable[None]],
                    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve the API (``asgi``) and, with a ``proxy``, sandbox traffic, until ``shutdown_trigger`` returns
    (then finish what is in flight, for up to ``hc.graceful_timeout``). What the node runs, and what
    bench/proxy_overhead.py measures."""
    # both are ASGI apps (hypercorn's typing knows Quart's only); the head limits apply to both
    app: Any = limit_request_head(proxy or asgi)
    if proxy is None or hc.ssl_enabled or any(bind.startswith(("unix:", "fd://")) for bind in hc.bind):
        await serve(app, hc, shutdown_trigger=shutdown_trigger, task_status=task_status)
    else:  # sandbox traffic takes the raw relay where it can (listener.py, relay.py)
        await serve_with_relay(app, proxy, hc, shutdown_trigger=shutdown_trigger, task_status=task_status)


class ApiServer:
    """Serves the E2B API; stops accepting once the node has drained (``node.drained``: until then new
    operations get 503) and finishes the requests in flight."""

    name = "api"

    def __init__(self, node: Node, sandboxes: Optional[SandboxService] = None) -> None:
        self.node = node
        self.app = create_app(node, sandboxes=sandboxes)
        self.asgi = shield_last_send(cast(ASGIApp, self.app))
        self.bound: list[str] = []
        self.proxy: SandboxProxy | None = None
        if sandboxes is not None:
            self.proxy = SandboxProxy(self.asgi, sandbox_resolver(sandboxes), node.cfg.api.domain)
            sandboxes.stopped_hooks.append(self.proxy.disconnect)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        hc = api_hypercorn_config(self.node.cfg.api.listen, min(self.node.cfg.node.shutdown_grace_s, 30.0))
        async with contextlib.AsyncExitStack() as stack:
            if self.proxy is not None:
                await stack.enter_async_context(self.proxy)
            nursery = await stack.enter_async_context(trio.open_nursery())
            self.bound = await nursery.start(
                lambda task_status: serve_api(self.asgi, self.proxy, hc, shutdown_trigger=self.node.drained.wait,
                                              task_status=task_status)
            )
            log.info("API listening on %s", ", ".join(self.bound))
            task_status.started()
