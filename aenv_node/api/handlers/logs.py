"""E2B's sandbox logs routes: ``GET /sandboxes/{id}/logs`` (v1) and ``GET /v2/sandboxes/{id}/logs``.

They read the ``sandbox_logs`` table (``state/sandbox_logs.py``), so they need no sandbox service and answer
for a running, paused or ended sandbox alike (until its logs expire). Cursors are unix milliseconds, as E2B's:
``start`` (v1) and ``cursor`` (v2) name the first millisecond wanted; v2 reads ``backward`` from it too, newest
first, and filters by minimum ``level`` and a case-insensitive ``search`` in the message.
"""

from __future__ import annotations

import datetime as dt
from typing import Optional

from quart import request
from sqlalchemy.orm import Session

from ...state import Sandbox as SandboxRow
from ...state import SandboxLog as SandboxLogRow
from ...state.sandbox_logs import LEVELS, read_lines
from ..context import ApiContext, Handler
from ..errors import ApiError
from ..models import SandboxLogEntry, SandboxLogLine, SandboxLogs, SandboxLogsV2
from .node import query_int

MAX_LIMIT = 1000
MAX_SEARCH = 256
_MAX_MS = 2**53  # a JavaScript-safe integer: far past any real timestamp


def _ms(name: str) -> Optional[dt.datetime]:
    value = query_int(name, -1, lo=0, hi=_MAX_MS)
    return None if value < 0 else dt.datetime.fromtimestamp(value / 1000, dt.timezone.utc)


async def _read(api: ApiContext, sandbox_id: str, *, cursor: Optional[dt.datetime], forward: bool, limit: int,
                level: Optional[str] = None, search: Optional[str] = None) -> list[SandboxLogRow]:
    def work(s: Session) -> list[SandboxLogRow]:
        if s.get(SandboxRow, sandbox_id) is None:
            raise ApiError(404, f"sandbox {sandbox_id} not found")
        return read_lines(s, sandbox_id, cursor=cursor, forward=forward, limit=limit, min_level=level,
                          search=search)

    return await api.node.db.run(work)


async def get_sandbox_logs(api: ApiContext, sandboxID: str) -> SandboxLogs:
    rows = await _read(api, sandboxID, cursor=_ms("start"), forward=True,
                       limit=query_int("limit", MAX_LIMIT, hi=MAX_LIMIT))
    entries = [SandboxLogEntry.from_row(r) for r in rows]
    return SandboxLogs(logs=[SandboxLogLine(timestamp=e.timestamp, line=e.message) for e in entries],
                       log_entries=entries)


async def get_sandbox_logs_v2(api: ApiContext, sandboxID: str) -> SandboxLogsV2:
    direction = request.args.get("direction") or "forward"
    if direction not in ("forward", "backward"):
        raise ApiError(400, f"direction must be forward or backward, got {direction!r}")
    level = request.args.get("level") or None
    if level is not None and level not in LEVELS:
        raise ApiError(400, f"level must be one of {', '.join(LEVELS)}, got {level!r}")
    search = request.args.get("search") or None
    if search is not None and len(search) > MAX_SEARCH:
        raise ApiError(400, f"search must be at most {MAX_SEARCH} characters")
    rows = await _read(api, sandboxID, cursor=_ms("cursor"), forward=direction == "forward",
                       limit=query_int("limit", MAX_LIMIT, hi=MAX_LIMIT), level=level, search=search)
    return SandboxLogsV2(logs=[SandboxLogEntry.from_row(r) for r in rows])


HANDLERS: dict[str, Handler] = {
    "get_sandbox_logs": get_sandbox_logs,
    "get_sandbox_logs_v2": get_sandbox_logs_v2,
}
