"""Request size limits (``api/models.py``, limits; docs/api.md): a body, a sandbox's metadata, its environment
and its egress rules over their limits are refused in E2B's error shape, naming what is over and the limit,
against the real server (Hypercorn); what is at a limit passes.

The live node here has no sandbox service: a body that passes the limits reaches the handler, which answers
501, so 501 means "accepted by the limits"."""

from __future__ import annotations

import json
import socket
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import trio

from aenv_node.api.models import (
    EGRESS_MAX_RULES,
    ENV_TOTAL_MAX,
    ENV_VALUE_MAX,
    MAX_JSON_BODY,
    METADATA_KEY_MAX,
    METADATA_MAX_ENTRIES,
    METADATA_VALUE_MAX,
)

from aenv_node.api.request_head import MAX_HEADER_BYTES, MAX_HEADERS

from .test_api import assert_e2b_error

ACCEPTED = 501


def _refused_by_length(url: str, key: str, length: int) -> tuple[int, dict[str, Any]]:
    """POST a create announcing ``length`` bytes, send none of them, and read the answer."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(f"POST /v2/sandboxes HTTP/1.1\r\nHost: {host}\r\nX-API-KEY: {key}\r\nContent-Type: "
                  f"application/json\r\nContent-Length: {length}\r\n\r\n".encode())
        data = b""
        while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _content_length(data):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    head, _, payload = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(payload[:_content_length(data)])


def _content_length(data: bytes) -> int:
    for line in data.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 1 << 30


async def _create(c: httpx.AsyncClient, body: dict[str, Any]) -> httpx.Response:
    return await c.post("/v2/sandboxes", json=body)


async def test_a_body_over_the_limit_is_413_by_its_length_or_as_it_streams(live_node) -> None:
    async with live_node.client() as c:
        # the case the issue measured: a 20 MB metadata value was accepted and listed back. Refused by its
        # Content-Length, before a byte of it is read (a raw socket: httpx sends all of a body before it reads)
        status, body = await trio.to_thread.run_sync(_refused_by_length, live_node.url, live_node.api_key,
                                                   20 << 20)
        assert status == 413 and body["code"] == 413 and f"at most {MAX_JSON_BODY}" in body["message"], body

        async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: refused once that much arrived
            yield b'{"metadata": {"k": "'
            for _ in range(MAX_JSON_BODY // 65536 + 2):
                yield b"x" * 65536
            yield b'"}}'

        r = await c.post("/v2/sandboxes", content=chunks(), headers={"Content-Type": "application/json"})
        assert_e2b_error(r, 413, "request body too large")
        # the node still answers
        assert (await c.get("/v2/sandboxes")).status_code == 200


def _over_and_at_limits() -> Iterator[tuple[dict[str, Any], dict[str, Any], str]]:
    """(a body just over a limit, the same at the limit, what the 400 names)"""
    yield ({"metadata": {"k": "v" * (METADATA_VALUE_MAX + 1)}}, {"metadata": {"k": "v" * METADATA_VALUE_MAX}},
           f"field 'metadata.k' must be at most {METADATA_VALUE_MAX} characters")
    yield ({"metadata": {"k" * (METADATA_KEY_MAX + 1): "v"}}, {"metadata": {"k" * METADATA_KEY_MAX: "v"}},
           f"a key of field 'metadata' must be at most {METADATA_KEY_MAX} characters")
    yield ({"metadata": {f"k{i}": "v" for i in range(METADATA_MAX_ENTRIES + 1)}},
           {"metadata": {f"k{i}": "v" for i in range(METADATA_MAX_ENTRIES)}},
           f"field 'metadata' must have at most {METADATA_MAX_ENTRIES} entries, got {METADATA_MAX_ENTRIES + 1}")
    yield ({"envVars": {"A": "v" * (ENV_VALUE_MAX + 1)}}, {"envVars": {"A": "v" * ENV_VALUE_MAX}},
           f"field 'envVars.A' must be at most {ENV_VALUE_MAX} characters")
    n = ENV_TOTAL_MAX // ENV_VALUE_MAX  # n values at their own limit fill the total but for their names
    yield ({"envVars": {f"V{i}": "v" * ENV_VALUE_MAX for i in range(n + 1)}},
           {"envVars": {f"V{i}": "v" * (ENV_VALUE_MAX - 2) for i in range(n)}},
           f"field 'envVars' must total at most {ENV_TOTAL_MAX} characters")
    yield ({"network": {"allowOut": ["10.0.0.0/8"] * (EGRESS_MAX_RULES + 1)}},
           {"network": {"allowOut": ["10.0.0.0/8"] * EGRESS_MAX_RULES}},
           f"field 'network.allowOut' must have at most {EGRESS_MAX_RULES} entries")
    yield ({"metadata": {"": "v"}}, {"metadata": {"k": ""}}, "a key of field 'metadata' must not be empty")


async def test_fields_over_their_limits_are_400_naming_the_field_and_the_limit(live_node) -> None:
    async with live_node.client() as c:
        for over, at, message in _over_and_at_limits():
            if "must not be empty" in message:  # an empty key is a shape error, not a size: 422
                assert_e2b_error(await _create(c, over), 422, message)
            else:
                assert_e2b_error(await _create(c, over), 400, message)
            assert (await _create(c, at)).status_code == ACCEPTED, (at, message)
        # a type error in the same body still reads as one: the size is named first only when there is one
        r = await _create(c, {"timeout": "soon", "metadata": {"k": "v" * (METADATA_VALUE_MAX + 1)}})
        assert_e2b_error(r, 400, "'metadata.k'")
        assert_e2b_error(await _create(c, {"timeout": "soon"}), 422, "'timeout' must be an integer")



def _raw(url: str, request: bytes) -> bytes:
    """Send ``request`` on a fresh connection and read the answer until the server closes the connection."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    data = b""
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(request)
        while chunk := s.recv(65536):
            data += chunk
    return data


async def test_oversized_request_heads_are_431_and_the_node_goes_on(live_node) -> None:
    """A head over the limits (request_head.py) is refused with 431 in E2B's shape and a closed connection,
    before a handler runs (a whole head sent at once is not bounded by Hypercorn); one at the limits passes."""
    key = f"X-API-KEY: {live_node.api_key}\r\n"
    big = f"X-Pad: {'x' * MAX_HEADER_BYTES}\r\n"
    many = "".join(f"X-H{i}: v\r\n" for i in range(MAX_HEADERS + 1))
    for head, what in ((big, "bytes"), (many, "headers")):
        request = f"GET /v2/sandboxes HTTP/1.1\r\nHost: x\r\n{key}{head}\r\n".encode()
        answer = await trio.to_thread.run_sync(_raw, live_node.url, request)
        status_line, _, rest = answer.partition(b"\r\n")
        assert status_line.split()[1] == b"431", answer[:300]
        body = json.loads(rest.partition(b"\r\n\r\n")[2])
        assert body["code"] == 431 and "request headers too large" in body["message"] and what in body["message"]
    async with live_node.client() as c:
        fits = {f"X-H{i}": "v" for i in range(MAX_HEADERS - 10)}
        assert (await c.get("/v2/sandboxes", headers=fits)).status_code == 200
        assert (await c.get("/v2/sandboxes", headers={"X-Pad": "x" * (MAX_HEADER_BYTES // 2)})).status_code == 200


def _keep_alive_pair(url: str, first: bytes, second: bytes) -> list[bytes]:
    """Send ``first``, read its whole answer, then ``second`` on the same connection; the status lines."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    statuses = []
    with socket.create_connection((host, int(port)), timeout=10) as s:
        f = s.makefile("rb")
        for req in (first, second):
            s.sendall(req)
            statuses.append(f.readline().strip())
            length = 0
            while (line := f.readline()) not in (b"\r\n", b""):
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            f.read(length)
    return statuses


async def test_a_keep_alive_connection_answers_after_an_early_error(live_node) -> None:
    """A 401 answered before the body is read leaves the connection usable; a 413 answered before its body came
    closes it (the rest of that body would be read as the next request): either way the client is never left
    waiting on a connection that answers nothing (the end of a response is shielded from the request's
    cancellation, server.py; without it the 413's connection hung)."""
    get = f"GET /v2/sandboxes HTTP/1.1\r\nHost: x\r\nX-API-KEY: {live_node.api_key}\r\n\r\n".encode()
    body = b'{"templateID": "base"}'
    unauthorized = (f"POST /v2/sandboxes HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    too_big = (f"POST /v2/sandboxes HTTP/1.1\r\nHost: x\r\nX-API-KEY: {live_node.api_key}\r\n"
               f"Content-Type: application/json\r\nContent-Length: {MAX_JSON_BODY + 1}\r\n\r\n").encode()
    first = await trio.to_thread.run_sync(_keep_alive_pair, live_node.url, unauthorized, get)
    assert [line.split()[1] for line in first] == [b"401", b"200"], first
    second = await trio.to_thread.run_sync(_keep_alive_pair, live_node.url, too_big, get)
    assert second == [b"HTTP/1.1 413", b""], second  # b"": closed, not left hanging (a timeout raises)
