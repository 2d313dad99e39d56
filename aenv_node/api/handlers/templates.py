"""Template and snapshot routes: listings read state directly; tags go through the template service (a tag that
moves or goes may free a snapshot: the collector is asked)."""

from __future__ import annotations

from typing import Optional

from quart import request
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from ...state import Sandbox as SandboxRow
from ...state import Snapshot as SnapshotRow
from ...state import SnapshotKind, SnapshotStatus, TemplateKind
from ...state import Template as TemplateRow
from ...state import TemplateBuild as TemplateBuildRow
from ...templates import find_template, split_name
from ..context import ApiContext, Handler
from ..errors import ApiError
from ..models import SnapshotDetail
from ..template_models import (
    ImportedVm,
    AssignedTags,
    AssignTags,
    DeleteTags,
    Template,
    TemplateAlias,
    TemplateBuildSummary,
    TemplateTag,
    TemplateUsage,
    TemplateWithBuilds,
)
from ..query import ImportVmQuery, SnapshotsQuery, TemplatesPageQuery


def _usage(s: Session, template_ids: list[str]) -> dict[str, TemplateUsage]:
    """Each template's latest ready build, build count and sandboxes started from it (three grouped queries)."""
    if not template_ids:
        return {}
    builds = dict(s.execute(select(TemplateBuildRow.template_id, func.count()).where(
        TemplateBuildRow.template_id.in_(template_ids)).group_by(TemplateBuildRow.template_id)).all())
    spawns = {tid: (n, last) for tid, n, last in s.execute(
        select(SandboxRow.template_id, func.count(), func.max(SandboxRow.started_at))
        .where(SandboxRow.template_id.in_(template_ids)).group_by(SandboxRow.template_id))}
    latest = dict(s.execute(select(TemplateRow.id, TemplateBuildRow.id).join(
        TemplateBuildRow, TemplateBuildRow.snapshot_id == TemplateRow.boot_snapshot_id).where(
        TemplateRow.id.in_(template_ids))).all())
    return {tid: TemplateUsage(build_id=latest.get(tid, ""), build_count=builds.get(tid, 0),
                               spawn_count=spawns.get(tid, (0, None))[0], last_spawned_at=spawns.get(tid, (0, None))[1])
            for tid in template_ids}


def _listed(s: Session, limit: int | None = None, after: str | None = None) -> list[Template]:
    q = select(TemplateRow).where(TemplateRow.kind == TemplateKind.TEMPLATE).order_by(TemplateRow.created_at,
                                                                                       TemplateRow.id)
    rows = list(s.scalars(q))
    if after is not None:
        rows = rows[next((i + 1 for i, t in enumerate(rows) if t.id == after), len(rows)):]
    if limit is not None:
        rows = rows[:limit]
    usage = _usage(s, [t.id for t in rows])
    return [Template.from_row(t, usage[t.id]) for t in rows]


async def list_templates(api: ApiContext) -> list[Template]:
    return await api.node.db.run(_listed)


async def list_templates_v2(api: ApiContext, query: TemplatesPageQuery) -> list[Template]:
    """``GET /v2/templates``: the same list, paged (``limit``, and ``nextToken``: the last template id seen)."""
    return await api.node.db.run(_listed, query.limit, query.next_token or None)


async def get_template(api: ApiContext, templateID: str) -> TemplateWithBuilds:
    def work(s: Session) -> Optional[TemplateWithBuilds]:
        t = find_template(s, split_name(templateID)[0])
        if t is None:
            return None
        builds = s.scalars(select(TemplateBuildRow).where(TemplateBuildRow.template_id == t.id)
                           .order_by(TemplateBuildRow.started_at.desc())).all()
        return TemplateWithBuilds.model_validate({
            **Template.fields_of(t, _usage(s, [t.id])[t.id]),
            "builds": [TemplateBuildSummary.from_row(b, t) for b in builds]})

    out = await api.node.db.run(work)
    if out is None:
        raise ApiError(404, f"template {templateID} not found")
    return out


async def get_template_alias(api: ApiContext, alias: str) -> TemplateAlias:
    def work(s: Session) -> Optional[str]:
        t = s.scalars(select(TemplateRow).where(TemplateRow.alias == split_name(alias)[0])).first()
        return t.id if t is not None else None

    tid = await api.node.db.run(work)
    if tid is None:
        raise ApiError(404, f"template alias {alias} not found")
    return TemplateAlias(template_id=tid, public=False)


async def get_template_tags(api: ApiContext, templateID: str) -> list[TemplateTag]:
    tags = await api.sandboxes.templates.tags(templateID)
    return [TemplateTag(tag=t.tag, build_id=t.build_id, created_at=t.created_at) for t in tags]


async def assign_template_tags(api: ApiContext, body: AssignTags) -> AssignedTags:
    build_id, tags = await api.sandboxes.templates.assign_tags(body.target, body.tags)
    return AssignedTags(tags=tags, build_id=build_id)


async def delete_template_tags(api: ApiContext, body: DeleteTags) -> None:
    await api.sandboxes.templates.remove_tags(body.name, body.tags)


_LISTED_KINDS = (SnapshotKind.USER, SnapshotKind.PAUSE, SnapshotKind.PERIODIC)


async def list_snapshots(api: ApiContext, query: SnapshotsQuery) -> list[SnapshotDetail]:
    limit, sandbox_id, name = query.limit, query.sandbox_id, query.name

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


async def import_vm_template(api: ApiContext, query: ImportVmQuery) -> ImportedVm:
    """The body is the kernel, read whole (the route's size limit bounds it; ``import_vm`` checks what it is)."""
    kernel = await request.get_data(cache=False)
    assert isinstance(kernel, bytes)
    result = await api.sandboxes.templates.import_vm(
        query.alias, kernel, vcpus=query.cpu_count, mem_mib=query.memory_mb, ready_console=query.ready_console,
        timeout_s=query.timeout_s)
    return ImportedVm(template_id=result.template_id, build_id=result.build_id, snapshot_id=result.snapshot_id,
                      boot_ms=round(result.boot_s * 1000, 1), capture_ms=round(result.capture_s * 1000, 1))


HANDLERS: dict[str, Handler] = {
    "import_vm_template": import_vm_template,
    "list_templates": list_templates,
    "list_templates_v2": list_templates_v2,
    "get_template_tags": get_template_tags,
    "assign_template_tags": assign_template_tags,
    "delete_template_tags": delete_template_tags,
    "get_template": get_template,
    "get_template_alias": get_template_alias,
    "list_snapshots": list_snapshots,
    "snapshot_lineage": snapshot_lineage,
}
