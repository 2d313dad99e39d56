"""What the cluster's processes say to each other: a node's heartbeat, a placement, a binding.

One set of pydantic models for the scheduler's HTTP API (``scheduler.py``), the records it keeps in Redis
(``store.py``) and the node's heartbeat sender (``heartbeat.py``): what a node sends is what the scheduler
validates and stores, field for field. These are the cluster's own wire format, not E2B's: snake_case, strict
types, unknown fields refused (a node newer than its scheduler must not be read half).

The P2P records (``LayerAnnouncement``, ``LayerHolders``) are defined in ``runtime/peer_models.py``, because
the node's runtime speaks them too and may not import this package, and re-exported here.

Every record in Redis carries ``version``: a scheduler refuses a record of a version it does not know rather
than guessing at it (the rolling upgrade of a cluster bumps it only with a reader for the old one).
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field

from ..runtime.peer_models import NODE_ID_PATTERN, LayerAnnouncement, LayerHolder, LayerHolders

__all__ = [
    "RECORD_VERSION",
    "NODE_ID_PATTERN",
    "ClusterModel",
    "NodeCapacity",
    "NodeLoad",
    "NodeStatus",
    "NodeView",
    "PlacementRequest",
    "Placement",
    "Reservation",
    "BindingRequest",
    "Binding",
    "LayerAnnouncement",
    "LayerHolder",
    "LayerHolders",
]

#: the version of every record this code writes into Redis
RECORD_VERSION: Literal[1] = 1

_SANDBOX_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"


class ClusterModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class NodeCapacity(ClusterModel):
    """What a node has in all (the host's figures, read at each heartbeat: a resized VM shows)."""

    vcpus: int = Field(ge=1)
    memory_mb: int = Field(ge=1)
    disk_free_mb: int = Field(ge=0)
    #: network slots it can still give (a sandbox needs one)
    slots_free: int = Field(ge=0)


class NodeLoad(ClusterModel):
    """What the node's sandboxes hold: running ones their vCPUs and memory, paused ones nothing but disk."""

    running: int = Field(ge=0)
    paused: int = Field(ge=0)
    vcpus: int = Field(ge=0)
    memory_mb: int = Field(ge=0)


class NodeStatus(ClusterModel):
    """A node's heartbeat: who it is, where its API is, what it has and holds, what it caches."""

    version: Literal[1] = RECORD_VERSION
    node_id: str = Field(pattern=NODE_ID_PATTERN)
    #: the node's API, as the gateway and the other nodes reach it
    url: str = Field(min_length=1, max_length=2048)
    software: str = Field(max_length=64)
    capacity: NodeCapacity
    load: NodeLoad
    #: templates (ids and aliases) whose snapshot the node holds locally: a create from one starts warm
    templates: list[str] = Field(default_factory=list, max_length=10_000)
    #: a draining node takes no new sandboxes
    draining: bool = False


class NodeView(ClusterModel):
    """A node as the scheduler knows it: its last heartbeat, when that came, whether it is schedulable."""

    status: NodeStatus
    #: the scheduler's clock (Redis's) when the heartbeat arrived, unix seconds
    seen_at: float
    alive: bool
    #: vCPUs and memory placed on it that its heartbeats do not count yet
    reserved_vcpus: int = 0
    reserved_memory_mb: int = 0


class PlacementRequest(ClusterModel):
    """Where should a new sandbox (or a resumed one) run?"""

    template_id: str = Field(min_length=1, max_length=256)
    cpu_count: int = Field(ge=1, le=256)
    memory_mb: int = Field(ge=1, le=1 << 22)
    #: nodes not to choose (ones that just failed this create)
    exclude: list[str] = Field(default_factory=list, max_length=1000)
    #: a node to choose when it fits (a paused sandbox's last node: its files are warm there)
    prefer: Optional[str] = None


class Placement(ClusterModel):
    """The chosen node, and the reservation that holds its share until the node's heartbeats count it."""

    placement_id: str
    node_id: str
    url: str


class Reservation(ClusterModel):
    """What a placement took from a node, kept in Redis until a heartbeat sent after it was bound (or failed)
    counts it, or until it expires."""

    version: Literal[1] = RECORD_VERSION
    vcpus: int
    memory_mb: int
    at: float
    #: when the sandbox was bound (the create succeeded): the next heartbeat after it includes it
    bound_at: Optional[float] = None


class BindingRequest(ClusterModel):
    node_id: str = Field(pattern=NODE_ID_PATTERN)
    #: the placement this create used: its reservation is released once the node counts the sandbox
    placement_id: Optional[str] = None


class Binding(ClusterModel):
    """Which node a sandbox lives on (running or paused there, or last published from there)."""

    version: Literal[1] = RECORD_VERSION
    sandbox_id: str = Field(pattern=_SANDBOX_ID_PATTERN)
    node_id: str = Field(pattern=NODE_ID_PATTERN)
