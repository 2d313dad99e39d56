"""The ``process.Process`` Connect service: the RPC face of :mod:`.process`."""

from __future__ import annotations

import base64
import binascii
import os
import signal
from collections.abc import AsyncIterator
from typing import Any

import trio

from .connect import CallContext, Message, Method, ServerStream
from .errors import ConnectError
from .process import ManagedProcess, ProcessManager, StartSpec
from .state import EnvdState
from .users import UnknownUser, User, basic_auth_username, resolve_path

_SIGNALS = {
    "SIGNAL_SIGKILL": signal.SIGKILL, 9: signal.SIGKILL, "9": signal.SIGKILL,
    "SIGNAL_SIGTERM": signal.SIGTERM, 15: signal.SIGTERM, "15": signal.SIGTERM,
}


def request_user(ctx: CallContext, state: EnvdState) -> User:
    """The user of an RPC: Basic auth user name, else the default user."""
    name = basic_auth_username(ctx.headers.get("authorization"))
    try:
        return state.user(name)
    except UnknownUser:
        if name:
            raise ConnectError("unauthenticated", f"invalid username: '{name}'") from None
        raise ConnectError("unauthenticated", f"invalid default user: '{state.default_user}'") from None


def _bytes(value: Any, what: str) -> bytes:
    if not isinstance(value, str):
        raise ConnectError("invalid_argument", f"{what}: bytes must be a base64 string")
    try:
        return base64.b64decode(value + "=" * (-len(value) % 4), altchars=b"-_" if ("-" in value or "_" in value) else None)
    except (binascii.Error, ValueError) as exc:
        raise ConnectError("invalid_argument", f"{what}: invalid base64: {exc}") from exc


def _uint(value: Any, what: str) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ConnectError("invalid_argument", f"{what}: invalid integer {value!r}") from None
    if number < 0:
        raise ConnectError("invalid_argument", f"{what}: must not be negative")
    return number


class ProcessService:
    def __init__(self, manager: ProcessManager, state: EnvdState) -> None:
        self.manager = manager
        self.state = state

    def methods(self) -> dict[str, Method]:
        prefix = "/process.Process/"
        return {
            prefix + "Start": Method("server_stream", self.start),
            prefix + "Connect": Method("server_stream", self.connect),
            prefix + "List": Method("unary", self.list),
            prefix + "SendInput": Method("unary", self.send_input),
            prefix + "StreamInput": Method("client_stream", self.stream_input),
            prefix + "SendSignal": Method("unary", self.send_signal),
            prefix + "CloseStdin": Method("unary", self.close_stdin),
            prefix + "Update": Method("unary", self.update),
        }

    # ----- streams ----------------------------------------------------------
    async def start(self, ctx: CallContext, msg: Message, stream: ServerStream) -> None:
        user = request_user(ctx, self.state)
        config = msg.get("process") or {}
        if not isinstance(config, dict):
            raise ConnectError("invalid_argument", "process: must be an object")
        cmd = config.get("cmd") or ""
        raw_args, raw_envs = config.get("args") or [], config.get("envs") or {}
        if not isinstance(raw_args, list) or not isinstance(raw_envs, dict):
            raise ConnectError("invalid_argument", "process: args must be a list and envs a map")
        args = [str(a) for a in raw_args]
        envs = {str(k): str(v) for k, v in raw_envs.items()}
        try:
            cwd = resolve_path(config.get("cwd") or "", user, self.state.default_workdir)
        except ValueError as exc:
            raise ConnectError("invalid_argument", str(exc)) from exc
        if not os.path.exists(cwd):
            raise ConnectError("invalid_argument", f"cwd '{cwd}' does not exist")
        if not cmd:
            raise ConnectError("invalid_argument", "error starting process '': exec: no command")
        if cmd == "/bin/bash" and not os.path.exists(cmd) and os.path.exists("/bin/sh"):
            # The SDKs run every command through /bin/bash; an image without bash (alpine, busybox, distroless
            # with a shell) still has /bin/sh, which takes the same -l, -i and -c.
            cmd = "/bin/sh"
        pty_size = None
        pty = msg.get("pty")
        if isinstance(pty, dict):
            size = pty.get("size") or {}
            pty_size = (_uint(size.get("cols", 0), "pty.size.cols"), _uint(size.get("rows", 0), "pty.size.rows"))
        stdin = msg.get("stdin")
        spec = StartSpec(
            cmd=cmd, args=args, envs=envs, cwd=cwd, user=user,
            env_defaults=dict(self.state.env_vars), tag=msg.get("tag"),
            pty_size=pty_size, stdin=stdin is None or bool(stdin), config=config,
        )
        process, subscription = await self.manager.start(spec, ctx.deadline)
        with subscription:
            await stream.send({"event": {"start": {"pid": process.pid}}})
            await _pump_events(ctx, subscription, stream)

    async def connect(self, ctx: CallContext, msg: Message, stream: ServerStream) -> None:
        process = self.manager.select(msg.get("process"))
        with process.subscribe() as subscription:
            await stream.send({"event": {"start": {"pid": process.pid}}})
            await _pump_events(ctx, subscription, stream)

    # ----- unary ------------------------------------------------------------
    async def list(self, ctx: CallContext, msg: Message) -> Message:
        processes = []
        for process in list(self.manager.processes.values()):
            info: dict[str, Any] = {"config": process.config, "pid": process.pid}
            if process.tag is not None:
                info["tag"] = process.tag
            processes.append(info)
        return {"processes": processes}

    async def send_input(self, ctx: CallContext, msg: Message) -> Message:
        process = self.manager.select(msg.get("process"))
        await _write_input(process, msg.get("input") or {})
        return {}

    async def stream_input(self, ctx: CallContext, messages: AsyncIterator[Message]) -> Message:
        process: ManagedProcess | None = None
        async for message in messages:
            if "start" in message:
                process = self.manager.select((message["start"] or {}).get("process"))
            elif "data" in message:
                if process is None:
                    raise ConnectError("failed_precondition", "data event before the start event")
                await _write_input(process, (message["data"] or {}).get("input") or {})
            elif "keepalive" in message:
                continue
            else:
                raise ConnectError("unimplemented", "invalid event type <nil>")
        return {}

    async def send_signal(self, ctx: CallContext, msg: Message) -> Message:
        process = self.manager.select(msg.get("process"))
        signum = _SIGNALS.get(msg.get("signal", "SIGNAL_UNSPECIFIED"))
        if signum is None:
            raise ConnectError("unimplemented", f"invalid signal: {msg.get('signal', 'SIGNAL_UNSPECIFIED')}")
        try:
            process.send_signal(signum)
        except OSError as exc:
            raise ConnectError("internal", f"error sending signal: {exc}") from exc
        return {}

    async def close_stdin(self, ctx: CallContext, msg: Message) -> Message:
        process = self.manager.select(msg.get("process"))
        await process.close_stdin()
        return {}

    async def update(self, ctx: CallContext, msg: Message) -> Message:
        process = self.manager.select(msg.get("process"))
        pty = msg.get("pty")
        if isinstance(pty, dict):
            size = pty.get("size") or {}
            process.resize(_uint(size.get("cols", 0), "pty.size.cols"), _uint(size.get("rows", 0), "pty.size.rows"))
        return {}


async def _write_input(process: ManagedProcess, data: Message) -> None:
    if "pty" in data:
        await process.write_pty(_bytes(data["pty"], "input.pty"))
    elif "stdin" in data:
        await process.write_stdin(_bytes(data["stdin"], "input.stdin"))
    else:
        raise ConnectError("unimplemented", "invalid input type <nil>")


async def _pump_events(
    ctx: CallContext,
    subscription: trio.MemoryReceiveChannel[dict[str, Any]],
    stream: ServerStream,
) -> None:
    interval = ctx.keepalive_interval()
    while True:
        event = None
        if interval is None:
            try:
                event = await subscription.receive()
            except trio.EndOfChannel:
                return
        else:
            with trio.move_on_after(interval):
                try:
                    event = await subscription.receive()
                except trio.EndOfChannel:
                    return
            if event is None:
                await stream.send({"event": {"keepalive": {}}})
                continue
        await stream.send({"event": event})
        if "end" in event:
            return
