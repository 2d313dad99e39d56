"""A limit on a request's head: its headers, counted and measured before any handler or the proxy sees them.

Hypercorn bounds only a head that arrives incomplete (h11's ``max_incomplete_event_size``): a whole head sent
at once, of any size, is parsed and handed on, so a client could make every handler (and the sandbox traffic
proxy, which forwards headers to a guest) carry megabytes of headers per request. This wrapper refuses a head
over ``MAX_HEADER_BYTES`` or ``MAX_HEADERS`` with 431 in the E2B error shape before the app runs.
"""

from __future__ import annotations

from .traffic import ASGIApp, Receive, Scope, Send, error_body

__all__ = ["MAX_HEADERS", "MAX_HEADER_BYTES", "limit_request_head"]

#: all header names and values of one request together (nginx's default large buffers hold 4 x 8 KiB)
MAX_HEADER_BYTES = 32 * 1024
#: headers in one request
MAX_HEADERS = 128


def limit_request_head(app: ASGIApp) -> ASGIApp:
    """``app`` behind the head limits (HTTP and WebSocket requests alike)."""

    async def limited(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await app(scope, receive, send)
            return
        headers = scope.get("headers") or []
        size = sum(len(k) + len(v) for k, v in headers)
        if len(headers) <= MAX_HEADERS and size <= MAX_HEADER_BYTES:
            await app(scope, receive, send)
            return
        message = (f"request headers too large: {len(headers)} headers, {size} bytes; at most {MAX_HEADERS} "
                   f"headers of {MAX_HEADER_BYTES} bytes together")
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1009, "reason": "request headers too large"})
            return
        body = error_body(431, message)
        await send({"type": "http.response.start", "status": 431,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})

    return limited
