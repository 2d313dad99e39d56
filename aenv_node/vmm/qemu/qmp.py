"""A small QMP (QEMU Machine Protocol) client on Trio.

Why hand-written: the official `qemu.qmp` package is asyncio-only, and the node is Trio all the way down.
QMP is simple enough: newline-delimited JSON over a unix socket; a greeting, `qmp_capabilities`, then
commands answered in order, with asynchronous events interleaved. Commands are serialized by a lock and
the reader collects events it meets while waiting for a reply (`events`), so no background task is needed
and the client is owned by whoever owns the VM.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import trio

from ..errors import VmmApiError, VmmExited


class QmpClient:
    """A connected QMP session. Use `QmpClient.connect()`; close with `aclose()`."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self._stream = stream
        self._buf = bytearray()
        self._lock = trio.Lock()
        self._ids = itertools.count(1)
        self.events: list[dict[str, Any]] = []

    @classmethod
    async def connect(cls, path: Path) -> QmpClient:
        stream = await trio.open_unix_socket(str(path))
        client = cls(stream)
        try:
            greeting = await client._read_message()
            if "QMP" not in greeting:
                raise VmmApiError("unexpected QMP greeting", detail=json.dumps(greeting))
            await client.execute("qmp_capabilities")
        except BaseException:
            await stream.aclose()
            raise
        return client

    async def aclose(self) -> None:
        await self._stream.aclose()

    async def _read_message(self) -> dict[str, Any]:
        while True:
            nl = self._buf.find(b"\n")
            if nl >= 0:
                line = bytes(self._buf[: nl + 1])
                del self._buf[: nl + 1]
                if line.strip():
                    msg = json.loads(line)
                    if not isinstance(msg, dict):
                        raise VmmApiError("QMP sent a message that is not a JSON object", detail=line.decode())
                    return msg
                continue
            try:
                chunk = await self._stream.receive_some(65536)
            except (trio.BrokenResourceError, trio.ClosedResourceError) as e:
                raise VmmExited(f"QMP connection lost: {e}") from e
            if not chunk:
                raise VmmExited("QEMU closed its QMP socket")
            self._buf += chunk

    async def execute(self, command: str, arguments: dict[str, Any] | None = None) -> Any:
        """Run one command; its `return` value. A QMP error raises VmmApiError."""
        msg_id = next(self._ids)
        msg: dict[str, Any] = {"execute": command, "id": msg_id}
        if arguments:
            msg["arguments"] = arguments
        async with self._lock:
            try:
                await self._stream.send_all(json.dumps(msg).encode() + b"\n")
            except (trio.BrokenResourceError, trio.ClosedResourceError) as e:
                raise VmmExited(f"QMP connection lost sending {command}") from e
            while True:
                reply = await self._read_message()
                if "event" in reply:
                    self.events.append(reply)
                    continue
                if reply.get("id") != msg_id:
                    continue
                if "error" in reply:
                    err = reply["error"]
                    raise VmmApiError(f"QMP {command} failed", detail=f"{err.get('class')}: {err.get('desc')}")
                return reply.get("return")
