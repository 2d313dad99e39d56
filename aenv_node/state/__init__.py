"""The node's state: SQLAlchemy models over one SQLite database, and the
repository functions that change it (each change with its event row)."""

from .db import Database
from .errors import IllegalTransition, NotFound, StateError
from .ids import new_id
from .models import (
    Base,
    BuildStatus,
    CacheEntry,
    Event,
    EventSubject,
    Layer,
    LayerKind,
    NetworkSlot,
    Node,
    NodeState,
    Sandbox,
    SandboxState,
    SlotState,
    Snapshot,
    SnapshotKind,
    SnapshotLayer,
    SnapshotStatus,
    Template,
    TemplateBuild,
    TemplateKind,
    utcnow,
)
from .records import MachineShape, SnapshotConfig

__all__ = [
    "Database",
    "StateError",
    "NotFound",
    "IllegalTransition",
    "Base",
    "CacheEntry",
    "Event",
    "Layer",
    "NetworkSlot",
    "Node",
    "Sandbox",
    "SandboxState",
    "Snapshot",
    "SnapshotLayer",
    "Template",
    "TemplateBuild",
    "utcnow",
    "new_id",
    "BuildStatus",
    "EventSubject",
    "LayerKind",
    "NodeState",
    "SlotState",
    "SnapshotKind",
    "SnapshotStatus",
    "TemplateKind",
    "MachineShape",
    "SnapshotConfig",
]
