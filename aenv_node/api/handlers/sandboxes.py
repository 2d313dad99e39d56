"""E2B sandbox routes that read state: list (v1, v2) and get.

The routes that create, kill, pause, resume or fork sandboxes are registered by
the sandbox manager (``runtime``) when it is present; until then they answer 501.
"""

from __future__ import annotations

import base64
import datetime as dt
import binascii
import json
from typing import Any
from urllib.parse import parse_qsl, unquote

from quart import jsonify, request
from sqlalchemy import and_, or_, select

from ...runtime import Node
from ...state import Sandbox
from ...state import utcnow
from ...state.repository import get_sandbox as _get_row
from ...state.repository import update_sandbox
from ..body import field, json_body
from ..errors import ApiError
from ..serialize import e2b_state, listed_sandbox, sandbox_detail
from .node import query_int

_E2B_STATES = ("running", "paused")


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


async def _list(node: Node, *, states: tuple[str, ...], paginate: bool) -> Any:
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

    def work(s):  # type: ignore[no-untyped-def]
        q = select(Sandbox)
        if template:
            q = q.where(or_(Sandbox.template_id == template, Sandbox.alias == template))
        if started_after is not None:
            q = q.where(Sandbox.started_at >= started_after)
        if order == "asc":
            q = q.order_by(Sandbox.started_at.asc(), Sandbox.id.asc())
        else:
            q = q.order_by(Sandbox.started_at.desc(), Sandbox.id.desc())
        if after is not None:
            ts, sid = after
            col = Sandbox.started_at
            if order == "asc":
                q = q.where(or_(col > ts, and_(col == ts, Sandbox.id > sid)))
            else:
                q = q.where(or_(col < ts, and_(col == ts, Sandbox.id < sid)))
        out: list[Sandbox] = []
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

    rows = await node.db.run(work)
    has_more = len(rows) > limit
    rows = rows[:limit]
    resp = jsonify([listed_sandbox(sb) for sb in rows])
    if paginate and has_more and rows:
        last = rows[-1]
        resp.headers["x-next-token"] = _encode_token(last.started_at.isoformat(), last.id)
    return resp


async def list_sandboxes_v2(node: Node) -> Any:
    return await _list(node, states=_E2B_STATES, paginate=True)


async def list_sandboxes(node: Node) -> Any:
    return await _list(node, states=("running",), paginate=False)


async def get_sandbox(node: Node, sandboxID: str) -> Any:
    sb = await node.db.run(lambda s: _get_row(s, sandboxID))
    if e2b_state(sb.state) is None:
        raise ApiError(404, f"sandbox {sandboxID} not found")
    return jsonify(sandbox_detail(sb, domain=node.cfg.api.domain))


async def set_sandbox_timeout(node: Node, sandboxID: str) -> Any:
    body = await json_body({"timeout": field(int, required=True, minimum=0)})
    await extend_timeout(node, sandboxID, body["timeout"])
    return "", 204


async def extend_timeout(node: Node, sandboxID: str, timeout: int) -> None:
    """The sandbox now ends ``timeout`` seconds from now (E2B set_timeout semantics)."""
    if timeout > node.cfg.sandbox.max_timeout_s:
        raise ApiError(400, f"timeout {timeout}s exceeds this node's maximum of "
                            f"{node.cfg.sandbox.max_timeout_s}s")
    end_at = utcnow() + dt.timedelta(seconds=timeout)
    await node.db.run(lambda s: update_sandbox(s, sandboxID, operation="set_timeout",
                                               detail={"timeout_s": timeout}, end_at=end_at))


HANDLERS = {
    "set_sandbox_timeout": set_sandbox_timeout,
    "list_sandboxes_v2": list_sandboxes_v2,
    "list_sandboxes": list_sandboxes,
    "get_sandbox": get_sandbox,
}
