"""WebSocket relay for sandbox traffic: one upstream WebSocket per client WebSocket.

Hypercorn completes the client's handshake and hands us whole messages; we
open the upstream connection first (so a refused port or a rejecting guest
server is answered with an HTTP status, via the ASGI ``websocket.http.response``
extension, instead of an accepted-then-closed socket), accept the client with
the subprotocol the guest chose, then pump messages both ways until either
side closes. Close codes travel in both directions as far as the ASGI server
reports them (Hypercorn 0.18 reports a client-initiated close as 1006 or 1000,
not the client's own code; the guest's code reaches the client exactly).

trio-websocket is the client: Trio-native, maintained, built on wsproto (which
Hypercorn uses too), with proper close handshakes and ping handling.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import trio
from trio_websocket import (
    ConnectionClosed,
    ConnectionRejected,
    ConnectionTimeout,
    HandshakeError,
    WebSocketConnection,
    open_websocket,
)

from .traffic import (
    PORT_NOT_OPEN_MESSAGE,
    ProxyReject,
    Receive,
    Scope,
    Send,
    Target,
    check_traffic_token,
    connect_backoff,
    forwardable,
    not_found_message,
    resolve,
)

if TYPE_CHECKING:
    from .proxy import SandboxProxy

__all__ = ["proxy_websocket"]

log = logging.getLogger(__name__)

# Set by the WebSocket client library or negotiated separately.
_WS_OWN = frozenset({
    b"host", b"sec-websocket-key", b"sec-websocket-version", b"sec-websocket-extensions",
    b"sec-websocket-protocol", b"sec-websocket-accept", b"content-length",
})
# Codes that must never appear on the wire (RFC 6455 7.4.1).
_LOCAL_ONLY = frozenset({1005, 1006, 1015})


def _wire_code(code: int | None) -> int:
    if code is None or code in _LOCAL_ONLY or not 1000 <= code <= 4999:
        return 1000
    return code


async def proxy_websocket(proxy: SandboxProxy, scope: Scope, receive: Receive, send: Send,
                          target: Target) -> None:
    message = await receive()
    if message["type"] != "websocket.connect":
        return
    headers = scope["headers"]
    try:
        resolution = await resolve(proxy.resolver, target)
        check_traffic_token(resolution, target, headers)
    except ProxyReject as exc:
        await proxy._reject("websocket", send, exc)
        return

    resource = (scope.get("raw_path") or scope["path"].encode()).decode("latin-1")
    if scope.get("query_string"):
        resource += "?" + scope["query_string"].decode("latin-1")
    port = resolution.upstream_port(target.port)
    accepted = False
    attempt = 1
    async with proxy._session(target.sandbox_id) as (session, _pool):
        while True:
            try:
                async with open_websocket(
                    resolution.host, port, resource, use_ssl=False,
                    subprotocols=scope.get("subprotocols") or None,
                    extra_headers=forwardable(headers, drop=_WS_OWN),
                    max_message_size=proxy.websocket_max_message,
                    connect_timeout=proxy.connect_timeout,
                    disconnect_timeout=5,
                ) as upstream:
                    await send({"type": "websocket.accept", "subprotocol": upstream.subprotocol})
                    accepted = True
                    await _relay(upstream, receive, send)
                break
            except HandshakeError as exc:
                if accepted:  # e.g. the guest did not finish the close handshake in time
                    log.debug("sandbox %s port %d websocket close: %r", target.sandbox_id, target.port, exc)
                    return
                if isinstance(exc, ConnectionRejected):
                    await _relay_rejection(exc, send)
                    return
                if not isinstance(exc, ConnectionTimeout) and attempt < resolution.connect_attempts:
                    await connect_backoff(attempt)  # nothing reached the guest yet: retry is safe
                    attempt += 1
                    continue
                log.debug("sandbox %s port %d websocket: %r (%r)", target.sandbox_id, target.port, exc,
                          exc.__cause__)
                await proxy._reject("websocket", send, ProxyReject(502, PORT_NOT_OPEN_MESSAGE))
                return
    if session.cancelled_caught:  # proxy.disconnect(): the sandbox went away
        if accepted:
            await send({"type": "websocket.close", "code": 1001, "reason": "the sandbox went away"})
        else:
            await proxy._reject("websocket", send, ProxyReject(502, not_found_message(target.sandbox_id)))


async def _relay_rejection(exc: ConnectionRejected, send: Send) -> None:
    """The guest refused the upgrade with an HTTP response: pass it on as is."""
    body = exc.body or b""
    response_headers = forwardable(exc.headers or (), drop=frozenset({b"content-length"}))
    response_headers.append((b"content-length", str(len(body)).encode()))
    await send({"type": "websocket.http.response.start", "status": exc.status_code, "headers": response_headers})
    await send({"type": "websocket.http.response.body", "body": body, "more_body": False})


async def _relay(upstream: WebSocketConnection, receive: Receive, send: Send) -> None:
    async with trio.open_nursery() as nursery:

        async def client_to_upstream() -> None:
            while True:
                message = await receive()
                if message["type"] == "websocket.receive":
                    data = message.get("bytes")
                    try:
                        await upstream.send_message(data if data is not None else message.get("text") or "")
                    except ConnectionClosed:
                        return  # the other direction reports the guest's close
                elif message["type"] == "websocket.disconnect":
                    code = _wire_code(message.get("code"))
                    with trio.move_on_after(5):
                        await upstream.aclose(code, message.get("reason"))
                    nursery.cancel_scope.cancel()
                    return

        nursery.start_soon(client_to_upstream)
        while True:
            try:
                data = await upstream.get_message()
            except ConnectionClosed as closed:
                reason = closed.reason
                await send({"type": "websocket.close", "code": _wire_code(reason.code if reason else None),
                            "reason": (reason.reason if reason else None) or ""})
                nursery.cancel_scope.cancel()
                return
            if isinstance(data, bytes):
                await send({"type": "websocket.send", "bytes": data})
            else:
                await send({"type": "websocket.send", "text": data})
