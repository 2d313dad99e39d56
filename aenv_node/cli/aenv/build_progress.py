"""Following a template build: poll the node's build status and show its log as live progress.

``GET /templates/{id}/builds/{buildID}/status?logsOffset=N`` pages through the build log (``docs/templates.md``).
On a terminal the node's structured lines become rich progress rows, one per image layer being pulled
(``pulling sha256:… (8.0 MiB)`` … ``pulled …``), one for the layers' conversion (``layer i/n …``) and one for
the build steps (``step i/n …``); every other line is printed above them. Elsewhere (a pipe, CI) the log is
printed as plain lines, ``HH:MM:SS level message``.

The node reports a layer's pull when it starts and ends, not its bytes, so a pull row is a spinner, not a bar.
"""

from __future__ import annotations

import re
import sys
import time
from typing import Any, Optional

import click

from .conn import Conn

__all__ = ["BuildView", "follow_build"]

_PULLING = re.compile(r"^pulling (sha256:\S+) \((.+)\)$")
_PULLED = re.compile(r"^pulled (sha256:\S+) \((.+)\) in (\S+)$")
_PRESENT = re.compile(r"^(sha256:\S+) already present")
_LAYER = re.compile(r"^layer (\d+)/(\d+) (sha256:\S+)")
_STEP = re.compile(r"^step (\d+)/(\d+) (.*?)(: cached)?$")


class BuildView:
    """Renders build log entries (dicts with ``timestamp``, ``level``, ``message``) as they arrive."""

    def __init__(self, live: Optional[bool] = None) -> None:
        self.live = sys.stderr.isatty() if live is None else live
        self.progress: Any = None
        self.pulls: dict[str, Any] = {}
        self.layers: Any = None
        self.steps: Any = None
        if self.live:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn

            self.progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                                     MofNCompleteColumn(), console=Console(stderr=True), transient=False)

    def __enter__(self) -> BuildView:
        if self.progress is not None:
            self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.progress is not None:
            self.progress.stop()

    def entry(self, e: dict[str, Any]) -> None:
        message = str(e.get("message", ""))
        level = str(e.get("level", "info"))
        if self.progress is None or not self._track(message):
            self._print(str(e.get("timestamp", "")), level, message)

    def _print(self, ts: str, level: str, message: str) -> None:
        clock = ts[11:23] if len(ts) >= 23 else ts
        if self.progress is None:
            click.echo(f"{clock} {level} {message}", err=True)
            return
        from rich.text import Text

        style = "red" if level == "error" else ("dim" if level == "debug" else "")
        self.progress.console.print(Text(f"{clock} {message}", style=style))

    def _track(self, message: str) -> bool:
        """Update the progress rows for a structured line; False when the line is not one of them."""
        p = self.progress
        if m := _PULLING.match(message):
            self.pulls[m[1]] = p.add_task(f"pull {m[1]} ({m[2]})", total=None)
        elif m := _PULLED.match(message):
            task = self.pulls.pop(m[1], None) or p.add_task("", total=None)
            p.update(task, description=f"pulled {m[1]} ({m[2]}) in {m[3]}", total=1, completed=1)
        elif m := _PRESENT.match(message):
            p.add_task(message, total=1, completed=1)
        elif m := _LAYER.match(message):
            i, n = int(m[1]), int(m[2])
            if self.layers is None:
                self.layers = p.add_task("layers", total=n)
            p.update(self.layers, description=f"layer {message.split(' ', 1)[1]}", completed=i)
        elif m := _STEP.match(message):
            i, n = int(m[1]), int(m[2])
            if self.steps is None:
                self.steps = p.add_task("steps", total=n)
            p.update(self.steps, description=f"step {i}/{n} {m[3]}{m[4] or ''}", completed=i if m[4] else i - 1)
        else:
            return False
        return True

    def done(self, ok: bool) -> None:
        if self.progress is not None and ok and self.steps is not None:
            self.progress.update(self.steps, completed=self.progress.tasks[self.steps].total)


def follow_build(conn: Conn, template_id: str, build_id: str, timeout: Optional[float] = None,
                 interval: float = 0.5, view: Optional[BuildView] = None) -> dict[str, Any]:
    """Print the build's log until it is ``ready`` (return its status) or ``error`` (one-line exception)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    offset = 0
    with view or BuildView() as v:
        while True:
            status = conn.api.json("GET", f"/templates/{template_id}/builds/{build_id}/status",
                                   params={"logsOffset": offset})
            entries = status.get("logEntries") or []
            for e in entries:
                v.entry(e)
            offset += len(entries)
            state = status.get("status")
            if state in ("ready", "error") and not entries:
                v.done(state == "ready")
                break
            if deadline is not None and time.monotonic() > deadline:
                raise click.ClickException(f"build {build_id} is still {state} after {timeout:g}s "
                                           f"(follow it: aenv template watch {build_id})")
            if not entries:
                time.sleep(interval)
    if state == "error":
        reason = status.get("reason") or {}
        step = f" (step {reason['step']})" if reason.get("step") else ""
        raise click.ClickException(f"build {build_id} failed{step}: {' '.join(str(reason.get('message')).split())}")
    return status
