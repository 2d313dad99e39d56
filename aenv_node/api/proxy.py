"""Sandbox traffic: an ASGI middleware that proxies requests into sandboxes.

The E2B SDK talks to envd through the same address as the control plane: with
``E2B_SANDBOX_URL`` pointing at the node it sends every envd request there with
``E2b-Sandbox-Id`` / ``E2b-Sandbox-Port`` headers; browsers and other clients
use a ``{port}-{sandboxID}.{domain}`` Host. ``SandboxProxy`` wraps the Quart
app, recognises such requests and forwards them to that port of that sandbox;
anything else reaches the app untouched.

Why at the ASGI level and not as Quart routes: a proxy needs true streaming in
both directions (Connect server streams that run for minutes, chunked uploads
without Content-Length, 16 MiB downloads) and prompt notice of a client that
went away. Quart buffers request bodies and owns the response lifecycle; raw
ASGI gives exact control of ``receive``/``send`` and Hypercorn's backpressure.

Why httpcore and not ``httpx.AsyncClient``: a proxy must not apply client
policy (cookie jar shared across sandboxes, redirects, decompression, default
headers). httpcore is httpx's own HTTP/1.1 engine without that layer: connection
pools, raw bytes both ways, cancellation-safe closing under Trio.

Connection pools are per sandbox, and ``disconnect(sandbox_id)`` (called by
the sandbox registry on kill, pause or slot release) cancels that sandbox's
exchanges and closes its pool: network slots are reused by other sandboxes,
so a connection must never outlive the sandbox it was opened to, and a stream
to a vanished guest would otherwise wait forever (reads have no timeout).
Connections to guests are kept alive by default (``keepalive=False`` opens one
per request): a new connection costs the proxy and the guest's server more CPU
than the small request it carries (bench/proxy_overhead.py). It is safe because
the pools are per sandbox and go with it (above), idle ones expire after
``keepalive_expiry``, and one the guest closed while idle is not reused.

The node's listener serves the common sandbox request without this class's
ASGI path, by a raw HTTP/1.1 relay (``relay.py``, using the same routing, token
check, errors and per-sandbox state); this class serves the rest: WebSockets
(relayed message by message in ``proxy_ws``), chunked uploads, and every
request of a connection that also carried one the relay leaves to Hypercorn.

Errors follow E2B's client-proxy wording because the SDK maps a 502 by its
message (e2b/exceptions.py): "... was not found" means the sandbox is not
running, "... port is not open" that it runs but nothing listens.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Self

import httpcore
import trio

from .proxy_ws import proxy_websocket
from .traffic import (
    PORT_NOT_OPEN_MESSAGE,
    TRAFFIC_TOKEN_HEADER,
    ASGIApp,
    Message,
    ProxyReject,
    Receive,
    Resolution,
    Resolver,
    SandboxNotRunning,
    Scope,
    Send,
    Target,
    check_traffic_token,
    connect_backoff,
    error_body,
    forwardable,
    header,
    not_found_message,
    resolve,
    route,
)

__all__ = [
    "TRAFFIC_TOKEN_HEADER",
    "PORT_NOT_OPEN_MESSAGE",
    "ASGIApp",
    "ProxyReject",
    "Resolution",
    "Resolver",
    "SandboxNotRunning",
    "SandboxProxy",
    "not_found_message",
    "route",
]

if TYPE_CHECKING:
    from .relay import IdleUpstream

log = logging.getLogger(__name__)

class _ReceivedBody:
    """The request body as an async iterator fed by the receive pump (no buffering)."""

    def __init__(self, channel: trio.MemoryReceiveChannel[bytes]) -> None:
        self._channel = channel

    def __aiter__(self) -> _ReceivedBody:
        return self

    async def __anext__(self) -> bytes:
        try:
            return await self._channel.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            raise StopAsyncIteration from None


@dataclass(eq=False)
class _SandboxTraffic:
    """What the proxy holds for one sandbox: its connection pools and in-flight exchanges.

    Two pools, one per path: ``pool`` (httpcore, made on first use) serves the ASGI path; ``idle`` holds the
    raw relay's (``relay.py``) kept-alive upstream connections, newest last.
    """

    keepalive: bool
    keepalive_expiry: float
    scopes: set[trio.CancelScope] = field(default_factory=set)
    idle: list[IdleUpstream] = field(default_factory=list)
    _pool: httpcore.AsyncConnectionPool | None = None

    @property
    def pool(self) -> httpcore.AsyncConnectionPool:
        if self._pool is None:
            self._pool = httpcore.AsyncConnectionPool(
                max_connections=None,
                max_keepalive_connections=64 if self.keepalive else 0,
                keepalive_expiry=self.keepalive_expiry,
                retries=0,
            )
        return self._pool

    async def aclose(self) -> None:
        idle, self.idle = self.idle, []
        for upstream in idle:
            upstream.sock.close()  # nothing to flush on an idle connection
        if self._pool is not None:
            await self._pool.aclose()


class SandboxProxy:
    """ASGI middleware: sandbox traffic is proxied, everything else goes to ``app``.

    ``resolver(sandbox_id, port)`` returns a Resolution or raises
    SandboxNotRunning; it resumes a paused autoResume sandbox before returning.
    Use as an async context manager (or call ``aclose``) to close the
    connection pool when the server stops.
    """

    def __init__(
        self,
        app: ASGIApp,
        resolver: Resolver,
        domain: str = "",
        *,
        connect_timeout: float = 5.0,
        keepalive: bool = True,
        keepalive_expiry: float = 30.0,
        websocket_max_message: int = 16 * 1024 * 1024,
    ) -> None:
        self.app = app
        self.resolver = resolver
        self.domain = domain.strip(".").lower()
        self.connect_timeout = connect_timeout
        self.websocket_max_message = websocket_max_message
        self.keepalive = keepalive
        self.keepalive_expiry = keepalive_expiry
        self._sandboxes: dict[str, _SandboxTraffic] = {}
        self._closing: set[_SandboxTraffic] = set()
        self._pruned = 0.0

    async def disconnect(self, sandbox_id: str) -> int:
        """Cut every proxied request and WebSocket of a sandbox; returns how many.

        The sandbox registry calls this when a sandbox is killed or paused or its
        network slot is released: without it a stream to a vanished guest would
        wait forever (reads have no timeout, on purpose), and pooled keep-alive
        connections could reach whichever sandbox gets the slot next. A request
        cut before its response started is answered 502 "... was not found"; a
        started response is broken off; a WebSocket is closed with 1001.
        """
        traffic = self._sandboxes.pop(sandbox_id, None)
        if traffic is None:
            return 0
        count = len(traffic.scopes)
        for scope in traffic.scopes:
            scope.cancel()
        if traffic.scopes:
            self._closing.add(traffic)  # the last request to leave closes the pool
        else:
            await traffic.aclose()
        return count

    def active(self, sandbox_id: str) -> int:
        """Proxied requests and WebSockets of a sandbox in flight now."""
        traffic = self._sandboxes.get(sandbox_id)
        return len(traffic.scopes) if traffic is not None else 0

    def tracked(self) -> int:
        """Sandboxes with traffic state held (in-flight requests or pooled connections)."""
        return len(self._sandboxes)

    def _enter(self, sandbox_id: str) -> tuple[_SandboxTraffic, trio.CancelScope]:
        """Start one proxied exchange: its cancel scope (``disconnect`` cancels it; the caller enters it) and
        the sandbox's pools. End it with ``_leave``."""
        traffic = self._sandboxes.get(sandbox_id)
        if traffic is None:
            traffic = self._sandboxes[sandbox_id] = _SandboxTraffic(self.keepalive, self.keepalive_expiry)
        scope = trio.CancelScope()
        traffic.scopes.add(scope)
        return traffic, scope

    def _leave_needs_close(self, sandbox_id: str, traffic: _SandboxTraffic, scope: trio.CancelScope) -> bool:
        """``_leave`` without awaiting when it has nothing to close (the common case); True when it has: then
        call ``_leave`` (shielded)."""
        if len(traffic.scopes) > 1 or (traffic not in self._closing and (
                self.keepalive or self._sandboxes.get(sandbox_id) is not traffic)):
            traffic.scopes.discard(scope)
            return False
        return True

    async def _leave(self, sandbox_id: str, traffic: _SandboxTraffic, scope: trio.CancelScope) -> None:
        """End an exchange started by ``_enter`` (call it shielded). Pools are per sandbox so that a
        connection never outlives the sandbox it was opened to (slots are reused); without keep-alive a
        sandbox's entry goes away with its last request."""
        traffic.scopes.discard(scope)
        if not traffic.scopes:
            if traffic in self._closing:
                self._closing.discard(traffic)
                await traffic.aclose()
            elif not self.keepalive and self._sandboxes.get(sandbox_id) is traffic:
                del self._sandboxes[sandbox_id]
                await traffic.aclose()

    @asynccontextmanager
    async def _session(self, sandbox_id: str) -> AsyncIterator[tuple[trio.CancelScope, _SandboxTraffic]]:
        """One proxied exchange of the ASGI path: ``_enter`` and ``_leave`` around the block."""
        traffic, scope = self._enter(sandbox_id)
        try:
            with scope:
                yield scope, traffic
        finally:
            with trio.CancelScope(shield=True):
                await self._leave(sandbox_id, traffic, scope)

    def maybe_prune(self, now: float) -> None:
        """``prune_idle`` at most once a second (the raw relay calls it as it returns connections)."""
        if now - self._pruned >= 1.0:
            self._pruned = now
            self.prune_idle(now)

    def prune_idle(self, now: float) -> None:
        """Close the raw relay's idle upstream connections older than ``keepalive_expiry`` (every sandbox's),
        and forget sandboxes left with nothing: a sandbox that had a burst of traffic once does not keep its
        sockets open until it is paused or killed."""
        for sandbox_id, traffic in list(self._sandboxes.items()):
            if traffic.idle:
                keep = [u for u in traffic.idle if now - u.since < self.keepalive_expiry]
                for upstream in traffic.idle:
                    if now - upstream.since >= self.keepalive_expiry:
                        upstream.sock.close()
                traffic.idle = keep
            if not traffic.idle and not traffic.scopes and traffic._pool is None:
                del self._sandboxes[sandbox_id]

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close every pooled connection (call once the server stopped)."""
        with trio.CancelScope(shield=True):
            for traffic in [*self._sandboxes.values(), *self._closing]:
                await traffic.aclose()
        self._sandboxes.clear()
        self._closing.clear()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        try:
            target = route(scope["headers"], self.domain)
        except ProxyReject as exc:
            await self._reject(kind, send, exc)
            return
        if target is None:
            await self.app(scope, receive, send)
            return
        await self.forward(scope, receive, send, target)

    async def forward(self, scope: Scope, receive: Receive, send: Send, target: Target) -> None:
        """Proxy one HTTP exchange or WebSocket to ``target`` as the resolver places it, whatever its headers
        say (the cluster's gateway forwards API requests to a node this way)."""
        if scope["type"] == "http":
            await self._proxy_http(scope, receive, send, target)
        else:
            await proxy_websocket(self, scope, receive, send, target)

    async def _reject(self, kind: str, send: Send, exc: ProxyReject) -> None:
        body = error_body(exc.status, exc.message)
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        prefix = "http" if kind == "http" else "websocket.http"
        await send({"type": f"{prefix}.response.start", "status": exc.status, "headers": headers})
        await send({"type": f"{prefix}.response.body", "body": body, "more_body": False})

    # ----- HTTP ---------------------------------------------------------------

    async def _proxy_http(self, scope: Scope, receive: Receive, send: Send, target: Target) -> None:
        headers: list[tuple[bytes, bytes]] = scope["headers"]
        try:
            resolution = await resolve(self.resolver, target)
            check_traffic_token(resolution, target, headers)
        except ProxyReject as exc:
            await self._reject("http", send, exc)
            return

        body_send, body_recv = trio.open_memory_channel[bytes](0)
        has_body = header(headers, b"content-length") not in (None, "0") or \
            header(headers, b"transfer-encoding") is not None
        started = False

        async def send_tracked(message: Message) -> None:
            nonlocal started
            started = True
            await send(message)

        async with self._session(target.sandbox_id) as (session, traffic):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._pump_request, receive, body_send, has_body, nursery.cancel_scope)
                try:
                    await self._forward(scope, send_tracked, target, resolution, traffic.pool,
                                        body_recv if has_body else None)
                finally:
                    # Response done (or failed): stop feeding the upstream; the pump
                    # ends with the nursery (Hypercorn closes a connection whose
                    # request was not fully read).
                    body_recv.close()
                    nursery.cancel_scope.cancel()
        if session.cancelled_caught and not started:
            await self._reject("http", send, ProxyReject(502, not_found_message(target.sandbox_id)))

    async def _pump_request(self, receive: Receive, body_send: trio.MemorySendChannel[bytes],
                            has_body: bool, cancel_scope: trio.CancelScope) -> None:
        """Move request body chunks to the upstream; cancel everything on client disconnect."""
        async with body_send:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    log.debug("client went away: cancelling the upstream request")
                    cancel_scope.cancel()
                    return
                if message["type"] != "http.request":
                    continue
                chunk = message.get("body", b"")
                if chunk and has_body:
                    try:
                        await body_send.send(chunk)
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        has_body = False  # upstream stopped reading (it answered early): drain
                if not message.get("more_body", False):
                    break
        # The request is complete; keep listening only for the disconnect.
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                cancel_scope.cancel()
                return

    async def _forward(self, scope: Scope, send: Send, target: Target, resolution: Resolution,
                       pool: httpcore.AsyncConnectionPool,
                       body: trio.MemoryReceiveChannel[bytes] | None) -> None:
        in_headers: list[tuple[bytes, bytes]] = scope["headers"]
        out_headers = forwardable(in_headers, drop=frozenset({b"content-length", b"host"}))
        host = header(in_headers, b"host")
        port = resolution.upstream_port(target.port)
        out_headers.insert(0, (b"host", (host or f"{resolution.host}:{port}").encode("latin-1")))
        content: Any = None
        if body is not None:
            length = header(in_headers, b"content-length")
            if length is not None:
                out_headers.append((b"content-length", length.encode()))
            else:
                out_headers.append((b"transfer-encoding", b"chunked"))
            content = _ReceivedBody(body)
        elif scope["method"] in ("POST", "PUT", "PATCH"):
            out_headers.append((b"content-length", b"0"))
        path = scope.get("raw_path") or scope["path"].encode()
        if scope.get("query_string"):
            path += b"?" + scope["query_string"]
        request = httpcore.Request(
            scope["method"],
            httpcore.URL(scheme=b"http", host=resolution.host.encode(), port=port, target=path),
            headers=out_headers,
            content=content,
            extensions={"timeout": {"connect": self.connect_timeout, "read": None,
                                    "write": None, "pool": None}},
        )
        attempt = 1
        while True:
            try:
                response = await pool.handle_async_request(request)
                break
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                # Nothing was sent yet (the body is untouched): a retry is safe.
                if isinstance(exc, httpcore.ConnectError) and attempt < resolution.connect_attempts:
                    await connect_backoff(attempt)
                    attempt += 1
                    continue
                log.debug("sandbox %s port %d: %r", target.sandbox_id, target.port, exc)
                await self._reject("http", send, ProxyReject(502, PORT_NOT_OPEN_MESSAGE))
                return
            except (httpcore.ProtocolError, httpcore.NetworkError, httpcore.TimeoutException) as exc:
                log.info("sandbox %s port %d failed before answering: %r", target.sandbox_id, target.port, exc)
                await self._reject("http", send, ProxyReject(
                    502, f"The sandbox {target.sandbox_id} closed the connection on port {target.port} "
                         "before answering"))
                return
        if body is not None:
            body.close()
        try:
            await send({
                "type": "http.response.start",
                "status": response.status,
                # lower-case names: HTTP/2 clients (h2c) require them
                "headers": [(k.lower(), v) for k, v in forwardable(response.headers, drop=frozenset({b"date"}))],
            })
            async for chunk in response.aiter_stream():
                if chunk:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except (httpcore.ProtocolError, httpcore.NetworkError) as exc:
            # Status already sent: all that is left is to end without completing
            # the response, so Hypercorn cuts the client's connection and the
            # client sees a truncated body, not a complete one.
            log.info("sandbox %s port %d broke off its response: %r", target.sandbox_id, target.port, exc)
            return
        finally:
            # Before completing the client's response: the upstream connection
            # must be back in the pool when the client's next request arrives.
            await response.aclose()
        await send({"type": "http.response.body", "body": b"", "more_body": False})
