"""What every command shares for output: JSON, tables (rich), ``K=V`` flags, and one line per error.

:class:`AenvGroup` is the ``click.Group`` of the ``aenv`` command tree: whatever a command raises (an SDK
exception, a network error, a local file error) leaves the process as ONE line on stderr and exit code 1;
Ctrl-C is exit code 130. A traceback is shown only with ``AENV_DEBUG=1``.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Iterable, Sequence

import click

__all__ = ["AenvGroup", "echo_json", "err", "one_line", "parse_kv", "print_table"]


def one_line(exc: BaseException) -> str:
    """An exception as one line: its message with whitespace folded, else its type's name."""
    text = " ".join(str(exc).split())
    name = type(exc).__name__
    if not text:
        return name
    # the SDK's exceptions carry their meaning in the type (SandboxNotFoundException: <message>)
    if type(exc).__module__.startswith("e2b") and name not in text:
        return f"{name.removesuffix('Exception') or name}: {text}"
    return text


class AenvGroup(click.Group):
    """A group whose subcommands' failures become one line (``Error: ...``) and a non-zero exit code."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException):
            raise
        except KeyboardInterrupt:
            raise click.exceptions.Exit(130) from None
        except Exception as exc:
            if os.environ.get("AENV_DEBUG"):
                raise
            raise click.ClickException(one_line(exc)) from None


def err(message: str) -> None:
    click.echo(message, err=True)


def echo_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, default=str))


def parse_kv(items: Iterable[str], flag: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{item!r}: expected KEY=VALUE", param_hint=flag)
        out[key] = value
    return out


def print_table(header: Sequence[str], rows: Iterable[Sequence[Any]], empty: str = "nothing") -> None:
    """A plain-looking table (rich on a terminal, aligned text in a pipe so `grep`/`awk` work)."""
    rows = [["" if c is None else str(c) for c in row] for row in rows]
    if not rows:
        click.echo(empty)
        return
    if sys.stdout.isatty():
        from rich.console import Console
        from rich.table import Table
        from rich.text import Text

        table = Table(box=None, pad_edge=False, header_style="bold")
        for h in header:
            table.add_column(h, overflow="fold")
        for row in rows:
            table.add_row(*(Text(c) for c in row))
        Console().print(table)
        return
    table_rows = [list(header)] + rows
    widths = [max(len(r[i]) for r in table_rows) for i in range(len(header))]
    for r in table_rows:
        click.echo("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
