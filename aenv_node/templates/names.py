"""Template names and tags: what ``name`` and ``name:tag`` mean, in one place for every reader.

A template has an id (``tpl_...``, or the node's own ``base``) and an alias; each ready build may carry tags.
``name:tag`` means the build tagged ``tag``; a bare name means the build tagged ``default`` when there is one,
else the template's latest ready build (so ``app`` works after building only ``app:v1``, as a user expects).
A build takes its tags when it succeeds (``default`` when it was asked for none); a tag moves to the newest
build that takes it. The snapshot of every tagged build stays (the garbage collector keeps it) until its tag
is removed or moves on.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from sqlalchemy import bindparam, or_, select
from sqlalchemy.orm import Session

from ..state import EventSubject, Snapshot, SnapshotStatus, Template, TemplateBuild, TemplateTag, utcnow
from ..state.repository import record_event

__all__ = ["DEFAULT_TAG", "NAME_PART", "RESERVED_NAMES", "NamedBuild", "assign_tags", "find_template", "lookup",
           "remove_tags", "split_name", "tags_of"]

#: what a bare template name means
DEFAULT_TAG = "default"

#: an alias or a tag: lowercase letters, digits, '-', '_' and '.'
NAME_PART = re.compile(r"[a-z0-9][a-z0-9._-]{0,127}")

#: names no template may take: ``/templates/tags`` is the API's tags route, not the template ``tags``
RESERVED_NAMES = ("tags",)


def split_name(name: str) -> tuple[str, str | None]:
    """``name:tag`` into its template (an id or an alias) and its tag (None when it names none)."""
    base, sep, tag = name.partition(":")
    return base, (tag if sep and tag else None)


# Built once, with bound parameters: every create resolves its template's name, and building these statements
# anew cost more CPU than running them (a lookup is on the path whose rate the node is judged by).
_BY_ID_OR_ALIAS = (select(Template).where(or_(Template.id == bindparam("name"), Template.alias == bindparam("name")))
                   .order_by((Template.id == bindparam("name")).desc()).limit(1))
_TAG = select(TemplateTag).where(TemplateTag.template_id == bindparam("template_id"), TemplateTag.tag == bindparam("tag"))
_BUILD = select(TemplateBuild).where(TemplateBuild.id == bindparam("build_id"))
_BUILD_OF_SNAPSHOT = select(TemplateBuild.id).where(TemplateBuild.snapshot_id == bindparam("snapshot_id")).limit(1)
_SNAPSHOT = select(Snapshot).where(Snapshot.id == bindparam("snapshot_id"))


def find_template(s: Session, name: str) -> Template | None:
    """The template with id or alias ``name`` (no tag); an id before an alias."""
    return s.scalars(_BY_ID_OR_ALIAS, {"name": name}).first()


@dataclass(frozen=True)
class NamedBuild:
    """What a name means: its template, the build and the committed snapshot it names (None when the name's
    tag names nothing, or the template has no ready build yet)."""

    template: Template
    tag: str | None
    build_id: str | None
    snapshot: Snapshot | None

    @property
    def missing_tag(self) -> bool:
        """The name asks for a tag the template does not have."""
        return self.tag is not None and self.build_id is None


def lookup(s: Session, name: str) -> NamedBuild | None:
    """What ``name`` (``id``, ``alias``, ``alias:tag``) means; None when there is no such template."""
    base, tag = split_name(name)
    t = find_template(s, base)
    if t is None:
        return None
    row = s.scalars(_TAG, {"template_id": t.id, "tag": tag or DEFAULT_TAG}).first()
    if row is None and tag is not None:
        return NamedBuild(t, tag, None, None)
    if row is not None:
        b = s.scalars(_BUILD, {"build_id": row.build_id}).first()
        snapshot_id = b.snapshot_id if b is not None else None
        build_id: str | None = row.build_id
    else:  # a bare name and no `default` tag: the latest ready build
        snapshot_id = t.boot_snapshot_id
        build_id = s.scalars(_BUILD_OF_SNAPSHOT, {"snapshot_id": snapshot_id}).first() if snapshot_id else None
    sn = s.scalars(_SNAPSHOT, {"snapshot_id": snapshot_id}).first() if snapshot_id else None
    if sn is not None and sn.status != SnapshotStatus.COMMITTED:
        sn = None
    return NamedBuild(t, tag, build_id, sn)


def assign_tags(s: Session, template_id: str, build_id: str, tags: list[str]) -> dict[str, str | None]:
    """Point ``tags`` of ``template_id`` at ``build_id`` (each moves from where it was), with one event.
    Returns each tag's previous build."""
    moved: dict[str, str | None] = {}
    for tag in dict.fromkeys(tags):
        row = s.get(TemplateTag, (template_id, tag))
        if row is None:
            s.add(TemplateTag(template_id=template_id, tag=tag, build_id=build_id, created_at=utcnow()))
            moved[tag] = None
        elif row.build_id != build_id:
            moved[tag] = row.build_id
            row.build_id, row.created_at = build_id, utcnow()
    if moved:
        record_event(s, "template_tag", subject=EventSubject.TEMPLATE, subject_id=template_id,
                     detail={"build_id": build_id, "tags": moved})
    return moved


def remove_tags(s: Session, template_id: str, tags: list[str]) -> list[str]:
    """Remove ``tags`` from ``template_id``, with one event. Returns the tags it does not have; then nothing
    is removed."""
    wanted = list(dict.fromkeys(tags))
    rows = [s.get(TemplateTag, (template_id, tag)) for tag in wanted]
    missing = [tag for tag, row in zip(wanted, rows) if row is None]
    if missing:
        return missing
    for row in rows:
        s.delete(row)
    record_event(s, "template_untag", subject=EventSubject.TEMPLATE, subject_id=template_id,
                 detail={"tags": {r.tag: r.build_id for r in rows if r is not None}})
    return []


def tags_of(s: Session, template_id: str) -> list[TemplateTag]:
    """The tags of ``template_id``, oldest first."""
    return list(s.scalars(select(TemplateTag).where(TemplateTag.template_id == template_id)
                          .order_by(TemplateTag.created_at)))
