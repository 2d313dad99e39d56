"""Native node routes: health, metrics, OpenAPI, node info, events."""

from __future__ import annotations

import datetime as dt

import trio
from quart import Response, current_app, jsonify
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from ...state import Event as EventRow
from ...state import Sandbox as SandboxRow
from ..context import ApiContext, Handler
from ..metrics import CONTENT_TYPE
from ..models import Event, Health, NodeDrain, NodeInfo
from ..query import EventsQuery


async def health(api: ApiContext) -> Health:
    return Health(status="draining" if api.node.tracker.draining else "ok", version=api.node.version)


async def metrics(api: ApiContext) -> Response:
    body = await trio.to_thread.run_sync(current_app.extensions["aenv_metrics"].render)
    return Response(body, status=200, content_type=CONTENT_TYPE)


async def openapi(api: ApiContext) -> Response:
    return jsonify(current_app.extensions["aenv_openapi"])


async def node_info(api: ApiContext) -> NodeInfo:
    def work(s: Session) -> dict[str, int]:
        rows = s.execute(select(SandboxRow.state, func.count()).group_by(SandboxRow.state)).all()
        return {str(state): count for state, count in rows}

    node = api.node
    return NodeInfo(node_id=node.node_id, version=node.version, listen=node.cfg.api.listen,
                    state_dir=str(node.cfg.state_dir),
                    started_at=dt.datetime.fromtimestamp(node.started_at, dt.timezone.utc),
                    sandboxes=await node.db.run(work))


async def drain_node(api: ApiContext) -> NodeDrain:
    report = await api.sandboxes.drain()
    return NodeDrain(paused=report.paused, running=report.running, unpublished=report.unpublished)


async def list_events(api: ApiContext, query: EventsQuery) -> list[Event]:
    """The newest ``limit`` events, newest first; with ``after`` (an event id, the cursor of a follower), the
    ``limit`` events after it, oldest first, so that polling with the last id seen misses none."""
    limit, sandbox_id = query.limit, query.sandbox_id
    after = query.after if query.after is not None else -1

    def work(s: Session) -> list[Event]:
        if after >= 0:
            q = select(EventRow).where(EventRow.id > after).order_by(EventRow.id.asc()).limit(limit)
        else:
            q = select(EventRow).order_by(EventRow.id.desc()).limit(limit)
        if sandbox_id:
            q = q.where(EventRow.sandbox_id == sandbox_id)
        return [Event.from_row(e) for e in s.scalars(q)]

    return await api.node.db.run(work)


HANDLERS: dict[str, Handler] = {
    "health": health,
    "metrics": metrics,
    "openapi": openapi,
    "node_info": node_info,
    "drain_node": drain_node,
    "list_events": list_events,
}
