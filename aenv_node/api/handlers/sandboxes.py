"""E2B sandbox routes that read state: list (v1, v2) and get; and set_timeout.

They need no sandbox service: a node serving only its database (tests, an
inspection node) answers them too. The routes that create, kill, pause,
resume or fork sandboxes are in ``lifecycle.py``.
"""

from __future__ import annotations

import datetime as dt
from typing import Optional
from urllib.parse import parse_qsl, unquote

from sqlalchemy import Select, or_, select, tuple_
from sqlalchemy.orm import Session, load_only

from ...config import Config
from ...state import Sandbox as SandboxRow
from ...state import SandboxState
from ...state.repository import get_sandbox as _get_row
from ...state.repository import set_end
from ..context import ApiContext, Handler, Reply
from ..errors import ApiError
from ..models import E2BState, ListedSandbox, SandboxDetail, Timeout, e2b_state
from ..query import SandboxListQuery, SandboxListV1Query

_E2B_STATES: tuple[E2BState, ...] = ("running", "paused")
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)


def parse_metadata_filter(raw: str | None) -> dict[str, str]:
    """Decode the SDK's double-encoded ``metadata`` query (parse_qsl, then unquote), leniently as E2B's server
    does (Go's ``url.ParseQuery``): ``k`` alone is ``k=`` and an empty pair is nothing."""
    if not raw:
        return {}
    pairs = parse_qsl(raw, keep_blank_values=True)
    return {unquote(k): unquote(v) for k, v in pairs}


def encode_token(started_at: dt.datetime, sandbox_id: str) -> str:
    """``x-next-token``: where a page ended, ``<startedAt in unix microseconds>.<sandbox id>``
    (``query.NEXT_TOKEN_PATTERN``): exactly the stored start, so no sandbox started in the same millisecond is
    skipped or listed twice; any token of that form is a place in the order, so a client may also make one."""
    return f"{(started_at - _EPOCH) // dt.timedelta(microseconds=1)}.{sandbox_id}"


def decode_token(token: str) -> tuple[dt.datetime, str]:
    us, _, sandbox_id = token.partition(".")
    return _EPOCH + dt.timedelta(microseconds=int(us)), sandbox_id


#: what a listing entry shows (``ListedSandbox.from_row``): a page loads only these, not the env vars, network
#: policy and tokens of its hundred rows (two JSON documents fewer to decode per row)
_LISTED_COLUMNS = (SandboxRow.id, SandboxRow.template_id, SandboxRow.alias, SandboxRow.client_id, SandboxRow.node_id,
                   SandboxRow.started_at, SandboxRow.end_at, SandboxRow.cpu_count, SandboxRow.memory_mb,
                   SandboxRow.disk_size_mb, SandboxRow.metadata_, SandboxRow.state, SandboxRow.envd_version)


def page_query(states: tuple[str, ...], *, order: str = "asc", template: Optional[str] = None,
               started_after: Optional[dt.datetime] = None, after: Optional[tuple[dt.datetime, str]] = None,
               limit: Optional[int] = None) -> Select[SandboxRow]:
    """The sandboxes a listing page reads, in its order, from the token ``after`` on; ``limit``: at most that
    many rows (None: a metadata filter follows, in Python, so the rows are read until the page is full).

    Written so that SQLite reads the page from ``ix_sandboxes_started_at_id`` and stops at its end, whatever
    the number of sandboxes (``bench/fleet_state.py``): the states not listed are excluded with a NOT IN,
    which uses no index (an IN on the indexed ``state`` would make SQLite read every listed sandbox and sort
    them, for every page), and the token is a row value, which seeks the index (an OR of the two columns
    scans it from the start)."""
    hidden = [st for st in SandboxState if e2b_state(st) not in states]
    q = select(SandboxRow).where(SandboxRow.state.not_in(hidden))
    if template:
        q = q.where(or_(SandboxRow.template_id == template, SandboxRow.alias == template))
    if started_after is not None:
        q = q.where(SandboxRow.started_at >= started_after)
    if order == "asc":
        q = q.order_by(SandboxRow.started_at.asc(), SandboxRow.id.asc())
    else:
        q = q.order_by(SandboxRow.started_at.desc(), SandboxRow.id.desc())
    if after is not None:
        key = tuple_(SandboxRow.started_at, SandboxRow.id)
        q = q.where(key > after if order == "asc" else key < after)
    return q if limit is None else q.limit(limit)


async def _list(api: ApiContext, query: SandboxListV1Query, *, states: tuple[str, ...],
                paginate: bool) -> Reply:
    metadata = parse_metadata_filter(query.metadata)
    order, template, started_after, limit, after = "asc", None, None, 10_000, None
    if isinstance(query, SandboxListQuery):
        if query.state:
            states = tuple(query.state)
        order, template, started_after = query.order, query.template, query.started_after
        if paginate:
            limit = query.limit
            after = decode_token(query.next_token) if query.next_token else None
    q = page_query(states, order=order, template=template, started_after=started_after, after=after,
                   limit=None if metadata else limit + 1).options(load_only(*_LISTED_COLUMNS))

    def work(s: Session) -> list[SandboxRow]:
        out: list[SandboxRow] = []
        # metadata is free-form JSON, filtered here: rows are read in batches until the page is full
        for sb in s.scalars(q.execution_options(yield_per=limit + 1)):
            md = sb.metadata_ or {}
            if any(md.get(k) != v for k, v in metadata.items()):
                continue
            out.append(sb)
            if len(out) > limit:
                break
        return out

    rows = await api.node.db.run(work)
    has_more = len(rows) > limit
    rows = rows[:limit]
    headers: dict[str, str] = {}
    if paginate and has_more and rows:
        last = rows[-1]
        headers["x-next-token"] = encode_token(last.started_at, last.id)
    return Reply([ListedSandbox.from_row(sb) for sb in rows], headers=headers)


async def list_sandboxes_v2(api: ApiContext, query: SandboxListQuery) -> Reply:
    return await _list(api, query, states=_E2B_STATES, paginate=True)


async def list_sandboxes(api: ApiContext, query: SandboxListV1Query) -> Reply:
    return await _list(api, query, states=("running",), paginate=False)


async def get_sandbox(api: ApiContext, sandboxID: str) -> SandboxDetail:
    sb = await api.node.db.run(lambda s: _get_row(s, sandboxID))
    if e2b_state(sb.state) is None:
        raise ApiError(404, f"sandbox {sandboxID} not found")
    return SandboxDetail.from_row(sb, domain=api.cfg.api.domain)


def check_timeout(cfg: Config, timeout: int | None) -> None:
    """A timeout beyond the node's maximum is the client's error (400), whatever the route."""
    if timeout is not None and timeout > cfg.sandbox.max_timeout_s:
        raise ApiError(400, f"timeout {timeout}s exceeds this node's maximum of "
                            f"{cfg.sandbox.max_timeout_s}s")


async def set_sandbox_timeout(api: ApiContext, sandboxID: str, body: Timeout) -> None:
    """The sandbox now ends ``timeout`` seconds from now (E2B set_timeout semantics). A node that serves only
    its database (no sandbox service: no timer runs) still records it, through the same state change."""
    check_timeout(api.cfg, body.timeout)
    if api.service is not None:
        await api.service.set_timeout(sandboxID, body.timeout)
    else:
        await api.node.db.run(set_end, sandboxID, body.timeout)


HANDLERS: dict[str, Handler] = {
    "set_sandbox_timeout": set_sandbox_timeout,
    "list_sandboxes_v2": list_sandboxes_v2,
    "list_sandboxes": list_sandboxes,
    "get_sandbox": get_sandbox,
}
