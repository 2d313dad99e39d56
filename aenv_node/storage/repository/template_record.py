"""The shared template record: ``template-<id>`` (and ``templatealias-<alias>``) in the repository, typed.  This
module alone reads and writes them.

A template made on one node (a build, or a user snapshot, which E2B creates sandboxes from as from a template)
is published for the other nodes of a cluster: its snapshot as any published snapshot (layers, then the
snapshot manifest: ``Repository.commit_snapshot``), then this record, written last, so a reader never finds a
record whose snapshot is missing::

    {"version": 1, "template_id": "...", "alias": "app" | null, "kind": "template" | "snapshot",
     "cpu_count": 2, "memory_mb": 512, "disk_size_mb": 2048, "envd_version": "...",
     "snapshot_id": "snap-...", "publisher": "<node>/<tag>", "published_at": 1700000000.5}

An alias is found through a record of its own, ``templatealias-<alias>`` = ``{"version": 1, "alias": ...,
"template_id": ...}``, written after the template's record.  A newer build of the template replaces both.

Both are roots of the repository's collector (gc.py): the snapshot a template record names, and its layers,
are kept while the record exists; the records themselves are removed only when the template is deleted on
the node that published it.  A record of a newer version than this code knows is refused (``ValueError``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Final, Literal, Optional

from pydantic import BaseModel, ConfigDict

from .errors import InvalidName, ManifestNotFound
from .manifest import check_manifest_id

if TYPE_CHECKING:
    from .base import Repository

__all__ = [
    "TEMPLATE_PREFIX",
    "ALIAS_PREFIX",
    "TemplateRecord",
    "AliasRecord",
    "is_template_record",
    "put_template",
    "get_template",
    "drop_template",
]

log = logging.getLogger(__name__)

#: Manifests whose id starts with these are template records and alias records.
TEMPLATE_PREFIX: Final = "template-"
ALIAS_PREFIX: Final = "templatealias-"


class TemplateRecord(BaseModel):
    """A template published for every node of the cluster."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    version: Literal[1] = 1
    template_id: str
    alias: Optional[str] = None
    kind: Literal["template", "snapshot"]
    cpu_count: int
    memory_mb: int
    disk_size_mb: int
    envd_version: str = ""
    snapshot_id: str
    publisher: str
    published_at: float


class AliasRecord(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")

    version: Literal[1] = 1
    alias: str
    template_id: str


def is_template_record(manifest_id: str) -> bool:
    """True for the manifests of this module (not snapshot manifests)."""
    return manifest_id.startswith((TEMPLATE_PREFIX, ALIAS_PREFIX))


def _id_of(prefix: str, name: str) -> Optional[str]:
    try:
        return check_manifest_id(f"{prefix}{name}")
    except InvalidName:
        return None


def put_template(repo: Repository, rec: TemplateRecord) -> None:
    """Publish ``rec`` (its snapshot is committed already), then its alias (blocking)."""
    record_id = _id_of(TEMPLATE_PREFIX, rec.template_id)
    if record_id is None:
        raise ValueError(f"template id {rec.template_id!r} cannot name a repository record")
    repo.put_manifest(record_id, rec.model_dump(mode="json"))
    if rec.alias:
        alias_id = _id_of(ALIAS_PREFIX, rec.alias)
        if alias_id is not None:
            repo.put_manifest(alias_id, AliasRecord(alias=rec.alias, template_id=rec.template_id)
                              .model_dump(mode="json"))


def _read(repo: Repository, record_id: str, model: type[TemplateRecord] | type[AliasRecord]
          ) -> Optional[TemplateRecord | AliasRecord]:
    try:
        return model.model_validate(repo.get_manifest(record_id))
    except ManifestNotFound:
        return None


def get_template(repo: Repository, name: str) -> Optional[TemplateRecord]:
    """The record of the template ``name`` (an id or an alias; no ``:tag``), or None (blocking).
    ``ValueError`` for a record this code cannot read."""
    record_id = _id_of(TEMPLATE_PREFIX, name)
    if record_id is None:
        return None
    found = _read(repo, record_id, TemplateRecord)
    if isinstance(found, TemplateRecord):
        return found
    alias_id = _id_of(ALIAS_PREFIX, name)
    alias = _read(repo, alias_id, AliasRecord) if alias_id is not None else None
    if not isinstance(alias, AliasRecord):
        return None
    target = _id_of(TEMPLATE_PREFIX, alias.template_id)
    found = _read(repo, target, TemplateRecord) if target is not None else None
    return found if isinstance(found, TemplateRecord) and found.alias == name else None


def drop_template(repo: Repository, template_id: str, alias: Optional[str]) -> None:
    """Remove a template's records (its alias first, if it still names this template); blocking."""
    if alias:
        alias_id = _id_of(ALIAS_PREFIX, alias)
        current = _read(repo, alias_id, AliasRecord) if alias_id is not None else None
        if alias_id is not None and isinstance(current, AliasRecord) and current.template_id == template_id:
            repo.delete_manifest(alias_id)
    record_id = _id_of(TEMPLATE_PREFIX, template_id)
    if record_id is not None:
        repo.delete_manifest(record_id)
