"""The Connect protocol (v1, JSON codec) on top of :mod:`.http`.

Why hand-written: the wire format is tiny (JSON bodies for unary calls, 5-byte
envelopes for streams, an end-of-stream message carrying the error), while the
Python Connect server stack (connectrpc + protobuf) would cost import time
and a compiled protobuf runtime inside every guest. Messages are plain dicts
in proto3 JSON form (lowerCamel names, bytes in base64, enums by name).

Three call shapes are served, exactly those the envd services use:
unary, server streaming (Start, Connect, WatchDir) and client streaming
(StreamInput).
"""

from __future__ import annotations

import json
import logging
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import trio

from .errors import ConnectError
from .http import ClientDisconnected, Request

log = logging.getLogger("envd.connect")

Message = dict[str, Any]
_MAX_MESSAGE = 64 * 1024 * 1024
_FLAG_COMPRESSED = 0x01
_FLAG_END_STREAM = 0x02
_FRAME_WRITE_TIMEOUT = 60.0


@dataclass
class CallContext:
    """What a handler may know about the call besides its message."""

    request: Request
    # Absolute trio deadline from Connect-Timeout-Ms, or inf.
    deadline: float
    timeout_ms: int | None

    @property
    def headers(self) -> dict[str, str]:
        return self.request.headers

    def keepalive_interval(self) -> float | None:
        """Seconds between keepalive events the client asked for, if any."""
        raw = self.request.headers.get("keepalive-ping-interval")
        if not raw:
            return None
        try:
            value = float(raw)
        except ValueError:
            return None
        return value if value > 0 else None


class ServerStream:
    """The sending half of a server-streaming call."""

    def __init__(self, request: Request) -> None:
        self._request = request
        self.started = False

    async def _start(self) -> None:
        if not self.started:
            self.started = True
            await self._request.start_response(
                200, [("content-type", "application/connect+json")]
            )

    async def send(self, message: Message) -> None:
        await self._write(encode_envelope(0, message))

    async def finish(self, error: ConnectError | None) -> None:
        end: Message = {}
        if error is not None:
            end["error"] = error.to_json()
        await self._write(encode_envelope(_FLAG_END_STREAM, end), last=True)

    async def _write(self, frame: bytes, last: bool = False) -> None:
        # A frame is written whole or the connection is given up: a cancellation
        # (deadline, shutdown) in the middle of one would corrupt the stream.
        # Once started, a write gets a bounded time of its own to finish.
        await trio.lowlevel.checkpoint_if_cancelled()
        with trio.CancelScope(shield=True):
            with trio.move_on_after(_FRAME_WRITE_TIMEOUT) as scope:
                await self._start()
                await self._request.send(frame)
                if last:
                    await self._request.end_response()
        if scope.cancelled_caught:
            raise ClientDisconnected("client stopped reading the stream")


Unary = Callable[[CallContext, Message], Awaitable[Message]]
ServerStreaming = Callable[[CallContext, Message, ServerStream], Awaitable[None]]
ClientStreaming = Callable[[CallContext, AsyncIterator[Message]], Awaitable[Message]]


@dataclass(frozen=True)
class Method:
    kind: str  # "unary" | "server_stream" | "client_stream"
    handler: Callable[..., Awaitable[Any]]


def encode_envelope(flags: int, message: Message) -> bytes:
    payload = json.dumps(message, separators=(",", ":")).encode()
    return struct.pack(">BI", flags, len(payload)) + payload


class _EnvelopeReader:
    def __init__(self, request: Request) -> None:
        self._request = request
        self._buf = bytearray()

    async def _need(self, size: int) -> bool:
        while len(self._buf) < size:
            chunk = await self._request.receive_some()
            if not chunk:
                return False
            self._buf += chunk
        return True

    async def next(self) -> Message | None:
        """Next message of the request stream, or None at its end."""
        if not await self._need(5):
            if self._buf:
                raise ConnectError("invalid_argument", "protocol error: incomplete envelope")
            return None
        flags, size = struct.unpack(">BI", self._buf[:5])
        if size > _MAX_MESSAGE:
            raise ConnectError("resource_exhausted", f"message size {size} is larger than configured max {_MAX_MESSAGE}")
        if not await self._need(5 + size):
            raise ConnectError("invalid_argument", "protocol error: incomplete envelope")
        payload = bytes(self._buf[5:5 + size])
        del self._buf[:5 + size]
        if flags & _FLAG_COMPRESSED:
            raise ConnectError("internal", "protocol error: sent compressed message without compression support")
        if flags & _FLAG_END_STREAM:
            return None
        return _decode(payload)


def _decode(payload: bytes) -> Message:
    if not payload:
        return {}
    try:
        message = json.loads(payload)
    except ValueError as exc:
        raise ConnectError("invalid_argument", f"unmarshal message: {exc}") from exc
    if not isinstance(message, dict):
        raise ConnectError("invalid_argument", "unmarshal message: not a JSON object")
    return message


def _deadline(request: Request) -> tuple[float, int | None]:
    raw = request.headers.get("connect-timeout-ms")
    if not raw:
        return float("inf"), None
    try:
        ms = int(raw)
    except ValueError:
        raise ConnectError("invalid_argument", f"protocol error: invalid timeout {raw!r}") from None
    if ms <= 0:
        return float("inf"), None
    return trio.current_time() + ms / 1000.0, ms


async def _respond_json(request: Request, status: int, body: Message) -> None:
    await request.respond(
        status,
        [("content-type", "application/json")],
        json.dumps(body, separators=(",", ":")).encode(),
    )


async def serve_call(request: Request, method: Method) -> None:
    """Run one Connect call of ``method`` and write its response."""
    if request.method != "POST":
        await request.respond(405, [("allow", "POST")])
        return
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    streaming = method.kind != "unary"
    expected = "application/connect+json" if streaming else "application/json"
    if ctype != expected:
        await request.respond(415, [("accept-post", expected)])
        return
    try:
        deadline, timeout_ms = _deadline(request)
    except ConnectError as exc:
        if streaming:
            await ServerStream(request).finish(exc)
        else:
            await _respond_json(request, exc.http_status, exc.to_json())
        return
    ctx = CallContext(request=request, deadline=deadline, timeout_ms=timeout_ms)
    if method.kind == "unary":
        await _serve_unary(ctx, method.handler)
    elif method.kind == "server_stream":
        await _serve_server_stream(ctx, method.handler)
    else:
        await _serve_client_stream(ctx, method.handler)


async def _serve_unary(ctx: CallContext, handler: Unary) -> None:
    request = ctx.request
    try:
        if request.headers.get("content-encoding", "identity") not in ("identity", ""):
            raise ConnectError("unimplemented", f"unknown compression {request.headers['content-encoding']!r}")
        try:
            body = await request.read_body(_MAX_MESSAGE)
        except ValueError as exc:
            raise ConnectError("resource_exhausted", str(exc)) from exc
        message = _decode(body)
        with trio.move_on_at(ctx.deadline) as scope:
            reply = await handler(ctx, message)
        if scope.cancelled_caught:
            raise ConnectError("deadline_exceeded", "the operation timed out")
    except ConnectError as exc:
        await _respond_json(request, exc.http_status, exc.to_json())
        return
    except (ClientDisconnected, trio.Cancelled):
        raise
    except Exception as exc:  # a bug in a handler: report it as internal
        log.exception("unary handler failed")
        error = ConnectError("internal", f"{type(exc).__name__}: {exc}")
        await _respond_json(request, error.http_status, error.to_json())
        return
    await _respond_json(request, 200, reply)


async def _serve_server_stream(ctx: CallContext, handler: ServerStreaming) -> None:
    request = ctx.request
    stream = ServerStream(request)
    error: ConnectError | None = None
    try:
        reader = _EnvelopeReader(request)
        message = await reader.next()
        if message is None:
            raise ConnectError("invalid_argument", "protocol error: missing request message")
        # Read to the end of the request, so that a client leaving is noticed.
        if await reader.next() is not None:
            raise ConnectError("unimplemented", "protocol error: received extra input message for server-streaming method")
        with trio.move_on_at(ctx.deadline) as scope:
            await handler(ctx, message, stream)
        if scope.cancelled_caught:
            error = ConnectError("deadline_exceeded", "context deadline exceeded")
    except ConnectError as exc:
        error = exc
    except (ClientDisconnected, trio.Cancelled):
        raise
    except Exception as exc:  # a bug in a handler: report it as internal
        log.exception("stream handler failed")
        error = ConnectError("internal", f"{type(exc).__name__}: {exc}")
    await stream.finish(error)


async def _serve_client_stream(ctx: CallContext, handler: ClientStreaming) -> None:
    request = ctx.request
    reader = _EnvelopeReader(request)

    async def messages() -> AsyncIterator[Message]:
        while True:
            message = await reader.next()
            if message is None:
                return
            yield message

    stream = ServerStream(request)
    try:
        with trio.move_on_at(ctx.deadline) as scope:
            reply = await handler(ctx, messages())
        if scope.cancelled_caught:
            raise ConnectError("deadline_exceeded", "context deadline exceeded")
    except ConnectError as exc:
        await stream.finish(exc)
        return
    except (ClientDisconnected, trio.Cancelled):
        raise
    except Exception as exc:  # a bug in a handler: report it as internal
        log.exception("client-stream handler failed")
        await stream.finish(ConnectError("internal", f"{type(exc).__name__}: {exc}"))
        return
    await stream.send(reply)
    await stream.finish(None)

