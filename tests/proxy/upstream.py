"""A small raw-ASGI server standing in for services inside a sandbox.

Raw ASGI (no framework) so every byte and every timing is under the test's
control: it echoes requests, streams slowly with chunked encoding, counts
uploaded bytes as they arrive, serves Connect-style envelope streams, notices
when its client goes away, and echoes WebSocket messages.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import random
import struct
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs

import trio

BIG_SEED = 7


def big_payload(size: int) -> bytes:
    return random.Random(BIG_SEED).randbytes(size)


def envelope(message: dict[str, Any], flags: int = 0) -> bytes:
    payload = json.dumps(message).encode()
    return struct.pack(">BI", flags, len(payload)) + payload


@dataclass
class UpstreamState:
    chunks: list[int] = field(default_factory=list)          # sizes of upload chunks as received
    chunk_arrived: trio.Event = field(default_factory=trio.Event)
    stream_done: trio.Event = field(default_factory=trio.Event)
    forever_started: trio.Event = field(default_factory=trio.Event)
    forever_gone: trio.Event = field(default_factory=trio.Event)
    sink_gone: trio.Event = field(default_factory=trio.Event)
    ws_disconnect_code: int | None = None
    ws_gone: trio.Event = field(default_factory=trio.Event)
    last_headers: list[tuple[str, str]] = field(default_factory=list)
    waiting: int = 0
    barrier_full: trio.Event = field(default_factory=trio.Event)


class Upstream:
    def __init__(self) -> None:
        self.state = UpstreamState()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] == "websocket":
            await self.websocket(scope, receive, send)
            return
        self.state.last_headers = [(k.decode(), v.decode("latin-1")) for k, v in scope["headers"]]
        name = scope["path"].strip("/").split("/")[0] or "echo"
        query = {k: v[0] for k, v in parse_qs(scope["query_string"].decode()).items()}
        await getattr(self, "h_" + name.replace("-", "_"))(scope, receive, send, query)

    # ----- helpers ----------------------------------------------------------

    @staticmethod
    async def read_body(receive: Any) -> bytes:
        parts = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
            parts.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        return b"".join(parts)

    @staticmethod
    async def respond(send: Any, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None,
                      content_type: bytes = b"application/json") -> None:
        all_headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": all_headers + (headers or [])})
        await send({"type": "http.response.body", "body": body})

    # ----- HTTP handlers ------------------------------------------------------

    async def h_echo(self, scope: dict[str, Any], receive: Any, send: Any, query: dict[str, str]) -> None:
        body = await self.read_body(receive)
        reply = {
            "method": scope["method"],
            "path": scope["path"],
            "raw_path": scope["raw_path"].decode(),
            "query": scope["query_string"].decode(),
            "headers": [[k.decode(), v.decode("latin-1")] for k, v in scope["headers"]],
            "length": len(body),
            "sha256": hashlib.sha256(body).hexdigest(),
            "client_port": scope["client"][1] if scope.get("client") else None,
        }
        await self.respond(send, int(query.get("status", 200)), json.dumps(reply).encode())

    async def h_sink(self, scope: dict[str, Any], receive: Any, send: Any, query: dict[str, str]) -> None:
        """Count an upload chunk by chunk, signalling each arrival."""
        digest = hashlib.sha256()
        total = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.state.sink_gone.set()
                return
            chunk = message.get("body", b"")
            if chunk:
                digest.update(chunk)
                total += len(chunk)
                self.state.chunks.append(len(chunk))
                self.state.chunk_arrived.set()
            if not message.get("more_body", False):
                break
        reply = {"length": total, "sha256": digest.hexdigest(), "chunks": len(self.state.chunks)}
        await self.respond(send, 200, json.dumps(reply).encode())

    async def h_slow(self, scope: dict[str, Any], receive: Any, send: Any, query: dict[str, str]) -> None:
        """Chunked response: n chunks, `delay` seconds apart."""
        await self.read_body(receive)
        n, delay = int(query.get("n", 5)), float(query.get("delay", 0.2))
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/plain")]})
        for i in range(n):
            await send({"type": "http.response.body", "body": f"chunk {i}\n".encode(), "more_body": True})
            await trio.sleep(delay)
        self.state.stream_done.set()
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def h_big(self, scope: dict[str, Any], receive: Any, send: Any, query: dict[str, str]) -> None:
        await self.read_body(receive)
        data = big_payload(int(query["size"]))
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/octet-stream"),
                                (b"content-length", str(len(data)).encode())]})
        step = 256 * 1024
        for i in range(0, len(data), step):
            await send({"type": "http.response.body", "body": data[i:i + step], "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def h_connect(self, scope: dict[str, Any], receive: Any, send: Any, query: dict[str, str]) -> None:
        """A Connect client-stream then server-stream: echo each envelope, keepalives, end."""
        data = await self.read_body(receive)
        received = []
        i = 0
        while i < len(data):
            _flags, size = struct.unpack(">BI", data[i:i + 5])
            received.append(json.loads(data[i + 5:i + 5 + size]))
            i += 5 + size
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/connect+json")]})
        for message in received:
            await send({"type": "http.response.body", "body": envelope({"echo": message}), "more_body": True})
            await send({"type": "http.response.body", "body": envelope({"event": {"keepalive": {}}}),
                        "more_body": True})
            await trio.sleep(0.01)
        await send({"type": "http.response.body", "body": envelope({}, flags=2), "more_body": False})

    async def h_forever(self, scope: dict[str, Any], receive: Any, send: Any, query: dict[str, str]) -> None:
        """Streams until the client goes away; records that it noticed."""
        await self.read_body(receive)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/connect+json")]})
        self.state.forever_started.set()
        try:
            async with trio.open_nursery() as nursery:
                async def watch() -> None:
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    self.state.forever_gone.set()
                    nursery.cancel_scope.cancel()

                nursery.start_soon(watch)
                while True:
                    await send({"type": "http.response.body", "body": envelope({"event": {"keepalive": {}}}),
                                "more_body": True})
                    await trio.sleep(0.05)
        finally:
            self.state.forever_gone.set()

    async def h_barrier(self, scope: dict[str, Any], receive: Any, send: Any, query: dict[str, str]) -> None:
        """Answers 200 once `n` requests wait here at the same time (504 after 10 s)."""
        await self.read_body(receive)
        self.state.waiting += 1
        if self.state.waiting >= int(query["n"]):
            self.state.barrier_full.set()
        with trio.move_on_after(10):
            await self.state.barrier_full.wait()
        await self.respond(send, 200 if self.state.barrier_full.is_set() else 504, b"{}")

    async def h_cookies(self, scope: dict[str, Any], receive: Any, send: Any, query: dict[str, str]) -> None:
        await self.read_body(receive)
        await self.respond(send, 201, b"{}", headers=[
            (b"set-cookie", b"a=1; Path=/"), (b"set-cookie", b"b=2; Path=/"), (b"x-custom", b"yes"),
        ])

    async def h_gzip(self, scope: dict[str, Any], receive: Any, send: Any, query: dict[str, str]) -> None:
        await self.read_body(receive)
        body = gzip.compress(b"hello " * 1000, mtime=0)
        await self.respond(send, 200, body, headers=[(b"content-encoding", b"gzip")], content_type=b"text/plain")

    # ----- WebSocket ----------------------------------------------------------

    async def websocket(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        message = await receive()
        assert message["type"] == "websocket.connect"
        if scope["path"] == "/reject":
            await send({"type": "websocket.http.response.start", "status": 418,
                        "headers": [(b"content-type", b"text/plain"), (b"content-length", b"6")]})
            await send({"type": "websocket.http.response.body", "body": b"teapot"})
            return
        subprotocol = "chat" if "chat" in scope.get("subprotocols", []) else None
        await send({"type": "websocket.accept", "subprotocol": subprotocol})
        try:
            while True:
                message = await receive()
                if message["type"] == "websocket.disconnect":
                    self.state.ws_disconnect_code = message.get("code")
                    return
                text = message.get("text")
                if text is not None and text.startswith("close:"):
                    _, code, reason = text.split(":", 2)
                    await send({"type": "websocket.close", "code": int(code), "reason": reason})
                    return
                if text is not None:
                    await send({"type": "websocket.send", "text": text})
                else:
                    await send({"type": "websocket.send", "bytes": message["bytes"]})
        finally:
            self.state.ws_gone.set()
