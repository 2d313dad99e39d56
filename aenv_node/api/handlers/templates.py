"""Template and snapshot routes that read state."""

from __future__ import annotations

from typing import Any

from quart import jsonify, request
from sqlalchemy import select

from ...runtime import Node
from ...state import Snapshot, Template
from ..errors import ApiError
from ..serialize import snapshot_json, template_json
from .node import query_int


async def list_templates(node: Node) -> Any:
    def work(s):  # type: ignore[no-untyped-def]
        q = select(Template).where(Template.kind == "template").order_by(Template.created_at)
        return [template_json(t) for t in s.scalars(q)]

    return jsonify(await node.db.run(work))


async def get_template(node: Node, templateID: str) -> Any:
    def work(s):  # type: ignore[no-untyped-def]
        t = s.get(Template, templateID)
        if t is None:
            t = s.scalars(select(Template).where(Template.alias == templateID)).first()
        return template_json(t) if t is not None else None

    out = await node.db.run(work)
    if out is None:
        raise ApiError(404, f"template {templateID} not found")
    return jsonify(out)


async def get_template_alias(node: Node, alias: str) -> Any:
    def work(s):  # type: ignore[no-untyped-def]
        t = s.scalars(select(Template).where(Template.alias == alias)).first()
        return t.id if t is not None else None

    tid = await node.db.run(work)
    if tid is None:
        raise ApiError(404, f"template alias {alias} not found")
    return jsonify({"templateID": tid, "public": False})


async def list_snapshots(node: Node) -> Any:
    limit = query_int("limit", 100)
    sandbox_id = request.args.get("sandboxID")
    name = request.args.get("name")

    def work(s):  # type: ignore[no-untyped-def]
        q = (select(Snapshot).where(Snapshot.status == "committed")
             .where(Snapshot.kind.in_(("user", "pause", "periodic")))
             .order_by(Snapshot.created_at.desc()).limit(limit))
        if sandbox_id:
            q = q.where(Snapshot.source_sandbox_id == sandbox_id)
        if name:
            q = q.where(Snapshot.name == name)
        return [snapshot_json(sn) for sn in s.scalars(q)]

    return jsonify(await node.db.run(work))


async def snapshot_lineage(node: Node, snapshotID: str) -> Any:
    def work(s):  # type: ignore[no-untyped-def]
        chain = []
        seen: set[str] = set()
        sn = s.get(Snapshot, snapshotID)
        if sn is None:
            return None
        while sn is not None and sn.id not in seen:
            seen.add(sn.id)
            chain.append(snapshot_json(sn))
            sn = s.get(Snapshot, sn.parent_id) if sn.parent_id else None
        return chain

    out = await node.db.run(work)
    if out is None:
        raise ApiError(404, f"snapshot {snapshotID} not found")
    return jsonify(out)


HANDLERS = {
    "list_templates": list_templates,
    "get_template": get_template,
    "get_template_alias": get_template_alias,
    "list_snapshots": list_snapshots,
    "snapshot_lineage": snapshot_lineage,
}
