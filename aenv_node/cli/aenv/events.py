"""``aenv events`` (the node's state-change events) and ``aenv logs`` (a sandbox's logs).

``GET /events?sandboxID=&limit=`` answers the newest events first; ``--follow`` then polls it with ``after``
(the last id seen), which answers the events after it oldest first, page by page, so a burst loses nothing.
``aenv logs`` pages through E2B's ``GET /v2/sandboxes/{id}/logs`` from a millisecond cursor (see
:class:`_LogCursor`), with the route's level and search filters; ``--follow`` polls it from the last line seen.
"""

from __future__ import annotations

import json
import time
from typing import Any, Optional

import click

from .conn import Conn, connection_options
from .output import print_table

__all__ = ["PAGE", "register"]

PAGE = 100
LOG_PAGE = 1000
POLL_S = 1.0


def _event_row(e: dict[str, Any]) -> tuple[Any, ...]:
    states = f"{e.get('fromState') or '-'} -> {e.get('toState') or '-'}"
    ms = e.get("durationMs")
    return (str(e.get("ts", ""))[:23], e.get("sandboxID") or e.get("subjectID") or "", e.get("operation"), states,
            "" if ms is None else f"{ms:.0f} ms", e.get("error") or "")


_HEADER = ("TIME", "SUBJECT", "OPERATION", "STATE", "TOOK", "ERROR")


@click.command("events")
@click.option("--sandbox", "sandbox_id", default=None, metavar="ID", help="Only this sandbox's events.")
@click.option("-f", "--follow", is_flag=True, help="Keep printing new events (Ctrl-C to stop).")
@click.option("--limit", type=click.IntRange(1, 10_000), default=PAGE, show_default=True,
              help="How many recent events to show first.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@connection_options
def events_cmd(conn: Conn, sandbox_id: Optional[str], follow: bool, limit: int, as_json: bool) -> None:
    """Show the node's state-change events (create, pause, resume, snapshot, fork, kill...), oldest first."""
    params: dict[str, Any] = {"limit": limit}
    if sandbox_id:
        params["sandboxID"] = sandbox_id
    events = list(reversed(conn.api.json("GET", "/events", params=params)))

    def emit(batch: list[dict[str, Any]], header: bool) -> None:
        if as_json:
            for e in batch:
                click.echo(json.dumps(e, default=str))
        elif header:
            print_table(_HEADER, [_event_row(e) for e in batch], empty="no events")
        else:
            for e in batch:
                click.echo("  ".join(str(c) for c in _event_row(e)).rstrip())

    emit(events, header=True)
    if not follow:
        return
    last = max((int(e["id"]) for e in events), default=0)
    params["limit"] = PAGE
    while True:
        time.sleep(POLL_S)
        while True:  # every page after the last event seen
            fresh = conn.api.json("GET", "/events", params={**params, "after": last})
            if fresh:
                last = int(fresh[-1]["id"])
                emit(fresh, header=False)
            if len(fresh) < PAGE:
                break


def _unix_ms(ts: Any) -> Optional[int]:
    """A log entry's timestamp (RFC 3339, as the node sends it) as unix ms: the routes' cursor."""
    if isinstance(ts, str):
        from datetime import datetime

        try:
            return int(datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp() * 1000)
        except ValueError:
            return None
    return None


class _LogCursor:
    """Where the next page of a sandbox's logs starts. The cursor is a millisecond and pages include it, so
    the entries already printed at that millisecond (in the node's order, which is stable) are skipped."""

    def __init__(self) -> None:
        self.ms: Optional[int] = None
        self.seen_at_ms = 0

    def fresh(self, entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
        skip = self.seen_at_ms
        out: list[dict[str, Any]] = []
        for e in entries:
            ms = _unix_ms(e.get("timestamp"))
            if ms is not None and ms == self.ms and skip > 0:
                skip -= 1
                continue
            out.append(e)
            if ms is not None:
                if ms != self.ms:
                    self.ms, self.seen_at_ms = ms, 0
                self.seen_at_ms += 1
        return out


@click.command("logs")
@click.argument("sandbox_id")
@click.option("-f", "--follow", is_flag=True, help="Keep printing new lines (Ctrl-C to stop).")
@click.option("--level", type=click.Choice(["debug", "info", "warn", "error"]), default=None,
              help="Only lines of this level or worse.")
@click.option("--search", default=None, metavar="TEXT", help="Only lines containing TEXT (any case).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@connection_options
def logs_cmd(conn: Conn, sandbox_id: str, follow: bool, level: Optional[str], search: Optional[str],
             as_json: bool) -> None:
    """Show a sandbox's logs: its console (kernel, init) and envd, kept across pause and resume, oldest first."""
    cursor = _LogCursor()
    filters = {k: v for k, v in (("level", level), ("search", search)) if v}
    while True:
        while True:  # every page from the cursor on
            params: dict[str, Any] = {"direction": "forward", "limit": LOG_PAGE, **filters}
            if cursor.ms is not None:
                params["cursor"] = cursor.ms
            page = (conn.api.json("GET", f"/v2/sandboxes/{sandbox_id}/logs", params=params) or {}).get("logs") or []
            fresh = cursor.fresh(page)
            for entry in fresh:
                if as_json:
                    click.echo(json.dumps(entry, default=str))
                else:
                    source = (entry.get("fields") or {}).get("source", "")
                    click.echo(f"{str(entry.get('timestamp', ''))[:23]} {entry.get('level', ''):5} {source:7} "
                               f"{entry.get('message', '')}".rstrip())
            if len(page) < LOG_PAGE:
                break
            if not fresh and cursor.ms is not None:  # a full page at one millisecond: step past it
                cursor.ms, cursor.seen_at_ms = cursor.ms + 1, 0
        if not follow:
            return
        time.sleep(POLL_S)


def register(group: click.Group) -> None:
    group.add_command(events_cmd)
    group.add_command(logs_cmd)
