"""The data plane's wire format: one JSON request and one JSON answer per connection, over a unix socket.

A call connects to ``run/dataplane.sock``, writes ``{"op": ..., "args": {...}}`` and a newline, and reads one
line back: ``{"ok": true, "result": ...}`` or ``{"ok": false, "error": {"type", "message", "errno",
"filename"}}``. A connection per call keeps both sides trivial (no multiplexing, no request ids): a unix
connect costs tens of microseconds, and a call that waits (a VMM's exit) simply holds its connection, which
the client may drop at any time (the server then abandons the call).

Why hand-written: the control plane makes a handful of calls per sandbox operation to one local process it
starts itself; a JSON line needs nothing beyond the standard library on either side, both in Trio tasks and
in worker threads (the blocking ``call_blocking``: the image calls the capture path makes from threads).
"""

from __future__ import annotations

import errno as errno_mod
import json
import socket
from pathlib import Path
from typing import Any, Optional

import trio

__all__ = ["DataPlaneError", "DataPlaneUnavailable", "call", "call_blocking", "encode_error", "vmm_key", "MAX_LINE"]

#: the longest line either side accepts (a layer stack of a few hundred layers fits many times over)
MAX_LINE = 4 << 20


def vmm_key(sandbox_id: str) -> str:
    """The key a sandbox's VMM is spawned under: how the data plane finds the VMM a failed disk leaves without a
    guest disk, and how a take-over checks that a recorded pid is still that sandbox's VMM."""
    return f"aenv-{sandbox_id}"


class DataPlaneError(Exception):
    """The data plane answered a call with an error (its type name and message are kept)."""

    def __init__(self, type_name: str, message: str) -> None:
        super().__init__(f"data plane: {type_name}: {message}")
        self.type_name = type_name


class DataPlaneUnavailable(DataPlaneError):
    """Nothing answers on the data plane's socket (it is not running, or it died)."""

    def __init__(self, message: str) -> None:
        super().__init__("DataPlaneUnavailable", message)


def encode_error(exc: BaseException) -> dict[str, Any]:
    """An exception as the answer carries it (an OSError keeps its errno: a full disk stays a full disk)."""
    out: dict[str, Any] = {"type": type(exc).__name__, "message": str(exc)}
    if isinstance(exc, OSError) and exc.errno is not None:
        out.update(errno=exc.errno, message=exc.strerror or str(exc), filename=exc.filename)
    return out


def _decode(line: bytes) -> Any:
    try:
        answer = json.loads(line)
    except ValueError as exc:
        raise DataPlaneError("ProtocolError", f"unreadable answer: {exc}") from None
    if answer.get("ok"):
        return answer.get("result")
    err = answer.get("error") or {}
    if err.get("errno") is not None:
        code = int(err["errno"])
        raise OSError(code, err.get("message") or errno_mod.errorcode.get(code, "error"), err.get("filename"))
    raise DataPlaneError(str(err.get("type", "Error")), str(err.get("message", "")))


def _take(buf: bytearray, chunk: bytes, op: str) -> None:
    """Add a chunk of the answer to ``buf`` (none: the data plane went away in the middle of the call)."""
    if not chunk:
        raise DataPlaneUnavailable(f"the data plane closed the connection during {op}")
    buf += chunk
    if len(buf) > MAX_LINE:
        raise DataPlaneError("ProtocolError", "answer too long")


def _request(op: str, args: dict[str, Any]) -> bytes:
    return json.dumps({"op": op, "args": args}).encode() + b"\n"


async def call(sock: Path, op: str, **args: Any) -> Any:
    """Make one call from a Trio task; its result, or the error the data plane answered (re-raised)."""
    try:
        stream = await trio.open_unix_socket(str(sock))
    except OSError as exc:
        raise DataPlaneUnavailable(f"cannot connect to {sock}: {exc.strerror}") from None
    async with stream:
        await stream.send_all(_request(op, args))
        buf = bytearray()
        while not buf.endswith(b"\n"):
            _take(buf, await stream.receive_some(65536), op)
    return _decode(bytes(buf))


def call_blocking(sock: Path, op: str, *, timeout_s: Optional[float] = None, **args: Any) -> Any:
    """The same call from a worker thread (or synchronous code); ``timeout_s``: give up (``DataPlaneUnavailable``)
    when the data plane does not answer by then (a metrics scrape must not hang on it)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout_s)
        try:
            s.connect(str(sock))
        except OSError as exc:
            raise DataPlaneUnavailable(f"cannot connect to {sock}: {exc.strerror}") from None
        try:
            s.sendall(_request(op, args))
            buf = bytearray()
            while not buf.endswith(b"\n"):
                _take(buf, s.recv(65536), op)
        except TimeoutError:
            raise DataPlaneUnavailable(f"the data plane at {sock} did not answer {op} within {timeout_s} s") from None
    return _decode(bytes(buf))
