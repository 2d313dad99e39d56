"""Processes started by envd: spawn, output fan-out, stdin/pty input, signals, end.

A process belongs to the :class:`ProcessManager` (its task runs in the
manager's nursery), never to the request that started it: a client may
disconnect and reconnect (``Connect``) and the process keeps running, as in
E2B's envd. The only deadline is the one the starting request gave
(``Connect-Timeout-Ms``): when it passes, the process is SIGKILLed.

Output is read in chunks of at most 32 KiB (16 KiB from a pty) and broadcast
to every subscribed stream through bounded channels, so a slow client slows
the process down instead of growing memory; with no subscriber the output is
dropped.
"""

from __future__ import annotations

import base64
import fcntl
import logging
import os
import signal
import struct
import subprocess
import termios
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from .errors import ConnectError
from .users import User

log = logging.getLogger("envd.process")

STD_CHUNK = 32 * 1024
PTY_CHUNK = 16 * 1024
_SUBSCRIBER_BUFFER = 64
# Started processes are the first the OOM killer takes, before envd (as in E2B).
_CHILD_OOM_SCORE = 100

# Go's names for signals (syscall.Signal.String), used in "signal: <name>".
_SIGNAL_NAMES = {
    signal.SIGHUP: "hangup",
    signal.SIGINT: "interrupt",
    signal.SIGQUIT: "quit",
    signal.SIGILL: "illegal instruction",
    signal.SIGTRAP: "trace/breakpoint trap",
    signal.SIGABRT: "aborted",
    signal.SIGBUS: "bus error",
    signal.SIGFPE: "floating point exception",
    signal.SIGKILL: "killed",
    signal.SIGUSR1: "user defined signal 1",
    signal.SIGSEGV: "segmentation fault",
    signal.SIGUSR2: "user defined signal 2",
    signal.SIGPIPE: "broken pipe",
    signal.SIGALRM: "alarm clock",
    signal.SIGTERM: "terminated",
}


def end_event(returncode: int) -> dict[str, Any]:
    """The EndEvent Go's os.ProcessState would give for this return code."""
    if returncode >= 0:
        status = f"exit status {returncode}"
        end: dict[str, Any] = {"exitCode": returncode, "exited": True, "status": status}
    else:
        signum = -returncode
        try:
            name = _SIGNAL_NAMES.get(signal.Signals(signum), f"signal {signum}")
        except ValueError:
            name = f"signal {signum}"
        status = f"signal: {name}"
        end = {"exitCode": -1, "exited": False, "status": status}
    if returncode != 0:
        end["error"] = status
    return end


@dataclass
class StartSpec:
    cmd: str
    args: list[str]
    envs: dict[str, str]
    cwd: str
    user: User
    env_defaults: dict[str, str]
    tag: str | None = None
    pty_size: tuple[int, int] | None = None  # (cols, rows)
    stdin: bool = True
    config: dict[str, Any] = field(default_factory=dict)  # as the client sent it


def _set_winsize(fd: int, cols: int, rows: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def _make_controlling_tty() -> None:  # runs in the child, after setsid
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


class ManagedProcess:
    """One running process and everything envd holds for it."""

    def __init__(self, spec: StartSpec, deadline: float) -> None:
        self.spec = spec
        self.tag = spec.tag
        self.config = spec.config
        self.deadline = deadline
        self.pid = 0
        self._proc: trio.Process | None = None
        self._pty: trio.lowlevel.FdStream | None = None
        self._stdin: trio.abc.SendStream | None = None
        self._input_lock = trio.Lock()
        self._subscribers: set[trio.MemorySendChannel[dict[str, Any]]] = set()
        self._out_scope: trio.CancelScope | None = None
        self.end: dict[str, Any] | None = None

    # ----- subscriptions ---------------------------------------------------
    def subscribe(self) -> trio.MemoryReceiveChannel[dict[str, Any]]:
        send, receive = trio.open_memory_channel[dict[str, Any]](_SUBSCRIBER_BUFFER)
        if self.end is not None:
            send.send_nowait({"end": self.end})
            send.close()
        else:
            self._subscribers.add(send)
        return receive

    async def _broadcast(self, event: dict[str, Any]) -> None:
        for channel in list(self._subscribers):
            try:
                await channel.send(event)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self._subscribers.discard(channel)

    # ----- spawning -------------------------------------------------------
    async def spawn(self) -> None:
        spec = self.spec
        env = {
            "PATH": os.environ.get("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"),
            "HOME": spec.user.home,
            "USER": spec.user.name,
            "LOGNAME": spec.user.name,
        }
        env.update(spec.env_defaults)
        env.update(spec.envs)
        options: dict[str, Any] = {"cwd": spec.cwd, "env": env, "close_fds": True}
        if spec.user.uid != os.getuid() or spec.user.gid != os.getgid():
            options.update(user=spec.user.uid, group=spec.user.gid, extra_groups=spec.user.groups())
        argv = [spec.cmd, *spec.args]
        if spec.pty_size is not None:
            cols, rows = spec.pty_size
            master, slave = os.openpty()
            try:
                _set_winsize(slave, cols, rows)
                self._proc = await trio.lowlevel.open_process(
                    argv, stdin=slave, stdout=slave, stderr=slave,
                    start_new_session=True, preexec_fn=_make_controlling_tty, **options,
                )
            except BaseException:
                os.close(master)
                raise
            finally:
                os.close(slave)
            self._pty = trio.lowlevel.FdStream(master)
        else:
            self._proc = await trio.lowlevel.open_process(
                argv,
                stdin=subprocess.PIPE if spec.stdin else subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, **options,
            )
            self._stdin = self._proc.stdin
        self.pid = self._proc.pid
        _adjust_oom_score(self.pid, _CHILD_OOM_SCORE)

    # ----- the process's life ---------------------------------------------
    async def run(self, on_done: Callable[["ManagedProcess"], None]) -> None:
        assert self._proc is not None
        proc = self._proc
        try:
            with trio.CancelScope(deadline=self.deadline) as timeout_scope:
                async with trio.open_nursery() as readers:
                    self._out_scope = readers.cancel_scope
                    if self._pty is not None:
                        readers.start_soon(self._pump, self._pty, "pty", PTY_CHUNK)
                    else:
                        readers.start_soon(self._pump, proc.stdout, "stdout", STD_CHUNK)
                        readers.start_soon(self._pump, proc.stderr, "stderr", STD_CHUNK)
                await proc.wait()
            if timeout_scope.cancelled_caught and proc.returncode is None:
                log.info("process %d passed its deadline: killing it", self.pid)
                proc.kill()
                await proc.wait()
        finally:
            with trio.CancelScope(shield=True):
                rc = proc.returncode
                if rc is None:
                    proc.kill()
                    rc = await proc.wait()
                for stream in (self._pty, proc.stdin, proc.stdout, proc.stderr):
                    if stream is not None:
                        try:
                            await stream.aclose()
                        except Exception:  # already closed / broken: nothing to free
                            pass
                self.end = end_event(rc)
                on_done(self)
            try:  # not shielded: a stuck client must not hold up envd's shutdown
                await self._broadcast({"end": self.end})
            finally:
                for channel in self._subscribers:
                    channel.close()
                self._subscribers.clear()

    async def _pump(self, stream: trio.abc.ReceiveStream | None, key: str, chunk: int) -> None:
        if stream is None:
            return
        while True:
            try:
                data = await stream.receive_some(chunk)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                return  # EIO on a pty master once the last slave fd is gone
            if not data:
                return
            await self._broadcast({"data": {key: base64.b64encode(data).decode("ascii")}})

    # ----- control --------------------------------------------------------
    def send_signal(self, signum: int) -> None:
        assert self._proc is not None
        if signum in (signal.SIGKILL, signal.SIGTERM) and self._out_scope is not None:
            # As E2B's envd: stop waiting for output that descendants may hold open.
            self._out_scope.cancel()
        if self._proc.returncode is None:
            self._proc.send_signal(signum)

    async def write_stdin(self, data: bytes) -> None:
        if self._pty is not None:
            raise ConnectError("internal", "error writing to stdin: tty assigned to process — input should be written to the pty, not the stdin")
        async with self._input_lock:
            if self._stdin is None:
                raise ConnectError("internal", "error writing to stdin: stdin not enabled or closed")
            try:
                await self._stdin.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                raise ConnectError("internal", f"error writing to stdin: error writing to stdin of process '{self.pid}': {exc}") from exc

    async def write_pty(self, data: bytes) -> None:
        if self._pty is None:
            raise ConnectError("internal", "error writing to tty: tty not assigned to process — input should be written to the stdin, not the tty")
        async with self._input_lock:
            try:
                await self._pty.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                raise ConnectError("internal", f"error writing to tty: error writing to tty of process '{self.pid}': {exc}") from exc

    async def close_stdin(self) -> None:
        if self._pty is not None:
            raise ConnectError("unknown", "error closing stdin: cannot close stdin for PTY process — send Ctrl+D (0x04) instead")
        async with self._input_lock:
            stdin, self._stdin = self._stdin, None
            if stdin is not None:
                await stdin.aclose()

    def resize(self, cols: int, rows: int) -> None:
        if self._pty is None:
            raise ConnectError("internal", "error resizing tty: tty not assigned to process")
        try:
            _set_winsize(self._pty.fileno(), cols, rows)
        except OSError as exc:
            raise ConnectError("internal", f"error resizing tty: {exc}") from exc


class ProcessManager:
    """Every process envd started and still running, by pid."""

    def __init__(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        self.processes: dict[int, ManagedProcess] = {}

    async def start(self, spec: StartSpec, deadline: float) -> tuple[ManagedProcess, trio.MemoryReceiveChannel[dict[str, Any]]]:
        """Spawn; the returned subscription sees all of the process's output."""
        process = ManagedProcess(spec, deadline)
        subscription = process.subscribe()
        try:
            await process.spawn()
        except (OSError, subprocess.SubprocessError, ValueError) as exc:
            subscription.close()
            raise ConnectError(
                "invalid_argument",
                f"error starting process '{' '.join([spec.cmd, *spec.args])}': {_describe(exc)}",
            ) from exc
        self.processes[process.pid] = process
        self._nursery.start_soon(process.run, self._forget)
        log.info("started process %d: %s %s", process.pid, spec.cmd, spec.args)
        return process, subscription

    def _forget(self, process: ManagedProcess) -> None:
        self.processes.pop(process.pid, None)
        log.info("process %d ended: %s", process.pid, process.end)

    def select(self, selector: dict[str, Any] | None) -> ManagedProcess:
        selector = selector or {}
        if "pid" in selector:
            try:
                pid = int(selector["pid"])
            except (TypeError, ValueError):
                raise ConnectError("invalid_argument", f"invalid pid {selector['pid']!r}") from None
            process = self.processes.get(pid)
            if process is None:
                raise ConnectError("not_found", f"process with pid {pid} not found")
            return process
        if "tag" in selector:
            tag = selector["tag"]
            for process in self.processes.values():
                if process.tag == tag:
                    return process
            raise ConnectError("not_found", f"process with tag {tag} not found")
        raise ConnectError("unimplemented", "invalid input type <nil>")


def _adjust_oom_score(pid: int, score: int) -> None:
    try:
        with open(f"/proc/{pid}/oom_score_adj", "w") as f:
            f.write(str(score))
    except OSError as exc:  # the process may be gone already; not worth failing for
        log.debug("could not set oom_score_adj of %d: %s", pid, exc)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        target = f": {exc.filename}" if exc.filename else ""
        return f"{exc.strerror}{target}"
    return str(exc)
