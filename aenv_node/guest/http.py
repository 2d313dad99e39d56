"""A small HTTP/1.1 server on Trio and h11, made for envd's traffic.

Why hand-written: envd needs request bodies streamed in (chunked Connect
client streams, large uploads), response bodies streamed out (process output,
watch events, downloads), keep-alive, and to notice a client that went away
while a response stream is idle. The ASGI servers do all of this but cost far
more import time than a guest booting under emulation can spare, and h11 (a
sans-IO parser) leaves only the socket loop to write.

One connection is served by one task; requests on it are handled in turn
(HTTP/1.1 has no multiplexing). The application is a single coroutine
``app(request)`` that must answer through the :class:`Request` methods.
"""

from __future__ import annotations

import logging
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import Any

import h11
import trio

log = logging.getLogger("envd.http")

_READ_SIZE = 256 * 1024
# Unread request body we are willing to drain to keep a connection alive.
_DRAIN_LIMIT = 8 * 1024 * 1024


class ClientDisconnected(Exception):
    """The client closed the connection before the exchange finished."""


class Request:
    """One HTTP request on a connection, and the means to answer it."""

    def __init__(self, conn: "_Connection", event: h11.Request) -> None:
        self._conn = conn
        self.method: str = event.method.decode("ascii")
        self.target: str = event.target.decode("latin-1")
        parsed = urllib.parse.urlsplit(self.target)
        self.path: str = parsed.path
        self.query: dict[str, str] = {}
        for key, value in urllib.parse.parse_qsl(parsed.query, keep_blank_values=True):
            self.query.setdefault(key, value)
        # Header names lower-cased; repeated headers keep every value in order.
        self.header_list: list[tuple[str, str]] = [
            (name.decode("latin-1").lower(), value.decode("latin-1"))
            for name, value in event.headers
        ]
        self.headers: dict[str, str] = {}
        for name, value in self.header_list:
            if name in self.headers:
                self.headers[name] += ", " + value
            else:
                self.headers[name] = value
        self.body_done = False
        # Added to whatever response is sent (e.g. CORS headers).
        self.extra_headers: list[tuple[str, str]] = []
        self.response_started = False
        self.response_done = False

    # ----- request body -------------------------------------------------
    async def receive_some(self) -> bytes:
        """Next piece of the request body; ``b""`` once it has all been read."""
        if self.body_done:
            return b""
        return await self._conn.receive_body(self)

    async def read_body(self, limit: int) -> bytes:
        """The whole body; raises ValueError past ``limit`` bytes."""
        parts: list[bytes] = []
        size = 0
        while True:
            chunk = await self.receive_some()
            if not chunk:
                return b"".join(parts)
            size += len(chunk)
            if size > limit:
                raise ValueError(f"request body larger than {limit} bytes")
            parts.append(chunk)

    # ----- response -----------------------------------------------------
    async def respond(
        self,
        status: int,
        headers: list[tuple[str, str]] | None = None,
        body: bytes = b"",
    ) -> None:
        """A complete response with a known length."""
        hdrs = list(headers or [])
        hdrs.append(("content-length", str(len(body))))
        await self.start_response(status, hdrs)
        if body:
            await self.send(body)
        await self.end_response()

    async def start_response(self, status: int, headers: list[tuple[str, str]]) -> None:
        """Send the status line and headers; the body follows with :meth:`send`.

        Without a content-length header the body is sent chunked.
        """
        if self.response_started:
            raise RuntimeError("response already started")
        self.response_started = True
        await self._conn.send_event(h11.Response(status_code=status, headers=[*headers, *self.extra_headers]))

    async def send(self, data: bytes) -> None:
        if data:
            await self._conn.send_event(h11.Data(data=data))

    async def end_response(self) -> None:
        self.response_done = True
        await self._conn.send_event(h11.EndOfMessage())


App = Callable[[Request], Awaitable[None]]


class _Connection:
    def __init__(self, stream: trio.SocketStream, app: App) -> None:
        self.stream = stream
        self.app = app
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=64 * 1024)
        self._pending: list[bytes] = []  # bytes read by the disconnect watcher
        self._body_read = trio.Event()
        self._app_scope: trio.CancelScope | None = None
        self.client_gone = False

    async def _fill(self) -> None:
        if self._pending:
            data = b"".join(self._pending)
            self._pending.clear()
        else:
            try:
                data = await self.stream.receive_some(_READ_SIZE)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                data = b""
        self.h11.receive_data(data)

    async def next_event(self) -> Any:
        while True:
            event = self.h11.next_event()
            if event is h11.NEED_DATA:
                if self.h11.they_are_waiting_for_100_continue:
                    await self.send_event(
                        h11.InformationalResponse(status_code=100, headers=[])
                    )
                await self._fill()
                continue
            return event

    async def receive_body(self, request: Request) -> bytes:
        while True:
            try:
                event = await self.next_event()
            except h11.RemoteProtocolError as exc:
                raise ClientDisconnected(f"bad request body: {exc}") from exc
            if isinstance(event, h11.Data):
                if event.data:
                    return bytes(event.data)
                continue
            if isinstance(event, h11.EndOfMessage):
                request.body_done = True
                self._body_read.set()
                return b""
            if isinstance(event, h11.ConnectionClosed):
                raise ClientDisconnected("client closed the connection mid-body")
            raise ClientDisconnected(f"unexpected event {event!r}")

    async def send_event(self, event: Any) -> None:
        try:
            data = self.h11.send(event)
        except h11.LocalProtocolError as exc:
            raise RuntimeError(f"HTTP protocol misuse: {exc}") from exc
        if data:
            try:
                await self.stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                self.client_gone = True
                raise ClientDisconnected("client went away") from exc

    async def _watch_disconnect(self, app_scope: trio.CancelScope) -> None:
        """Once the request body is in, a read of EOF means the client left."""
        await self._body_read.wait()
        while True:
            try:
                data = await self.stream.receive_some(_READ_SIZE)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                data = b""
            if not data:
                self.client_gone = True
                app_scope.cancel()
                return
            self._pending.append(data)  # a pipelined request: keep it for later

    async def _run_app(self, request: Request) -> None:
        try:
            await self.app(request)
        except ClientDisconnected:
            self.client_gone = True
        except Exception:
            log.exception("unhandled error serving %s %s", request.method, request.path)
            if not request.response_started and not self.client_gone:
                body = b'{"code":500,"message":"internal server error"}'
                try:
                    await request.respond(500, [("content-type", "application/json")], body)
                except ClientDisconnected:
                    self.client_gone = True

    async def serve(self) -> None:
        try:
            while True:
                try:
                    event = await self.next_event()
                except h11.RemoteProtocolError as exc:
                    await self._reject(exc)
                    return
                if isinstance(event, h11.ConnectionClosed):
                    return
                if not isinstance(event, h11.Request):
                    return
                request = Request(self, event)
                self._body_read = trio.Event()
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._watch_disconnect, nursery.cancel_scope)
                    await self._run_app(request)
                    nursery.cancel_scope.cancel()
                if self.client_gone:
                    return
                if not request.response_done:
                    # The app failed after starting a response: nothing sane to add.
                    return
                if not await self._drain(request):
                    return
                if self.h11.our_state is h11.MUST_CLOSE or self.h11.their_state is h11.MUST_CLOSE:
                    return
                try:
                    self.h11.start_next_cycle()
                except h11.LocalProtocolError:
                    return
        finally:
            with trio.CancelScope(shield=True):
                await self.stream.aclose()

    async def _drain(self, request: Request) -> bool:
        drained = 0
        while not request.body_done:
            try:
                chunk = await request.receive_some()
            except ClientDisconnected:
                return False
            drained += len(chunk)
            if drained > _DRAIN_LIMIT:
                return False
        return True

    async def _reject(self, exc: Exception) -> None:
        if self.h11.our_state is not h11.IDLE and self.h11.our_state is not h11.SEND_RESPONSE:
            return
        body = f'{{"code":400,"message":"bad request: {exc}"}}'.encode()
        try:
            await self.send_event(
                h11.Response(
                    status_code=400,
                    headers=[("content-type", "application/json"),
                             ("content-length", str(len(body))),
                             ("connection", "close")],
                )
            )
            await self.send_event(h11.Data(data=body))
            await self.send_event(h11.EndOfMessage())
        except (ClientDisconnected, RuntimeError):
            pass


async def serve_connection(stream: trio.SocketStream, app: App) -> None:
    """Serve HTTP/1.1 requests on one accepted connection until it closes."""
    await _Connection(stream, app).serve()
