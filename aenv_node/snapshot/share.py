"""Templates shared between the nodes of a cluster through the repository they share.

A template built on one node (or a user snapshot taken there, which the E2B API creates sandboxes from as from a
template) is **published**: its snapshot as every published snapshot (its disk layers; its memory as layers, the
RAM image of a boot snapshot at the bottom; the manifest written last: ``publish.upload_snapshot``), then the
template's record (``storage/repository/template_record.py``), so that a reader never finds a record whose
snapshot is incomplete. The node's template service queues the publish after each build and user snapshot, in
the background (a create_snapshot does not wait for the upload), and again at its start for any template left
unpublished (a stop, a repository that was down).

A node asked for a template it does not know (``TemplateService.resolve``) looks the name up in the repository
(an id, or an alias through its alias record) and **imports** it: the snapshot's rows with its layers as
repository-only references, read on demand through the node's cache like an imported paused sandbox's, and the
template, ready. Sandboxes are then created from it as from a template built there.

What is not shared: the builtin templates (each node builds its own ``base`` and ``code-interpreter-v1`` from its
own kit), tags (``name:tag`` resolves on the nodes that built that tag; the bare name resolves everywhere to
the newest build published), and what a deletion leaves on other nodes (a template deleted anywhere loses its
records, so no node imports it any more; nodes that imported it keep their copy until it is deleted there).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Optional

import trio
from sqlalchemy import select
from sqlalchemy.orm import Session

from ..state import (
    BuildStatus,
    Database,
    EventSubject,
    Sandbox,
    Snapshot,
    Template,
    TemplateKind,
)
from ..state.repository import record_event
from ..storage.repository.base import Repository
from ..storage.repository.template_record import TemplateRecord, drop_template, get_template, put_template
from .publish import fetch_snapshot, record_published_snapshot, upload_snapshot, write_vmstate

__all__ = ["publish_template", "import_template", "unshared_templates", "forget_template"]

log = logging.getLogger(__name__)


async def publish_template(db: Database, repo: Repository, layers_dir: Path, template_id: str, *,
                           publisher: str, exclude: Iterable[str] = ()) -> Optional[dict[str, Any]]:
    """Publish a ready template for the other nodes (its snapshot, then its record); None if it is not ready
    here (deleted, or rebuilt meanwhile: that build publishes) or ``exclude`` names it (id or alias)."""
    skip = set(exclude)
    t0 = time.monotonic()

    def read(s: Session) -> Optional[tuple[Template, Snapshot, Optional[str]]]:
        t = s.get(Template, template_id)
        if t is None or t.status != BuildStatus.READY or t.boot_snapshot_id is None or t.id in skip \
                or (t.alias is not None and t.alias in skip):
            return None
        sn = s.get(Snapshot, t.boot_snapshot_id)
        if sn is None:
            return None
        source = sn.source_sandbox_id if sn.source_sandbox_id and s.get(Sandbox, sn.source_sandbox_id) else None
        return t, sn, source

    found = await db.run(read)
    if found is None:
        return None
    t, sn, source = found
    summary = await upload_snapshot(db, repo, layers_dir, sn.id, source)
    rec = TemplateRecord(template_id=t.id, alias=t.alias, kind=t.kind.value, cpu_count=t.cpu_count,
                         memory_mb=t.memory_mb, disk_size_mb=t.disk_size_mb, envd_version=t.envd_version,
                         snapshot_id=sn.id, publisher=publisher, published_at=time.time())
    await trio.to_thread.run_sync(put_template, repo, rec)

    def mark(s: Session) -> None:
        row = s.get(Snapshot, sn.id)
        if row is not None:
            row.published = True

    await db.run(mark)
    summary.update(pointer="template", template_id=t.id, ms=round((time.monotonic() - t0) * 1000, 1))
    await db.run(lambda s: record_event(s, "template_publish", subject=EventSubject.TEMPLATE, subject_id=t.id,
                                        duration_ms=summary["ms"], detail={**summary, "snapshot_id": sn.id}))
    log.info("published template %s (snapshot %s) to the repository in %.0f ms", t.alias or t.id, sn.id,
             summary["ms"])
    return summary


def unshared_templates(s: Session, exclude: Iterable[str]) -> list[str]:
    """Ready templates whose snapshot was never published (not the ``exclude``d: the builtin ones)."""
    skip = set(exclude)
    return [tid for tid, alias in s.execute(
        select(Template.id, Template.alias).join(Snapshot, Snapshot.id == Template.boot_snapshot_id)
        .where(Template.status == BuildStatus.READY, Snapshot.published.is_(False)))
        if tid not in skip and (alias is None or alias not in skip)]


async def import_template(db: Database, repo: Repository, snapshots_dir: Path, name: str) -> bool:
    """Import the template ``name`` (an id or an alias) another node published; False if none did."""
    rec = await trio.to_thread.run_sync(get_template, repo, name)
    if rec is None:
        return False
    manifest = await fetch_snapshot(repo, rec.snapshot_id)
    snap_dir = await write_vmstate(snapshots_dir, manifest)

    def record(s: Session) -> None:
        if s.get(Template, rec.template_id) is not None:
            return  # imported meanwhile (or built here under the same id)
        record_published_snapshot(s, manifest, snap_dir)
        alias = rec.alias
        if alias is not None and s.scalars(select(Template.id).where(Template.alias == alias)).first():
            alias = None  # a template of this node has the name: the shared one is known by its id here
        s.add(Template(id=rec.template_id, alias=alias, kind=TemplateKind(rec.kind), status=BuildStatus.READY,
                       cpu_count=rec.cpu_count, memory_mb=rec.memory_mb, disk_size_mb=rec.disk_size_mb,
                       envd_version=rec.envd_version, boot_snapshot_id=rec.snapshot_id))
        record_event(s, "template_import", subject=EventSubject.TEMPLATE, subject_id=rec.template_id,
                     detail={"snapshot_id": rec.snapshot_id, "alias": alias, "publisher": rec.publisher})

    await db.run(record)
    log.info("imported template %s (snapshot %s, published by %s) from the repository", name, rec.snapshot_id,
             rec.publisher)
    return True


async def forget_template(repo: Repository, template_id: str, alias: Optional[str]) -> None:
    """A deleted template's records go, so no node imports it any more."""
    await trio.to_thread.run_sync(drop_template, repo, template_id, alias)
