"""Running a build's commands in its VM through envd: RUN steps, the start command and the ready check.

The node speaks to envd over the same Connect protocol (JSON codec) the E2B SDKs use (the envelope format is in
``docs/api.md`` and the reference notes): ``process.Process/Start`` streams a start event, output chunks and an
end event. Why hand-written: the only client libraries for it are the E2B SDKs themselves (the node does not
depend on a client SDK), and the subset a build needs, one server stream read incrementally, is a few dozen
lines on httpx. A build VM has had no ``/init``, so its envd has no access token and takes requests as is.
"""

from __future__ import annotations

import base64
import json
import struct
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass

import httpx
import trio

from ..snapshot.envd import ENVD_PORT
from .errors import GuestExecError

__all__ = ["ExecResult", "follow_in_guest", "run_in_guest"]

Output = Callable[[str, str], None]  # (stream name "stdout"/"stderr", text)


@dataclass(frozen=True)
class ExecResult:
    exit_code: int
    status: str  # envd's, e.g. "exit status 1" or "signal: killed"
    error: str | None = None


def _auth(user: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:".encode()).decode()}


def _start_body(cmd: str, *, envs: Mapping[str, str], cwd: str | None) -> bytes:
    process: dict[str, object] = {"cmd": "/bin/sh", "args": ["-c", cmd], "envs": dict(envs)}
    if cwd:
        process["cwd"] = cwd
    msg = json.dumps({"process": process, "stdin": False}).encode()
    return b"\0" + struct.pack(">I", len(msg)) + msg


async def _envelopes(response: httpx.Response) -> AsyncIterator[tuple[int, dict[str, object]]]:
    buf = b""
    async for chunk in response.aiter_bytes():
        buf += chunk
        while len(buf) >= 5:
            flags, size = buf[0], struct.unpack(">I", buf[1:5])[0]
            if len(buf) < 5 + size:
                break
            body, buf = buf[5:5 + size], buf[5 + size:]
            doc = json.loads(body or b"{}")
            yield flags, doc if isinstance(doc, dict) else {}


def _event(doc: dict[str, object]) -> dict[str, object]:
    ev = doc.get("event")
    return ev if isinstance(ev, dict) else {}


async def follow_in_guest(host: str, cmd: str, *, user: str = "root", envs: Mapping[str, str] | None = None,
                          cwd: str | None = None, timeout_s: float | None = None, on_output: Output | None = None,
                          task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> ExecResult:
    """Run ``cmd`` with ``/bin/sh -c`` as ``user``, its output going to ``on_output`` as it comes, until it ends
    (its result). ``timeout_s``: envd kills it after that long (Connect-Timeout-Ms); None: no limit, and a
    cancelled caller leaves it running (envd keeps a process whose client went away). Reports the pid through
    ``task_status`` once envd has started it."""
    url = f"http://{host}:{ENVD_PORT}/process.Process/Start"
    headers = {"Content-Type": "application/connect+json", "Connect-Protocol-Version": "1", **_auth(user)}
    if timeout_s is not None:
        headers["Connect-Timeout-Ms"] = str(int(timeout_s * 1000))
    started = False
    http_timeout = httpx.Timeout(None if timeout_s is None else timeout_s + 10, connect=10)
    async with httpx.AsyncClient(timeout=http_timeout) as client:
        async with client.stream("POST", url, content=_start_body(cmd, envs=envs or {}, cwd=cwd),
                                 headers=headers) as r:
            if r.status_code != 200:
                raise GuestExecError(f"envd answered {r.status_code}: {(await r.aread())[:300]!r}")
            async for flags, doc in _envelopes(r):
                if flags & 0x02:
                    err = doc.get("error")
                    if isinstance(err, dict):
                        raise GuestExecError(f"envd: {err.get('code')}: {err.get('message')}")
                    break
                ev = _event(doc)
                start, data, end = ev.get("start"), ev.get("data"), ev.get("end")
                if isinstance(start, dict) and not started:
                    started = True
                    task_status.started(int(start.get("pid", 0)))
                if isinstance(data, dict) and on_output is not None:
                    for stream in ("stdout", "stderr"):
                        if isinstance(data.get(stream), str):
                            on_output(stream, base64.b64decode(str(data[stream])).decode(errors="replace"))
                if isinstance(end, dict):
                    code = end.get("exitCode", 0)
                    return ExecResult(int(code) if isinstance(code, (int, str)) else -1, str(end.get("status", "")),
                                      str(end["error"]) if end.get("error") else None)
    raise GuestExecError(f"envd ended the stream of {cmd!r} without its exit status")


async def run_in_guest(host: str, cmd: str, *, user: str = "root", envs: Mapping[str, str] | None = None,
                       cwd: str | None = None, timeout_s: float = 600.0,
                       on_output: Output | None = None) -> ExecResult:
    """Run ``cmd`` with ``/bin/sh -c`` as ``user`` and wait for it (killed by envd after ``timeout_s``)."""
    return await follow_in_guest(host, cmd, user=user, envs=envs, cwd=cwd, timeout_s=timeout_s,
                                 on_output=on_output)
