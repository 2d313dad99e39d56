"""An interactive PTY shell in a sandbox: ``aenv cn ID`` and what ``aenv start`` attaches.

Through the e2b SDK: ``Sandbox.connect`` (which resumes a paused sandbox), ``sandbox.pty.create`` (a login
bash in a PTY sized like this terminal), ``pty.send_stdin`` and ``pty.resize``. The local terminal is put in
raw mode, so every key (Ctrl-C, Ctrl-D, Ctrl-Z, arrows) goes to the guest; SIGWINCH resizes the guest's PTY.
The exit code is the shell's.

Threads: the PTY's output is read by a helper thread (the SDK's iterator blocks); the main thread waits on
stdin and a self-pipe with ``select`` so that signal handlers (SIGWINCH) run promptly and the loop ends as
soon as the shell does. ``termios``/``tty``/``select`` on a pipe are POSIX: they are imported only when a
shell is attached, so the rest of the CLI works everywhere.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
from typing import Any

import click

from .conn import Conn, connection_options
from .output import parse_kv

__all__ = ["attach_shell", "register"]


def _terminal_size() -> tuple[int, int]:
    size = shutil.get_terminal_size((80, 24))
    return size.lines, size.columns


def attach_shell(conn: Conn, sandbox_id: str, *, user: str | None = None, cwd: str | None = None,
                 envs: dict[str, str] | None = None) -> int:
    """Attach this terminal to a new login shell in the sandbox; return the shell's exit status."""
    if os.name != "posix":
        raise click.ClickException("an interactive shell needs a POSIX terminal; use `aenv exec ID -- CMD`")
    import select
    import signal

    from e2b import CommandExitException, PtySize

    sandbox = conn.sandbox(sandbox_id)
    rows, cols = _terminal_size()
    handle = sandbox.pty.create(PtySize(rows=rows, cols=cols), user=user, cwd=cwd, envs=envs, timeout=0)
    pid = handle.pid
    out = sys.stdout.buffer
    outcome: dict[str, Any] = {}
    wake_r, wake_w = os.pipe()

    def write(data: bytes) -> None:
        out.write(data)
        out.flush()

    def read_output() -> None:
        try:
            result = handle.wait(on_pty=write)
            outcome["code"] = result.exit_code
        except CommandExitException as exc:
            outcome["code"] = exc.exit_code
        except BaseException as exc:  # reported by the main thread
            outcome["error"] = exc
        finally:
            try:
                os.write(wake_w, b"x")
            except OSError:  # the main loop already ended (it failed) and closed the pipe
                pass

    resized = threading.Event()

    def on_winch(_signum: int, _frame: Any) -> None:
        resized.set()
        os.write(wake_w, b"w")

    stdin_fd = sys.stdin.fileno()
    is_tty = os.isatty(stdin_fd)
    saved_attrs = None
    old_winch = signal.signal(signal.SIGWINCH, on_winch)
    if is_tty:
        import termios
        import tty

        saved_attrs = termios.tcgetattr(stdin_fd)
        tty.setraw(stdin_fd)
    reader = threading.Thread(target=read_output, name="aenv-pty-output", daemon=True)
    reader.start()
    stdin_open = True
    try:
        while reader.is_alive():
            watched = [wake_r, stdin_fd] if stdin_open else [wake_r]
            ready, _, _ = select.select(watched, [], [], 1.0)
            if wake_r in ready:
                os.read(wake_r, 1024)
            if resized.is_set():
                resized.clear()
                rows, cols = _terminal_size()
                sandbox.pty.resize(pid, PtySize(rows=rows, cols=cols))
            if stdin_open and stdin_fd in ready:
                data = os.read(stdin_fd, 4096)
                if data:
                    sandbox.pty.send_stdin(pid, data)
                else:  # end of a piped stdin: end the shell's input as a terminal's Ctrl-D would
                    stdin_open = False
                    sandbox.pty.send_stdin(pid, b"\x04")
    finally:
        if saved_attrs is not None:
            import termios

            termios.tcsetattr(stdin_fd, termios.TCSADRAIN, saved_attrs)
        signal.signal(signal.SIGWINCH, old_winch)
        os.close(wake_r)
        os.close(wake_w)
    reader.join(timeout=5)
    if "error" in outcome:
        raise outcome["error"]
    return int(outcome.get("code", 0))


@click.command("cn")
@click.argument("sandbox_id")
@click.option("--user", default=None, help="Guest user (default: the sandbox's, `user`).")
@click.option("--cwd", default=None, metavar="DIR", help="Working directory of the shell.")
@click.option("--env", "envs", multiple=True, metavar="K=V", help="Environment variable (repeatable).")
@connection_options
def cn_cmd(conn: Conn, sandbox_id: str, user: str | None, cwd: str | None, envs: tuple[str, ...]) -> None:
    """Open an interactive shell in a running or paused sandbox (a paused one is resumed).

    The terminal is in raw mode: Ctrl-C goes to the guest; `exit` (or Ctrl-D) leaves, with the shell's
    exit status.
    """
    raise click.exceptions.Exit(attach_shell(conn, sandbox_id, user=user, cwd=cwd, envs=parse_kv(envs, "--env")))


def register(group: click.Group) -> None:
    group.add_command(cn_cmd)
