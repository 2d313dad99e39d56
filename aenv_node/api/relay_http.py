"""The HTTP/1.1 the raw relay (``relay.py``) understands: a request head, a response head, chunked framing.

Why hand-written and not h11 or httpcore: they parse a message into events and build a new one, which is
where the ASGI path spends its time (Hypercorn's h11, the ASGI messages, httpcore's h11 again: about 2 ms of
CPU per small request). A relay needs neither: bodies pass through untouched, so all it must understand is
a request head (to route it and drop hop-by-hop headers), a response head (the same, and its framing) and
where a chunked body ends. The request parsing is strict on purpose: a head it does not fully understand is
not an error here but a request for Hypercorn (h11) to serve, so the relay can never read a request
differently from the server behind it. httptools (llhttp) would parse faster, but it is a C extension this
project does not otherwise need, and the parsing is not where the relay's time goes.
"""

from __future__ import annotations

import re
from http import HTTPStatus

from .request_head import MAX_HEADER_BYTES, MAX_HEADERS
from .traffic import ProxyReject, Target, route

__all__ = ["Chunked", "Request", "Response", "error_response", "parse_request", "parse_response"]

_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_TARGET = re.compile(rb"/[!-~]*")
# the header lines of a head, each "\r\nname:value" (tabs allowed in values, no other control byte)
_FIELDS = re.compile(rb"(?:\r\n[!#$%&'*+\-.^_`|~0-9A-Za-z]+:[^\x00-\x08\x0a-\x1f\x7f]*)*")
_NOT_RELAYED = frozenset({b"transfer-encoding", b"expect", b"upgrade"})
# Hop-by-hop headers (RFC 9110 7.6.1). Transfer-Encoding is not among them here: the relay passes a
# chunked response through as it is, and takes no request that has one.
_HOP_BY_HOP = frozenset({
    b"connection", b"keep-alive", b"proxy-connection", b"proxy-authenticate",
    b"proxy-authorization", b"te", b"trailer", b"upgrade",
})
_NO_BODY_STATUS = frozenset({204, 304})


class Request:
    __slots__ = ("method", "head", "headers", "length", "close", "target")

    def __init__(self, method: bytes, head: bytes, headers: list[tuple[bytes, bytes]], length: int,
                 close: bool, target: Target) -> None:
        self.method = method
        self.head = head        # what goes upstream: the request line and forwardable headers, and CRLF CRLF
        self.headers = headers  # all of them, names lower-case
        self.length = length    # body bytes (Content-Length; 0 without)
        self.close = close      # the client asked to close after this exchange
        self.target = target


def _connection_tokens(headers: list[tuple[bytes, bytes]]) -> set[bytes]:
    return {t.strip().lower() for k, v in headers if k == b"connection" for t in v.split(b",") if t.strip()}


def parse_request(head: bytes, domain: str) -> Request | None:
    """The request head (without its blank line) if the relay takes it, else None (Hypercorn's to serve):
    HTTP/1.1, origin-form target, sandbox traffic, no Transfer-Encoding, Expect or Upgrade, within the
    head limits, nothing h11 might read otherwise."""
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ")
    if len(parts) != 3 or parts[2] != b"HTTP/1.1" or not _TOKEN.fullmatch(parts[0]) \
            or not _TARGET.fullmatch(parts[1]):
        return None
    if len(lines) - 1 > MAX_HEADERS or len(head) - len(lines[0]) > MAX_HEADER_BYTES:
        return None
    if not _FIELDS.fullmatch(head, len(lines[0])):
        return None  # obs-fold, bare CR or LF, a space before a colon, control bytes: h11 decides
    headers = [(name.lower(), value.strip(b" \t"))
               for name, _, value in (line.partition(b":") for line in lines[1:])]
    length = -1
    for name, value in headers:
        if name in _NOT_RELAYED:
            return None
        if name == b"content-length":
            if length >= 0 or not value.isdigit() or len(value) > 15:
                return None
            length = int(value)
    try:
        target = route(headers, domain)
    except ProxyReject:
        return None  # the ASGI path answers it, in the same words
    if target is None:
        return None
    named = _connection_tokens(headers)
    out = [lines[0]]
    for (name, _value), line in zip(headers, lines[1:], strict=True):
        if name not in _HOP_BY_HOP and name not in named:
            out.append(line)
    if length < 0 and parts[0] in (b"POST", b"PUT", b"PATCH"):
        out.append(b"content-length: 0")
    out.append(b"\r\n")
    return Request(parts[0], b"\r\n".join(out), headers, max(length, 0), b"close" in named, target)


def error_response(status: int, body: bytes, close: bool) -> bytes:
    """A whole JSON response (the proxy's own errors)."""
    return (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n" + ("connection: close\r\n" if close else "") + "\r\n"
            ).encode() + body


class Response:
    """A response head as the relay passes it on, and how its body is framed."""

    __slots__ = ("status", "head", "length", "chunked", "reusable", "close")

    def __init__(self, status: int, head: bytes, length: int | None, chunked: bool, reusable: bool,
                 close: bool) -> None:
        self.status = status
        self.head = head          # to send to the client, CRLF CRLF included
        self.length = length      # Content-Length (0 when there is no body); None: chunked or until close
        self.chunked = chunked
        self.reusable = reusable  # the upstream connection can serve another request after this one
        self.close = close        # the client connection ends with this response


def parse_response(head: bytes, method: bytes, client_close: bool) -> Response:
    """Parse a response head (without its blank line); raises ValueError for one that is not HTTP/1.x."""
    lines = head.split(b"\r\n")
    status_line = lines[0].split(b" ", 2)
    version = status_line[0]
    if version not in (b"HTTP/1.1", b"HTTP/1.0") or len(status_line) < 2 or not status_line[1].isdigit():
        raise ValueError(f"bad status line {lines[0]!r}")
    status = int(status_line[1])
    headers = []
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon:
            raise ValueError(f"bad header line {line!r}")
        headers.append((name.strip().lower(), value.strip()))
    named = _connection_tokens(headers)
    length: int | None = None
    chunked = False
    for name, value in headers:
        if name == b"content-length":
            if not value.isdigit() or (length is not None and int(value) != length):
                raise ValueError(f"bad content-length {value!r}")
            length = int(value)
        elif name == b"transfer-encoding":
            chunked = value.lower().endswith(b"chunked")
    if 100 <= status < 200:
        length, chunked = 0, False  # an interim response: the final one follows
    elif method == b"HEAD" or status in _NO_BODY_STATUS:
        length, chunked = 0, False
    elif chunked:
        length = None
    until_close = length is None and not chunked
    reusable = version == b"HTTP/1.1" and b"close" not in named and not until_close and status != 101
    # (a 101 the relay never asked for, as it relays no Upgrade: nothing sane can follow it)
    close = (client_close or until_close or status == 101) and not (100 <= status < 200 and status != 101)
    out = [lines[0]]
    out.extend(line for (name, _), line in zip(headers, lines[1:], strict=True)
               if name not in _HOP_BY_HOP and name not in named)
    if close:
        out.append(b"connection: close")
    out.append(b"\r\n")
    return Response(status, b"\r\n".join(out), length, chunked, reusable, close)


class Chunked:
    """Follows chunked framing through relayed bytes to find where the message ends."""

    __slots__ = ("state", "left", "line")

    def __init__(self) -> None:
        self.state = 0   # 0 size line, 1 data, 2 CRLF after data, 3 trailer lines, 4 done
        self.left = 0
        self.line = b""

    def feed(self, data: bytes) -> int:
        """Consume ``data``; returns how many of its bytes belong to the message (all, unless it ended).
        Raises ValueError for bytes that are not chunked framing."""
        i, n = 0, len(data)
        while i < n and self.state != 4:
            if self.state in (1, 2):
                take = min(self.left, n - i)
                i += take
                self.left -= take
                if self.left == 0:
                    self.state, self.left = (2, 2) if self.state == 1 else (0, 0)
            else:
                end = data.find(b"\n", i)
                if end < 0:
                    self.line += data[i:]
                    if len(self.line) > 8192:
                        raise ValueError("chunk size line too long")
                    return n
                line = (self.line + data[i:end]).rstrip(b"\r")
                self.line = b""
                i = end + 1
                if self.state == 0:
                    size = int(line.split(b";", 1)[0].strip(), 16)
                    self.state, self.left = (1, size) if size else (3, 0)
                elif not line:  # the blank line after the trailers
                    self.state = 4
        return i

    @property
    def done(self) -> bool:
        return self.state == 4
