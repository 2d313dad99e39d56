"""E2B sandbox routes that read state: list (v1, v2) and get; and set_timeout.

They need no sandbox service: a node serving only its database (tests, an
inspection node) answers them too. The routes that create, kill, pause,
resume or fork sandboxes are in ``lifecycle.py``.
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import json
from urllib.parse import parse_qsl, unquote

from quart import request
from sqlalchemy import and_, or_, select
from sqlalchemy.orm import Session

from ...config import Config
from ...state import Sandbox as SandboxRow
from ...state.repository import get_sandbox as _get_row
from ...state.repository import set_end
from ..context import ApiContext, Handler, Reply
from ..errors import ApiError
from ..models import E2BState, ListedSandbox, SandboxDetail, Timeout, e2b_state
from .node import query_int

_E2B_STATES: tuple[E2BState, ...] = ("running", "paused")


def parse_metadata_filter(raw: str | None) -> dict[str, str]:
    """Decode the SDK's double-encoded ``metadata`` query (parse_qsl, then unquote)."""
    if not raw:
        return {}
    try:
        pairs = parse_qsl(raw, keep_blank_values=True, strict_parsing=True)
    except ValueError:
        raise ApiError(400, f"metadata filter {raw!r} is not key=value pairs") from None
    return {unquote(k): unquote(v) for k, v in pairs}


def _encode_token(started_at: str, sandbox_id: str) -> str:
    raw = json.dumps([started_at, sandbox_id]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _decode_token(token: str) -> tuple[dt.datetime, str]:
    try:
        padded = token + "=" * (-len(token) % 4)
        started_at, sandbox_id = json.loads(base64.urlsafe_b64decode(padded))
        when = dt.datetime.fromisoformat(started_at)
        if when.tzinfo is None:
            raise ValueError("naive timestamp")
        return when, str(sandbox_id)
    except (ValueError, binascii.Error, TypeError):
        raise ApiError(400, "nextToken is not a token this node issued") from None


async def _list(api: ApiContext, *, states: tuple[str, ...], paginate: bool) -> Reply:
    metadata = parse_metadata_filter(request.args.get("metadata"))
    raw_state = request.args.get("state")
    if raw_state:
        wanted = tuple(s.strip() for s in raw_state.split(",") if s.strip())
        bad = [s for s in wanted if s not in _E2B_STATES]
        if bad:
            raise ApiError(400, f"state filter {','.join(bad)!r}: use running and/or paused")
        states = wanted
    order = request.args.get("order", "asc")
    if order not in ("asc", "desc"):
        raise ApiError(400, "order must be asc or desc")
    template = request.args.get("template")
    started_after = None
    if request.args.get("startedAfter"):
        try:
            started_after = dt.datetime.fromisoformat(request.args["startedAfter"].replace("Z", "+00:00"))
        except ValueError:
            raise ApiError(400, "startedAfter must be an ISO-8601 timestamp") from None
        if started_after.tzinfo is None:
            started_after = started_after.replace(tzinfo=dt.timezone.utc)
    limit = query_int("limit", 100) if paginate else 10_000
    token = request.args.get("nextToken") if paginate else None
    after = _decode_token(token) if token else None

    def work(s: Session) -> list[SandboxRow]:
        q = select(SandboxRow)
        if template:
            q = q.where(or_(SandboxRow.template_id == template, SandboxRow.alias == template))
        if started_after is not None:
            q = q.where(SandboxRow.started_at >= started_after)
        if order == "asc":
            q = q.order_by(SandboxRow.started_at.asc(), SandboxRow.id.asc())
        else:
            q = q.order_by(SandboxRow.started_at.desc(), SandboxRow.id.desc())
        if after is not None:
            ts, sid = after
            col = SandboxRow.started_at
            if order == "asc":
                q = q.where(or_(col > ts, and_(col == ts, SandboxRow.id > sid)))
            else:
                q = q.where(or_(col < ts, and_(col == ts, SandboxRow.id < sid)))
        out: list[SandboxRow] = []
        for sb in s.scalars(q):
            if e2b_state(sb.state) not in states:
                continue
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
        headers["x-next-token"] = _encode_token(last.started_at.isoformat(), last.id)
    return Reply([ListedSandbox.from_row(sb) for sb in rows], headers=headers)


async def list_sandboxes_v2(api: ApiContext) -> Reply:
    return await _list(api, states=_E2B_STATES, paginate=True)


async def list_sandboxes(api: ApiContext) -> Reply:
    return await _list(api, states=("running",), paginate=False)


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
