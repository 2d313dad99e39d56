"""``aenv events`` (the node's state-change events) and ``aenv logs`` (a sandbox's logs).

``GET /events?sandboxID=&limit=`` answers the newest events first; ``--follow`` then polls it with ``after``
(the last id seen), which answers the events after it oldest first, page by page, so a burst loses nothing.
``GET /v2/sandboxes/{id}/logs`` is E2B's sandbox log route; the node declares it but answers 501 today, which
``aenv logs`` reports as one line.
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
    """A log entry's timestamp (unix ms or ISO-8601) as unix ms: the next page's cursor."""
    if isinstance(ts, (int, float)):
        return int(ts)
    if isinstance(ts, str):
        from datetime import datetime

        try:
            return int(datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp() * 1000)
        except ValueError:
            return None
    return None


@click.command("logs")
@click.argument("sandbox_id")
@click.option("-f", "--follow", is_flag=True, help="Keep printing new lines (Ctrl-C to stop).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@connection_options
def logs_cmd(conn: Conn, sandbox_id: str, follow: bool, as_json: bool) -> None:
    """Show a sandbox's logs (E2B's `GET /v2/sandboxes/{id}/logs`; the node answers 501 until it keeps them)."""
    cursor: Optional[int] = None
    while True:
        params: dict[str, Any] = {"direction": "forward"}
        if cursor is not None:
            params["cursor"] = cursor
        body = conn.api.json("GET", f"/v2/sandboxes/{sandbox_id}/logs", params=params) or {}
        for entry in body.get("logs") or []:
            if as_json:
                click.echo(json.dumps(entry, default=str))
            else:
                click.echo(f"{str(entry.get('timestamp', ''))[:23]} {entry.get('level', '')} "
                           f"{entry.get('message', entry.get('line', ''))}".rstrip())
            ms = _unix_ms(entry.get("timestamp"))
            if ms is not None:
                cursor = ms + 1
        if not follow:
            return
        time.sleep(POLL_S)


def register(group: click.Group) -> None:
    group.add_command(events_cmd)
    group.add_command(logs_cmd)
