"""SQLAlchemy 2 typed models: the node's truth, readable with plain ``sqlite3``.

Conventions a person querying the database can rely on:

* table and column names are plain English, snake_case;
* every timestamp is UTC ISO-8601 text with milliseconds and a ``Z``
  (``2026-11-29T15:40:12.123Z``): it sorts as text and SQLite's date functions
  (``julianday``, ``datetime``) understand it;
* JSON only where the data is really free-form (metadata, env vars, policies);
* durations are ``*_ms`` floats, sizes ``*_bytes`` or ``*_mb`` integers.

The schema is created and changed only by the Alembic history in
``migrations/``; a test checks that these models and the migrated schema do
not drift apart.
"""

from __future__ import annotations

import datetime as dt
import enum
from typing import Any, Optional, TypeVar

from sqlalchemy import (
    JSON,
    Boolean,
    Enum,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    TypeDecorator,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

from .records import RecordType, SnapshotConfig

__all__ = [
    "Base",
    "UtcTimestamp",
    "utcnow",
    "SandboxState",
    "SnapshotKind",
    "SnapshotStatus",
    "TemplateKind",
    "BuildStatus",
    "LayerKind",
    "SlotState",
    "NodeState",
    "EventSubject",
    "TERMINAL_STATES",
    "Node",
    "Template",
    "TemplateBuild",
    "TemplateTag",
    "Sandbox",
    "Snapshot",
    "Layer",
    "SnapshotLayer",
    "CacheEntry",
    "NetworkSlot",
    "Event",
    "SandboxLog",
    "ConsoleOffset",
    "IdempotencyKey",
]


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


class UtcTimestamp(TypeDecorator[dt.datetime]):
    """Aware UTC datetimes stored as ISO-8601 text ``YYYY-MM-DDTHH:MM:SS.mmmZ``."""

    impl = String(24)
    cache_ok = True

    def process_bind_param(self, value: Optional[dt.datetime], dialect: Any) -> Optional[str]:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to a UTC column")
        value = value.astimezone(dt.timezone.utc)
        return value.strftime("%Y-%m-%dT%H:%M:%S.") + f"{value.microsecond // 1000:03d}Z"

    def process_result_value(self, value: Optional[str], dialect: Any) -> Optional[dt.datetime]:
        if value is None:
            return None
        return dt.datetime.fromisoformat(value.replace("Z", "+00:00"))


class SandboxState(enum.StrEnum):
    """Lifecycle states (DESIGN.md "Sandbox lifecycle")."""

    CREATING = "creating"
    RUNNING = "running"
    PAUSING = "pausing"
    PAUSED = "paused"
    RESUMING = "resuming"
    SNAPSHOTTING = "snapshotting"
    FORKING = "forking"
    KILLING = "killing"
    KILLED = "killed"
    ERROR = "error"


class SnapshotKind(enum.StrEnum):
    """Why a snapshot was taken."""

    BOOT = "boot"  # a template's build
    PAUSE = "pause"
    USER = "user"  # POST /sandboxes/{id}/snapshots: also a template
    FORK = "fork"
    PERIODIC = "periodic"


class SnapshotStatus(enum.StrEnum):
    COMMITTING = "committing"
    COMMITTED = "committed"
    DELETED = "deleted"  # a user snapshot deleted, or a periodic one superseded: files go at the next collection
    COLLECTED = "collected"  # its files are gone; the row stays (lineage is history)


class TemplateKind(enum.StrEnum):
    TEMPLATE = "template"  # built from a root filesystem
    SNAPSHOT = "snapshot"  # a user snapshot of a running sandbox


class BuildStatus(enum.StrEnum):
    """Status of a template and of one of its builds."""

    WAITING = "waiting"  # a build registered (POST /v3/templates), not started yet
    BUILDING = "building"
    READY = "ready"
    ERROR = "error"


class LayerKind(enum.StrEnum):
    DISK = "disk"
    MEMORY = "memory"


class SlotState(enum.StrEnum):
    WARM = "warm"
    IN_USE = "in_use"


class NodeState(enum.StrEnum):
    RUNNING = "running"
    STOPPED = "stopped"


class EventSubject(enum.StrEnum):
    SANDBOX = "sandbox"
    TEMPLATE = "template"
    NODE = "node"
    SNAPSHOT = "snapshot"
    IMAGE = "image"  # an OCI image pulled, a layer of one converted


E = TypeVar("E", bound=enum.StrEnum)


def enum_column(enum_type: type[E], length: int) -> "Enum":
    """A string column holding the enum's values (not its member names), without a CHECK constraint:
    values stay readable in ``sqlite3`` and a new member needs no table rebuild."""
    return Enum(enum_type, native_enum=False, create_constraint=False, length=length, validate_strings=True,
                values_callable=lambda members: [m.value for m in members])


TERMINAL_STATES = frozenset({SandboxState.KILLED})

# Deterministic constraint names keep Alembic's autogenerate and batch mode sane.
NAMING = {
    "ix": "ix_%(table_name)s_%(column_0_name)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)
    type_annotation_map = {dt.datetime: UtcTimestamp, dict[str, Any]: JSON, list[Any]: JSON}


class Node(Base):
    """A node process that has used this database (one row per node id)."""

    __tablename__ = "nodes"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    hostname: Mapped[str] = mapped_column(String(255))
    listen: Mapped[str] = mapped_column(String(255))
    version: Mapped[str] = mapped_column(String(32))
    state: Mapped[NodeState] = mapped_column(enum_column(NodeState, 16), default=NodeState.RUNNING)
    started_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    stopped_at: Mapped[Optional[dt.datetime]]


class Template(Base):
    """A template sandboxes are created from: built from a rootfs, or a snapshot."""

    __tablename__ = "templates"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    alias: Mapped[Optional[str]] = mapped_column(String(128), unique=True)
    kind: Mapped[TemplateKind] = mapped_column(enum_column(TemplateKind, 16), default=TemplateKind.TEMPLATE)
    status: Mapped[BuildStatus] = mapped_column(enum_column(BuildStatus, 16), default=BuildStatus.BUILDING)
    cpu_count: Mapped[int] = mapped_column(Integer, default=2)
    memory_mb: Mapped[int] = mapped_column(Integer, default=512)
    disk_size_mb: Mapped[int] = mapped_column(Integer, default=2048)
    envd_version: Mapped[str] = mapped_column(String(32), default="")
    boot_snapshot_id: Mapped[Optional[str]] = mapped_column(
        ForeignKey("snapshots.id", ondelete="SET NULL")
    )
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[dt.datetime] = mapped_column(default=utcnow, onupdate=utcnow)


class TemplateBuild(Base):
    __tablename__ = "template_builds"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    template_id: Mapped[str] = mapped_column(ForeignKey("templates.id", ondelete="CASCADE"), index=True)
    status: Mapped[BuildStatus] = mapped_column(enum_column(BuildStatus, 16), default=BuildStatus.BUILDING)
    source: Mapped[str] = mapped_column(Text, default="")  # rootfs path, OCI ref, directory
    #: what ``source`` resolved to: an OCI image's manifest digest (NULL for a raw root filesystem)
    source_digest: Mapped[Optional[str]] = mapped_column(String(71))
    kit_hash: Mapped[str] = mapped_column(String(64), default="")
    started_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    finished_at: Mapped[Optional[dt.datetime]]
    duration_ms: Mapped[Optional[float]] = mapped_column(Float)
    error: Mapped[Optional[str]] = mapped_column(Text)
    #: where a failed build stopped, as E2B's status names it: "base" (pull, conversion, boot), "1".."N"
    #: (a step), "finalize" (start and ready commands, snapshot)
    error_step: Mapped[Optional[str]] = mapped_column(String(16))
    log_path: Mapped[Optional[str]] = mapped_column(Text)
    #: the tags this build gets when it succeeds (``name:tag`` and ``tags`` of ``POST /v3/templates``)
    tags: Mapped[list[str]] = mapped_column(JSON, default=list)
    #: the boot snapshot this build made (NULL until it is ready)
    snapshot_id: Mapped[Optional[str]] = mapped_column(ForeignKey("snapshots.id", ondelete="SET NULL"))


class TemplateTag(Base):
    """A tag names one ready build of a template (``name:tag``); ``default`` is what a bare name means. A
    tag moves when a later build takes it; the snapshots tagged builds made stay (the garbage collector
    keeps them) until the tag goes."""

    __tablename__ = "template_tags"

    template_id: Mapped[str] = mapped_column(ForeignKey("templates.id", ondelete="CASCADE"), primary_key=True)
    tag: Mapped[str] = mapped_column(String(128), primary_key=True)
    build_id: Mapped[str] = mapped_column(ForeignKey("template_builds.id", ondelete="CASCADE"), index=True)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)


class Sandbox(Base):
    __tablename__ = "sandboxes"
    #: the order (and keyset) of ``GET /v2/sandboxes``: a page reads from the index, it sorts nothing
    __table_args__ = (Index("ix_sandboxes_started_at_id", "started_at", "id"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    template_id: Mapped[str] = mapped_column(String(64), index=True)
    node_id: Mapped[str] = mapped_column(String(64), default="")
    state: Mapped[SandboxState] = mapped_column(enum_column(SandboxState, 16), index=True,
                                                default=SandboxState.CREATING)
    client_id: Mapped[str] = mapped_column(String(64), default="")
    alias: Mapped[Optional[str]] = mapped_column(String(128))
    cpu_count: Mapped[int] = mapped_column(Integer, default=2)
    memory_mb: Mapped[int] = mapped_column(Integer, default=512)
    disk_size_mb: Mapped[int] = mapped_column(Integer, default=2048)
    envd_version: Mapped[str] = mapped_column(String(32), default="")
    envd_access_token: Mapped[Optional[str]] = mapped_column(String(128))
    traffic_access_token: Mapped[Optional[str]] = mapped_column(String(128))
    metadata_: Mapped[dict[str, Any]] = mapped_column("metadata", JSON, default=dict)
    env_vars: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    auto_pause: Mapped[bool] = mapped_column(Boolean, default=True)
    auto_resume: Mapped[bool] = mapped_column(Boolean, default=False)
    allow_internet_access: Mapped[bool] = mapped_column(Boolean, default=True)
    network_policy: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    # The snapshot this sandbox's current run was restored from (its head when paused).
    snapshot_id: Mapped[Optional[str]] = mapped_column(
        ForeignKey("snapshots.id", ondelete="SET NULL")
    )
    parent_sandbox_id: Mapped[Optional[str]] = mapped_column(String(64))  # set for forks
    slot_index: Mapped[Optional[int]] = mapped_column(Integer)
    vmm: Mapped[str] = mapped_column(String(16), default="")
    vmm_pid: Mapped[Optional[int]] = mapped_column(Integer)
    workdir: Mapped[Optional[str]] = mapped_column(Text)
    started_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    end_at: Mapped[dt.datetime] = mapped_column(default=utcnow, index=True)
    paused_at: Mapped[Optional[dt.datetime]]
    killed_at: Mapped[Optional[dt.datetime]]
    updated_at: Mapped[dt.datetime] = mapped_column(default=utcnow, onupdate=utcnow)
    error: Mapped[Optional[str]] = mapped_column(Text)


class Snapshot(Base):
    """A committed point of a sandbox's life: the snapshot DAG (parent, source sandbox).

    What SQL needs is in columns (the memory image locations and the template RAM layer the garbage
    collector follows, the publish state); the rest of what a restore needs is the typed ``config``
    (``records.SnapshotConfig``). The memory chain itself is ``snapshot_layers`` (kind ``memory``).
    """

    __tablename__ = "snapshots"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    kind: Mapped[SnapshotKind] = mapped_column(enum_column(SnapshotKind, 16))
    status: Mapped[SnapshotStatus] = mapped_column(enum_column(SnapshotStatus, 16),
                                                   default=SnapshotStatus.COMMITTING)
    name: Mapped[Optional[str]] = mapped_column(String(128))
    parent_id: Mapped[Optional[str]] = mapped_column(
        ForeignKey("snapshots.id", ondelete="SET NULL"), index=True
    )
    source_sandbox_id: Mapped[Optional[str]] = mapped_column(String(64), index=True)
    template_id: Mapped[Optional[str]] = mapped_column(String(64))
    vmm: Mapped[str] = mapped_column(String(16), default="")
    vmstate_location: Mapped[Optional[str]] = mapped_column(Text)
    #: how the vmstate file replays (the VMM driver's ``SnapshotFormat`` value)
    vmstate_format: Mapped[str] = mapped_column(String(32), default="")
    #: the flat memory image every restore of this snapshot maps copy-on-write
    memory_location: Mapped[Optional[str]] = mapped_column(Text)
    #: the flat image at the bottom of the memory chain (a template's RAM file); NULL when the chain's
    #: layers stand alone (a boot snapshot's own memory, an imported chain)
    memory_base_location: Mapped[Optional[str]] = mapped_column(Text)
    #: boot snapshots: their RAM image imported as a layer (published as the bottom of memory chains)
    memory_base_layer: Mapped[Optional[str]] = mapped_column(String(71), index=True)  # gc.py's refcount looks it up
    #: imported: ``memory_location`` is materialized from the memory layers on first use
    memory_from_layers: Mapped[bool] = mapped_column(Boolean, default=False)
    #: committed to the shared repository (the sandbox's record points at it)
    published: Mapped[bool] = mapped_column(Boolean, default=False)
    #: imported: the parent's id on the node that published it (not a row here)
    imported_parent_id: Mapped[Optional[str]] = mapped_column(String(64))
    #: bytes of guest memory the capture copied (dirtied since the restore)
    dirty_bytes: Mapped[Optional[int]] = mapped_column(Integer)
    config: Mapped[Optional[SnapshotConfig]] = mapped_column(RecordType(SnapshotConfig))
    memory_mb: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    committed_at: Mapped[Optional[dt.datetime]]

    layers: Mapped[list["SnapshotLayer"]] = relationship(
        order_by="SnapshotLayer.position", cascade="all, delete-orphan"
    )


class Layer(Base):
    """An immutable, content-addressed layer: a local file, or only in the shared repository."""

    __tablename__ = "layers"

    digest: Mapped[str] = mapped_column(String(71), primary_key=True)  # "sha256:<hex>"
    kind: Mapped[LayerKind] = mapped_column(enum_column(LayerKind, 8))
    size_bytes: Mapped[int] = mapped_column(Integer)
    virtual_size_bytes: Mapped[int] = mapped_column(Integer, default=0)
    #: the local file; NULL: only in the repository (read on demand through the layer cache)
    local_path: Mapped[Optional[str]] = mapped_column(Text)
    #: the key the shared repository holds it under, once it is there (stored, published or imported)
    repository_key: Mapped[Optional[str]] = mapped_column(Text)
    refcount: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)


class ImageLayer(Base):
    """A block layer converted from an OCI layer, keyed by its chain: the filesystem format at the bottom, then
    every OCI layer's diff id up to this one (OCI's ChainID, salted with the format). Two images sharing base
    layers share these rows and their files; a second pull of a shared base converts nothing. The layers this
    table names stay while it names them (the garbage collector keeps them); a row no build has used for
    ``images.layer_cache_ttl_s`` whose layer no kept snapshot stacks is dropped by a collection, and its
    layer goes with it."""

    __tablename__ = "image_layers"

    #: hex sha256 of (parent chain id, diff id); the bottom row's parent is the empty filesystem's key
    chain_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    parent_chain_id: Mapped[Optional[str]] = mapped_column(String(64))
    #: "sha256:<hex>" of the OCI layer's uncompressed tar; for the empty filesystem, its format key
    diff_id: Mapped[str] = mapped_column(String(128))
    layer_digest: Mapped[str] = mapped_column(ForeignKey("layers.digest"), index=True)
    #: the image reference whose pull converted it first (for humans reading SQL)
    first_source: Mapped[str] = mapped_column(Text, default="")
    convert_ms: Mapped[Optional[float]] = mapped_column(Float)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    #: the last build that used it (converted or found it); unused rows expire (``images.layer_cache_ttl_s``)
    last_used_at: Mapped[dt.datetime] = mapped_column(default=utcnow)


class PulledImage(Base):
    """An OCI image this node pulled: what a reference resolved to (its manifest digest, which a template
    records, so the tag moving later changes nothing built from it), its config, and its top chain."""

    __tablename__ = "images"

    digest: Mapped[str] = mapped_column(String(71), primary_key=True)  # the manifest's "sha256:<hex>"
    canonical: Mapped[str] = mapped_column(Text)  # registry/repository@digest
    reference: Mapped[str] = mapped_column(Text)  # as asked for, the last time
    config: Mapped[dict[str, Any]] = mapped_column(JSON)  # env, working_dir, user, cmd, entrypoint
    layer_count: Mapped[int] = mapped_column(Integer, default=0)
    compressed_bytes: Mapped[int] = mapped_column(Integer, default=0)
    top_chain_id: Mapped[Optional[str]] = mapped_column(String(64))  # NULL until converted
    pulled_at: Mapped[dt.datetime] = mapped_column(default=utcnow)


class SnapshotLayer(Base):
    """Which layers a snapshot stacks, bottom first, per kind."""

    __tablename__ = "snapshot_layers"

    snapshot_id: Mapped[str] = mapped_column(
        ForeignKey("snapshots.id", ondelete="CASCADE"), primary_key=True
    )
    kind: Mapped[LayerKind] = mapped_column(enum_column(LayerKind, 8), primary_key=True)
    position: Mapped[int] = mapped_column(Integer, primary_key=True)
    layer_digest: Mapped[str] = mapped_column(ForeignKey("layers.digest"), index=True)


class CacheEntry(Base):
    """The local cache's view of one layer: what is cached and how it is used."""

    __tablename__ = "cache_entries"

    layer_digest: Mapped[str] = mapped_column(String(71), primary_key=True)
    path: Mapped[str] = mapped_column(Text)  # sparse cache file
    size_bytes: Mapped[int] = mapped_column(Integer)  # full layer size
    cached_bytes: Mapped[int] = mapped_column(Integer, default=0)
    hits: Mapped[int] = mapped_column(Integer, default=0)
    misses: Mapped[int] = mapped_column(Integer, default=0)
    fetched_bytes: Mapped[int] = mapped_column(Integer, default=0)
    evicted_bytes: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    last_access_at: Mapped[dt.datetime] = mapped_column(default=utcnow, index=True)


class NetworkSlot(Base):
    __tablename__ = "network_slots"

    slot_index: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    netns: Mapped[str] = mapped_column(String(64))
    host_ip: Mapped[str] = mapped_column(String(45))
    slot_ip: Mapped[str] = mapped_column(String(45))
    state: Mapped[SlotState] = mapped_column(enum_column(SlotState, 16), default=SlotState.WARM)
    sandbox_id: Mapped[Optional[str]] = mapped_column(String(64), index=True)
    updated_at: Mapped[dt.datetime] = mapped_column(default=utcnow, onupdate=utcnow)


class Event(Base):
    """Append-only history: one row per state change, written in its transaction."""

    __tablename__ = "events"
    __table_args__ = (Index("ix_events_sandbox_id_ts", "sandbox_id", "ts"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    ts: Mapped[dt.datetime] = mapped_column(default=utcnow, index=True)
    sandbox_id: Mapped[Optional[str]] = mapped_column(String(64))
    subject: Mapped[EventSubject] = mapped_column(enum_column(EventSubject, 16), default=EventSubject.SANDBOX)
    subject_id: Mapped[Optional[str]] = mapped_column(String(64))
    operation: Mapped[str] = mapped_column(String(32), index=True)
    from_state: Mapped[Optional[str]] = mapped_column(String(16))
    to_state: Mapped[Optional[str]] = mapped_column(String(16))
    duration_ms: Mapped[Optional[float]] = mapped_column(Float)
    error: Mapped[Optional[str]] = mapped_column(Text)
    detail: Mapped[Optional[dict[str, Any]]] = mapped_column(JSON(none_as_null=True))


class SandboxLog(Base):
    """One line of a sandbox's logs: its guest console (kernel, init) and envd, as E2B's logs routes serve them.

    Written by ``runtime/console_log.py`` while the sandbox runs, so they outlive pause and resume; bounded per
    sandbox (``logs.max_lines_per_sandbox``, oldest dropped) and kept ``logs.retention_s`` after it ends.
    ``ts`` is when the node read the line (the guest's clock may be off until envd's ``/init`` sets it).
    """

    __tablename__ = "sandbox_logs"
    __table_args__ = (Index("ix_sandbox_logs_sandbox_id_ts", "sandbox_id", "ts"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    sandbox_id: Mapped[str] = mapped_column(ForeignKey("sandboxes.id", ondelete="CASCADE"))
    ts: Mapped[dt.datetime] = mapped_column(default=utcnow)
    level: Mapped[str] = mapped_column(String(8))  # debug | info | warn | error (E2B's LogLevel)
    source: Mapped[str] = mapped_column(String(16))  # kernel | init | envd | console
    logger: Mapped[Optional[str]] = mapped_column(String(64))  # envd's logger name
    message: Mapped[str] = mapped_column(Text)


class ConsoleOffset(Base):
    """How far the node has read one sandbox run's console into its logs (``state/sandbox_logs.py``).

    Written in the transaction that stores the lines it covers, so a node killed at any point and taking the
    run over again reads every line exactly once. ``run`` names the run (its console file and its VMM's pid): a
    resume writes a new console at the same path, and a take-over must not go on from the old run's offset.
    """

    __tablename__ = "console_offsets"

    sandbox_id: Mapped[str] = mapped_column(ForeignKey("sandboxes.id", ondelete="CASCADE"), primary_key=True)
    run: Mapped[str] = mapped_column(Text)
    bytes_read: Mapped[int] = mapped_column(Integer)  # the console's bytes stored as lines (a partial line not)


class IdempotencyKey(Base):
    """A create's ``Idempotency-Key`` and the sandbox it made (``state/idempotency.py``): a retried request with
    the same key gets that sandbox back instead of a second one. Written in the transaction that inserts the
    sandbox, so no crash can leave a sandbox without its key or a key without its sandbox."""

    __tablename__ = "idempotency_keys"

    key: Mapped[str] = mapped_column(String(255), primary_key=True)
    request_hash: Mapped[str] = mapped_column(String(64))  # sha256 of the effective request
    sandbox_id: Mapped[str] = mapped_column(ForeignKey("sandboxes.id", ondelete="CASCADE"), index=True)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow, index=True)
