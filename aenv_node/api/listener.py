"""The node's listener: each connection is offered to the raw sandbox-traffic relay first, then to Hypercorn.

``hypercorn.trio.serve`` owns its accept loop and gives no hook before a connection reaches its HTTP
machinery, so this module runs the accept loop itself, with Hypercorn's own pieces for the rest: its
``Lifespan`` for the app's start-up and shut-down, its ``TCPServer`` for every connection the relay hands
over (with the bytes the relay read replayed first), its ``WorkerContext`` for the graceful shutdown. It
follows ``hypercorn.trio.run.worker_serve`` (Hypercorn 0.17-0.18): stop accepting when the shutdown trigger
returns, let idle connections close, give the rest ``graceful_timeout``.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, cast

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio.lifespan import Lifespan
from hypercorn.trio.statsd import StatsdLogger
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import ConnectionState, LifespanState
from hypercorn.utils import repr_socket_addr, wrap_app

from .proxy import SandboxProxy
from .relay import Connections, relay_connection
from .traffic import ASGIApp

__all__ = ["serve_with_relay"]

log = logging.getLogger(__name__)


class _Replayed(trio.abc.HalfCloseableStream):
    """A client connection whose first bytes were already read (by the relay): they come first again."""

    def __init__(self, stream: trio.SocketStream, first: bytes) -> None:
        self.stream = stream
        self.socket = stream.socket  # Hypercorn reads the peer's address from it
        self.first = first

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if self.first:
            data, self.first = self.first, b""
            await trio.lowlevel.checkpoint()
            return data
        return bytes(await self.stream.receive_some(max_bytes))

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self.stream.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.stream.wait_send_all_might_not_block()

    async def send_eof(self) -> None:
        await self.stream.send_eof()

    async def aclose(self) -> None:
        await self.stream.aclose()


async def serve_with_relay(app: ASGIApp, proxy: SandboxProxy, hc: HypercornConfig, *,
                           shutdown_trigger: Callable[[], Awaitable[None]],
                           task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve ``app`` with Hypercorn on ``hc``'s plain TCP binds, sandbox requests going through the relay."""
    hc.set_statsd_logger_class(StatsdLogger)
    wrapped = wrap_app(cast(Any, app), hc.wsgi_max_body_size, None)
    lifespan_state: LifespanState = {}
    lifespan = Lifespan(wrapped, hc, lifespan_state)
    context = WorkerContext(None)
    connections = Connections(hc.keep_alive_timeout)

    async def handle(stream: trio.SocketStream) -> None:
        try:
            rest = await relay_connection(proxy, stream, connections)
        except Exception:  # a bug must cost one connection, not the listener
            log.exception("sandbox traffic relay failed")
            rest = None
        if rest is None:
            await stream.aclose()
            return
        await TCPServer(wrapped, hc, context, ConnectionState(lifespan_state.copy()),
                        cast(Any, _Replayed(stream, rest)))

    async with trio.open_nursery() as lifespan_nursery:
        await lifespan_nursery.start(lifespan.handle_lifespan)
        await lifespan.wait_for_startup()
        async with trio.open_nursery() as server_nursery:
            sockets = hc.create_sockets()
            listeners = []
            binds = []
            for sock in sockets.insecure_sockets:
                sock.listen(hc.backlog)
                listeners.append(trio.SocketListener(trio.socket.from_stdlib_socket(sock)))
                binds.append(f"http://{repr_socket_addr(sock.family, sock.getsockname())}")
            task_status.started(binds)
            try:
                async with trio.open_nursery() as accepting:
                    accepting.start_soon(connections.tend)
                    accepting.start_soon(partial(trio.serve_listeners, handle, listeners,
                                                 handler_nursery=server_nursery))
                    await shutdown_trigger()
                    accepting.cancel_scope.cancel()
            finally:
                connections.close()  # relayed connections waiting for a request end now, busy ones after it
                await context.terminated.set()  # Hypercorn's idle connections too
                server_nursery.cancel_scope.deadline = trio.current_time() + hc.graceful_timeout
        await lifespan.wait_for_shutdown()
        lifespan_nursery.cancel_scope.cancel()
