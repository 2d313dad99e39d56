"""The rows of template builds as they move: a build's turn comes (building), it fails (with the reason and the
stage it stopped at), builds a restart cut are failed at start, and the last failure of a template is read
back for a create that finds no ready build. One transaction each, with its event row (``Database.run``)."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from ..state import BuildStatus, EventSubject, Template, TemplateBuild, utcnow
from ..state.repository import record_event

__all__ = ["fail_build", "fail_interrupted_builds", "last_build_error", "mark_building"]


def fail_build(s: Session, build_id: str, message: str, step: str | None = None) -> None:
    """Mark a build failed (and its template, when it has no ready snapshot) with the reason and the stage it
    stopped at (``BuildLog.stage``)."""
    b = s.get(TemplateBuild, build_id)
    if b is None or b.status == BuildStatus.READY:
        return
    b.error_step = step or b.error_step
    if b.status == BuildStatus.ERROR:
        return  # build_template recorded it (its reason stands)
    b.status, b.error, b.finished_at = BuildStatus.ERROR, message, utcnow()
    t = s.get(Template, b.template_id)
    if t is not None and t.boot_snapshot_id is None:
        t.status = BuildStatus.ERROR
    record_event(s, "template_build", subject=EventSubject.TEMPLATE, subject_id=b.template_id,
                 to_state=BuildStatus.ERROR, error=message, detail={"build_id": build_id})


def mark_building(s: Session, build_id: str) -> None:
    """A build's turn came: it is building from here (its pull and conversion included)."""
    b = s.get(TemplateBuild, build_id)
    if b is not None and b.status == BuildStatus.WAITING:
        b.status, b.started_at = BuildStatus.BUILDING, utcnow()
        record_event(s, "template_build", subject=EventSubject.TEMPLATE, subject_id=b.template_id,
                     from_state=BuildStatus.WAITING, to_state=BuildStatus.BUILDING, detail={"build_id": build_id})


def last_build_error(s: Session, template_id: str) -> str:
    b = s.scalars(select(TemplateBuild).where(TemplateBuild.template_id == template_id)
                  .order_by(TemplateBuild.started_at.desc())).first()
    return (b.error or "no reason recorded") if b is not None else "no build recorded"


def fail_interrupted_builds(s: Session) -> list[str]:
    """At start: a build still waiting or building was cut by the node stopping; none runs twice. Returns
    their ids."""
    rows = s.scalars(select(TemplateBuild).where(
        TemplateBuild.status.in_((BuildStatus.WAITING, BuildStatus.BUILDING)))).all()
    for b in rows:
        fail_build(s, b.id, "interrupted by a restart of the node; start a new build")
    return [b.id for b in rows]
