"""Native node routes: health, metrics, OpenAPI, node info, events."""

from __future__ import annotations

import datetime as dt
from typing import Any

import trio
from quart import Response, current_app, jsonify, request
from sqlalchemy import func, select

from ...runtime import Node
from ...state import Event, Sandbox
from ..errors import ApiError
from ..metrics import CONTENT_TYPE
from ..serialize import event_json, rfc3339


def query_int(name: str, default: int, *, lo: int = 1, hi: int = 1000) -> int:
    raw = request.args.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ApiError(400, f"query parameter {name} must be an integer, got {raw!r}") from None
    if not lo <= value <= hi:
        raise ApiError(400, f"query parameter {name} must be between {lo} and {hi}")
    return value


async def health(node: Node) -> Any:
    return jsonify({"status": "draining" if node.tracker.draining else "ok",
                    "version": node.version})


async def metrics(node: Node) -> Any:
    body = await trio.to_thread.run_sync(current_app.extensions["aenv_metrics"].render)
    return Response(body, status=200, content_type=CONTENT_TYPE)


async def openapi(node: Node) -> Any:
    return jsonify(current_app.extensions["aenv_openapi"])


async def node_info(node: Node) -> Any:
    def work(s):  # type: ignore[no-untyped-def]
        return dict(s.execute(select(Sandbox.state, func.count()).group_by(Sandbox.state)).all())

    counts = await node.db.run(work)
    return jsonify({
        "nodeID": node.node_id,
        "version": node.version,
        "listen": node.cfg.api.listen,
        "stateDir": str(node.cfg.state_dir),
        "startedAt": rfc3339(dt.datetime.fromtimestamp(node.started_at, dt.timezone.utc)),
        "sandboxes": counts,
    })


async def list_events(node: Node) -> Any:
    limit = query_int("limit", 100)
    sandbox_id = request.args.get("sandboxID")

    def work(s):  # type: ignore[no-untyped-def]
        q = select(Event).order_by(Event.id.desc()).limit(limit)
        if sandbox_id:
            q = q.where(Event.sandbox_id == sandbox_id)
        return [event_json(e) for e in s.scalars(q)]

    return jsonify(await node.db.run(work))


HANDLERS = {
    "health": health,
    "metrics": metrics,
    "openapi": openapi,
    "node_info": node_info,
    "list_events": list_events,
}
