"""Template and snapshot routes that read state (no sandbox service needed)."""

from __future__ import annotations

from typing import Optional

from quart import request
from sqlalchemy import select
from sqlalchemy.orm import Session

from ...state import Snapshot as SnapshotRow
from ...state import SnapshotKind, SnapshotStatus, TemplateKind
from ...state import Template as TemplateRow
from ..context import ApiContext, Handler
from ..errors import ApiError
from ..models import SnapshotDetail, Template, TemplateAlias
from .node import query_int


async def list_templates(api: ApiContext) -> list[Template]:
    def work(s: Session) -> list[Template]:
        q = select(TemplateRow).where(TemplateRow.kind == TemplateKind.TEMPLATE).order_by(TemplateRow.created_at)
        return [Template.from_row(t) for t in s.scalars(q)]

    return await api.node.db.run(work)


async def get_template(api: ApiContext, templateID: str) -> Template:
    def work(s: Session) -> Optional[Template]:
        t = s.get(TemplateRow, templateID)
        if t is None:
            t = s.scalars(select(TemplateRow).where(TemplateRow.alias == templateID)).first()
        return Template.from_row(t) if t is not None else None

    out = await api.node.db.run(work)
    if out is None:
        raise ApiError(404, f"template {templateID} not found")
    return out


async def get_template_alias(api: ApiContext, alias: str) -> TemplateAlias:
    def work(s: Session) -> Optional[str]:
        t = s.scalars(select(TemplateRow).where(TemplateRow.alias == alias)).first()
        return t.id if t is not None else None

    tid = await api.node.db.run(work)
    if tid is None:
        raise ApiError(404, f"template alias {alias} not found")
    return TemplateAlias(template_id=tid, public=False)


_LISTED_KINDS = (SnapshotKind.USER, SnapshotKind.PAUSE, SnapshotKind.PERIODIC)


async def list_snapshots(api: ApiContext) -> list[SnapshotDetail]:
    limit = query_int("limit", 100)
    sandbox_id = request.args.get("sandboxID")
    name = request.args.get("name")

    def work(s: Session) -> list[SnapshotDetail]:
        q = (select(SnapshotRow).where(SnapshotRow.status == SnapshotStatus.COMMITTED)
             .where(SnapshotRow.kind.in_(_LISTED_KINDS))
             .order_by(SnapshotRow.created_at.desc()).limit(limit))
        if sandbox_id:
            q = q.where(SnapshotRow.source_sandbox_id == sandbox_id)
        if name:
            q = q.where(SnapshotRow.name == name)
        return [SnapshotDetail.from_row(sn) for sn in s.scalars(q)]

    return await api.node.db.run(work)


async def snapshot_lineage(api: ApiContext, snapshotID: str) -> list[SnapshotDetail]:
    def work(s: Session) -> Optional[list[SnapshotDetail]]:
        chain: list[SnapshotDetail] = []
        seen: set[str] = set()
        sn = s.get(SnapshotRow, snapshotID)
        if sn is None:
            return None
        while sn is not None and sn.id not in seen:
            seen.add(sn.id)
            chain.append(SnapshotDetail.from_row(sn))
            sn = s.get(SnapshotRow, sn.parent_id) if sn.parent_id else None
        return chain

    out = await api.node.db.run(work)
    if out is None:
        raise ApiError(404, f"snapshot {snapshotID} not found")
    return out


HANDLERS: dict[str, Handler] = {
    "list_templates": list_templates,
    "get_template": get_template,
    "get_template_alias": get_template_alias,
    "list_snapshots": list_snapshots,
    "snapshot_lineage": snapshot_lineage,
}
