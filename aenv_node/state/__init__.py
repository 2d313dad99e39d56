"""The node's state: SQLAlchemy models over one SQLite database, and the
repository functions that change it (each change with its event row)."""

from .db import Database
from .errors import IllegalTransition, NotFound, StateError
from .models import (
    Base,
    CacheEntry,
    Event,
    Layer,
    NetworkSlot,
    Node,
    Sandbox,
    SandboxState,
    Snapshot,
    SnapshotLayer,
    Template,
    TemplateBuild,
    utcnow,
)

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
]
