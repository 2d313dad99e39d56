"""E2B's sandbox logs routes: ``GET /sandboxes/{id}/logs`` (v1) and ``GET /v2/sandboxes/{id}/logs``.

They read the ``sandbox_logs`` table (``state/sandbox_logs.py``), so they need no sandbox service and answer
for a running, paused or ended sandbox alike (until its logs expire). Cursors are unix milliseconds, as E2B's:
``start`` (v1) and ``cursor`` (v2) name the first millisecond wanted; v2 reads ``backward`` from it too, newest
first, and filters by minimum ``level`` and a case-insensitive ``search`` in the message.
"""

from __future__ import annotations

import datetime as dt
from typing import Optional

from sqlalchemy.orm import Session

from ...state import Sandbox as SandboxRow
from ...state import SandboxLog as SandboxLogRow
from ...state.sandbox_logs import read_lines
from ..context import ApiContext, Handler
from ..errors import ApiError
from ..models import SandboxLogEntry, SandboxLogLine, SandboxLogs, SandboxLogsV2
from ..query import LogsQuery, LogsV2Query


def _ms(value: Optional[int]) -> Optional[dt.datetime]:
    return None if value is None else _EPOCH + dt.timedelta(milliseconds=value)


_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)


async def _read(api: ApiContext, sandbox_id: str, *, cursor: Optional[dt.datetime], forward: bool, limit: int,
                level: Optional[str] = None, search: Optional[str] = None) -> list[SandboxLogRow]:
    def work(s: Session) -> list[SandboxLogRow]:
        if s.get(SandboxRow, sandbox_id) is None:
            raise ApiError(404, f"sandbox {sandbox_id} not found")
        return read_lines(s, sandbox_id, cursor=cursor, forward=forward, limit=limit, min_level=level,
                          search=search)

    return await api.node.db.run(work)


async def get_sandbox_logs(api: ApiContext, sandboxID: str, query: LogsQuery) -> SandboxLogs:
    rows = await _read(api, sandboxID, cursor=_ms(query.start), forward=True, limit=query.limit)
    entries = [SandboxLogEntry.from_row(r) for r in rows]
    return SandboxLogs(logs=[SandboxLogLine(timestamp=e.timestamp, line=e.message) for e in entries],
                       log_entries=entries)


async def get_sandbox_logs_v2(api: ApiContext, sandboxID: str, query: LogsV2Query) -> SandboxLogsV2:
    rows = await _read(api, sandboxID, cursor=_ms(query.cursor), forward=query.direction == "forward",
                       limit=query.limit, level=query.level, search=query.search or None)
    return SandboxLogsV2(logs=[SandboxLogEntry.from_row(r) for r in rows])


HANDLERS: dict[str, Handler] = {
    "get_sandbox_logs": get_sandbox_logs,
    "get_sandbox_logs_v2": get_sandbox_logs_v2,
}
