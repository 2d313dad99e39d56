"""``aenv exec ID -- CMD ...``: run a command in a sandbox, stream its output, exit with its exit code.

Through the e2b SDK's ``sandbox.commands.run`` (envd's process service): the command line is joined with
shell quoting and run by ``bash -l -c`` as E2B does, so ``aenv exec ID -- ls -la '/my dir'`` means what it
says. stdout and stderr are streamed to ours as they arrive; there is no stdin (use ``aenv cn`` for that).
"""

from __future__ import annotations

import shlex
import sys
from typing import Callable

import click

from .conn import Conn, connection_options
from .output import parse_kv

__all__ = ["register"]


@click.command("exec", context_settings={"ignore_unknown_options": True})
@click.argument("sandbox_id")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@click.option("--user", default=None, help="Guest user (default `user`; `root` for root).")
@click.option("--cwd", default=None, metavar="DIR", help="Working directory.")
@click.option("--env", "envs", multiple=True, metavar="K=V", help="Environment variable (repeatable).")
@click.option("--timeout", type=click.FloatRange(min=0), default=0, metavar="S",
              help="Kill the command after S seconds (0: never).")
@connection_options
def exec_cmd(conn: Conn, sandbox_id: str, command: tuple[str, ...], user: str | None, cwd: str | None,
             envs: tuple[str, ...], timeout: float) -> None:
    """Run COMMAND in sandbox ID (put `--` before it): its stdout and stderr are streamed, and aenv exits
    with its exit code. A paused sandbox is resumed first."""
    from e2b import CommandExitException

    env = parse_kv(envs, "--env")
    sandbox = conn.sandbox(sandbox_id)

    def write(stream: str) -> Callable[[str], None]:
        target = sys.stdout if stream == "out" else sys.stderr

        def emit(text: str) -> None:
            target.write(text)
            target.flush()

        return emit

    try:
        sandbox.commands.run(shlex.join(command), user=user, cwd=cwd, envs=env or None, timeout=timeout,
                             on_stdout=write("out"), on_stderr=write("err"), retain_output=False)
    except CommandExitException as exc:
        raise click.exceptions.Exit(exc.exit_code) from None


def register(group: click.Group) -> None:
    group.add_command(exec_cmd)
