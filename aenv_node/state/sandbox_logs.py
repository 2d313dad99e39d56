"""A sandbox's log lines (the ``sandbox_logs`` table): the one module that writes, bounds, reads and expires them.

Lines come from the sandbox's console (kernel, init, envd; ``runtime/console_log.py`` reads and classifies
them) and are served by E2B's logs routes. How far a run's console has been read (``console_offsets``) is
written in the transaction that stores the lines it covers (:func:`store_console`), so a reader taking a run
over after the node was killed stores each line once. They live in SQLite beside the sandbox's row, so a paused sandbox
keeps them and a person can read them with ``sqlite3``. Two bounds keep the table small: each sandbox keeps at
most ``keep`` lines (the oldest go, in the transaction that writes new ones), and the lines of a sandbox that
ended go ``logs.retention_s`` after its end (:func:`expire_ended`).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from sqlalchemy import and_, delete, func, or_, select
from sqlalchemy.orm import Session

from .models import ConsoleOffset, Sandbox, SandboxLog, SandboxState

__all__ = ["LEVELS", "LogLine", "append_lines", "console_offset", "expire_ended", "read_lines", "store_console"]

#: E2B's log levels, least severe first (a ``level`` filter keeps that level and the ones after it).
LEVELS: tuple[str, ...] = ("debug", "info", "warn", "error")


@dataclass(frozen=True)
class LogLine:
    """One line as it is stored."""

    ts: dt.datetime
    level: str  # one of LEVELS
    source: str  # kernel | init | envd | console
    message: str
    logger: Optional[str] = None


def append_lines(s: Session, sandbox_id: str, lines: Sequence[LogLine], *, keep: int) -> int:
    """Add ``lines`` to the sandbox's logs and drop its oldest beyond ``keep``; returns how many were dropped."""
    if not lines:
        return 0
    s.add_all(SandboxLog(sandbox_id=sandbox_id, ts=ln.ts, level=ln.level, source=ln.source, logger=ln.logger,
                         message=ln.message) for ln in lines)
    s.flush()
    # the newest line that must go: the keep-th after the newest, in the order the routes read them
    edge = s.execute(select(SandboxLog.ts, SandboxLog.id).where(SandboxLog.sandbox_id == sandbox_id)
                     .order_by(SandboxLog.ts.desc(), SandboxLog.id.desc()).limit(1).offset(keep)).first()
    if edge is None:
        return 0
    ts, row_id = edge
    result = s.execute(delete(SandboxLog).where(
        SandboxLog.sandbox_id == sandbox_id,
        or_(SandboxLog.ts < ts, and_(SandboxLog.ts == ts, SandboxLog.id <= row_id))))
    return int(getattr(result, "rowcount", 0) or 0)


def store_console(s: Session, sandbox_id: str, lines: Sequence[LogLine], *, keep: int, run: str,
                  bytes_read: int) -> int:
    """Store a round of a run's console: its ``lines`` (:func:`append_lines`) and the byte offset they end at
    (``bytes_read``), in the caller's one transaction; returns how many old lines were dropped."""
    dropped = append_lines(s, sandbox_id, lines, keep=keep)
    s.merge(ConsoleOffset(sandbox_id=sandbox_id, run=run, bytes_read=bytes_read))
    return dropped


def console_offset(s: Session, sandbox_id: str, run: str) -> int:
    """Where a reader of ``run``'s console goes on: the stored offset if it is this run's, else its start."""
    row = s.get(ConsoleOffset, sandbox_id)
    return row.bytes_read if row is not None and row.run == run else 0


def read_lines(s: Session, sandbox_id: str, *, cursor: Optional[dt.datetime], forward: bool, limit: int,
               min_level: Optional[str] = None, search: Optional[str] = None) -> list[SandboxLog]:
    """Up to ``limit`` lines from ``cursor`` on (forward: at or after it, oldest first; backward: at or before
    it, newest first), of ``min_level`` or worse, whose message contains ``search`` (any case)."""
    q = select(SandboxLog).where(SandboxLog.sandbox_id == sandbox_id)
    if cursor is not None:
        q = q.where(SandboxLog.ts >= cursor if forward else SandboxLog.ts <= cursor)
    if min_level is not None:
        q = q.where(SandboxLog.level.in_(LEVELS[LEVELS.index(min_level):]))
    if search:
        pattern = search.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
        q = q.where(func.lower(SandboxLog.message).like(f"%{pattern.lower()}%", escape="\\"))
    if forward:
        q = q.order_by(SandboxLog.ts.asc(), SandboxLog.id.asc())
    else:
        q = q.order_by(SandboxLog.ts.desc(), SandboxLog.id.desc())
    return list(s.scalars(q.limit(limit)))


def expire_ended(s: Session, ended_before: dt.datetime) -> int:
    """Delete the logs of the sandboxes that ended (killed or failed) before ``ended_before``; how many lines."""
    ended = (select(Sandbox.id)
             .where(Sandbox.state.in_((SandboxState.KILLED, SandboxState.ERROR)),
                    func.coalesce(Sandbox.killed_at, Sandbox.updated_at) < ended_before))
    result = s.execute(delete(SandboxLog).where(SandboxLog.sandbox_id.in_(ended)))
    s.execute(delete(ConsoleOffset).where(ConsoleOffset.sandbox_id.in_(ended)))
    return int(getattr(result, "rowcount", 0) or 0)
