"""A streaming ``multipart/form-data`` reader.

Why hand-written: uploads can be far larger than guest memory, so parts must
be written to disk as they arrive; the standard library only parses whole
messages in memory (``email``), and the streaming PyPI parsers are either
compiled or larger than this. Only what ``/files`` needs is here: parts with
their headers and a body read in chunks. File names are kept whole (E2B sends
the target path as the filename), not cut to their last element.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

Receive = Callable[[], Awaitable[bytes]]
_MAX_HEADER = 64 * 1024


class MultipartError(ValueError):
    """The body is not a well-formed multipart message."""


def boundary_of(content_type: str) -> bytes:
    params = parse_header_params(content_type)
    boundary = params.get("boundary")
    if not boundary:
        raise MultipartError("no multipart boundary param in Content-Type")
    return boundary.encode("latin-1")


def parse_header_params(value: str) -> dict[str, str]:
    """Parameters of a header like ``form-data; name="file"; filename="a b"``."""
    params: dict[str, str] = {}
    i = value.find(";")
    if i < 0:
        return params
    s = value[i + 1:]
    pos = 0
    n = len(s)
    while pos < n:
        while pos < n and s[pos] in " \t;":
            pos += 1
        eq = s.find("=", pos)
        if eq < 0:
            break
        key = s[pos:eq].strip().lower()
        pos = eq + 1
        if pos < n and s[pos] == '"':
            pos += 1
            out = []
            while pos < n and s[pos] != '"':
                if s[pos] == "\\" and pos + 1 < n:
                    pos += 1
                out.append(s[pos])
                pos += 1
            pos += 1
            val = "".join(out)
        else:
            end = s.find(";", pos)
            end = n if end < 0 else end
            val = s[pos:end].strip()
            pos = end
        params[key] = val
    return params


class Part:
    def __init__(self, reader: "MultipartReader", headers: dict[str, str]) -> None:
        self._reader = reader
        self.headers = headers
        disposition = headers.get("content-disposition", "")
        params = parse_header_params(disposition)
        self.name = params.get("name")
        self.filename = params.get("filename")
        self.done = False

    async def read_chunk(self) -> bytes:
        """Next piece of this part's body; ``b""`` at its end."""
        if self.done:
            return b""
        data = await self._reader._body_chunk()
        if not data:
            self.done = True
        return data

    async def drain(self) -> None:
        while await self.read_chunk():
            pass


class MultipartReader:
    def __init__(self, receive: Receive, boundary: bytes) -> None:
        self._receive = receive
        # A leading CRLF lets the first delimiter match like all the others.
        self._buf = bytearray(b"\r\n")
        self._delim = b"\r\n--" + boundary
        self._eof = False
        self._part: Part | None = None
        self._in_body = False
        self._finished = False

    async def _more(self) -> bool:
        if self._eof:
            return False
        data = await self._receive()
        if not data:
            self._eof = True
            return False
        self._buf += data
        return True

    async def next_part(self) -> Part | None:
        if self._part is not None:
            await self._part.drain()
            self._part = None
        if self._finished:
            return None
        # Find the delimiter that opens the next part (skipping any preamble).
        while True:
            i = self._buf.find(self._delim)
            if i >= 0:
                del self._buf[: i + len(self._delim)]
                break
            keep = len(self._delim) - 1
            if len(self._buf) > keep:
                del self._buf[: len(self._buf) - keep]
            if not await self._more():
                raise MultipartError("multipart: NextPart: EOF")
        # "--" closes the message; otherwise the line ends (maybe after padding).
        while len(self._buf) < 2:
            if not await self._more():
                raise MultipartError("multipart: unexpected EOF after boundary")
        if self._buf[:2] == b"--":
            self._finished = True
            return None
        while True:
            eol = self._buf.find(b"\r\n")
            if eol >= 0:
                del self._buf[: eol + 2]
                break
            if not await self._more():
                raise MultipartError("multipart: unexpected EOF after boundary")
        # Headers, up to an empty line.
        while True:
            end = self._buf.find(b"\r\n\r\n")
            if self._buf.startswith(b"\r\n"):
                end = -2
            if end != -1:
                break
            if len(self._buf) > _MAX_HEADER:
                raise MultipartError("multipart: part headers too large")
            if not await self._more():
                raise MultipartError("multipart: unexpected EOF in part headers")
        raw = bytes(self._buf[: max(end, 0)])
        del self._buf[: max(end, 0) + (4 if end >= 0 else 2)]
        headers: dict[str, str] = {}
        for line in raw.split(b"\r\n"):
            if not line:
                continue
            name, sep, value = line.partition(b":")
            if not sep:
                raise MultipartError(f"multipart: malformed header line {line[:80]!r}")
            headers[name.decode("latin-1").strip().lower()] = value.decode("utf-8", "replace").strip()
        self._part = Part(self, headers)
        self._in_body = True
        return self._part

    async def _body_chunk(self) -> bytes:
        if not self._in_body:
            return b""
        while True:
            i = self._buf.find(self._delim)
            if i >= 0:
                if i == 0:
                    self._in_body = False
                    return b""
                data = bytes(self._buf[:i])
                del self._buf[:i]
                return data
            safe = len(self._buf) - (len(self._delim) - 1)
            if safe > 0 and (safe >= 64 * 1024 or self._eof):
                data = bytes(self._buf[:safe])
                del self._buf[:safe]
                return data
            if not await self._more():
                if safe > 0:
                    data = bytes(self._buf[:safe])
                    del self._buf[:safe]
                    return data
                raise MultipartError("multipart: unexpected EOF in part body")
