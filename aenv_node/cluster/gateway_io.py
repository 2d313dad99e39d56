"""The gateway's own answers and request reading (``gateway.py``): a node's buffered answer passed on, the
gateway's E2B-shaped errors, a JSON body read within the API's limit and given again to a forwarder."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any, Optional
from urllib.parse import urlsplit

import httpx
import trio

from ..api.models import MAX_JSON_BODY
from ..api.traffic import Message, Receive, Send

__all__ = ["Answer", "Passed", "Reply", "host_port", "json_field", "read_body", "replay"]


class Answer(Exception):
    """A response the gateway gives itself: E2B's ``{code, message}``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise Answer(502, f"node URL {url!r} is not http://HOST:PORT")
    return parts.hostname, parts.port or 80


class Reply:
    """A node's buffered answer, passed on with its status, content type and paging header."""

    __slots__ = ("status", "body", "headers")

    def __init__(self, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
        self.status = status
        self.body = body
        self.headers = headers

    @classmethod
    def of(cls, r: httpx.Response) -> Reply:
        keep = [(k.encode(), v.encode()) for k, v in r.headers.items()
                if k.lower() in ("content-type", "x-next-token", "location")]
        return cls(r.status_code, r.content, keep)

    @classmethod
    def json(cls, status: int, value: Any, headers: Optional[list[tuple[bytes, bytes]]] = None) -> Reply:
        return cls(status, json.dumps(value).encode(), [(b"content-type", b"application/json"), *(headers or [])])

    async def send(self, send: Send) -> None:
        headers = [*self.headers, (b"content-length", str(len(self.body)).encode())]
        await send({"type": "http.response.start", "status": self.status, "headers": headers})
        await send({"type": "http.response.body", "body": self.body, "more_body": False})


class Passed(Exception):
    """A node's refusal of a listing, passed on as it is."""

    def __init__(self, reply: Reply) -> None:
        super().__init__(reply.status)
        self.reply = reply


async def read_body(receive: Receive) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise Answer(499, "the client went away")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_JSON_BODY:
            raise Answer(413, f"the request body is larger than {MAX_JSON_BODY} bytes")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def replay(body: bytes) -> Callable[[], Awaitable[Message]]:
    """A ``receive`` that gives an already read body again (then waits, as a client that stays)."""
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    return receive


def json_field(body: bytes, name: str) -> str:
    try:
        value = json.loads(body or b"{}")
    except ValueError:
        return ""
    found = value.get(name) if isinstance(value, dict) else None
    return found if isinstance(found, str) else ""
