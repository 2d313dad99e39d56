"""The wire format of P2P layer ranges between a node and the scheduler's holder index (docs/cluster.md).

Why in runtime/ and not with the rest of the cluster's models: the node's side of P2P (``peers.py``: the
client the layer cache asks, the announcer) is part of the node's runtime, which may not import ``cluster/``
(dependencies point down), while the scheduler (``cluster/``) may import these.  So they are defined once
here and ``cluster/models.py`` re-exports them: what a node sends is what the scheduler validates and stores,
field for field, as for heartbeats.  Same rules as every cluster record: strict types, unknown fields refused,
``version`` on everything kept in Redis.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from ..storage.repository.manifest import Digest

__all__ = ["NODE_ID_PATTERN", "PEER_RECORD_VERSION", "MAX_ANNOUNCED_LAYERS", "LayerAnnouncement", "LayerHolder",
           "LayerHolders"]

#: a node id: what ``node.node_id`` may be (it names Redis keys and appears in URLs)
NODE_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
#: the version of the P2P records this code writes into Redis
PEER_RECORD_VERSION: Literal[1] = 1
#: the most layers one announcement may name (``p2p.announce_max_layers`` is at most this)
MAX_ANNOUNCED_LAYERS = 10_000


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class LayerAnnouncement(_Wire):
    """The layers a node caches (some chunks of each, at least), most recently used first: it replaces the
    node's previous announcement in the holder index."""

    version: Literal[1] = PEER_RECORD_VERSION
    node_id: str = Field(pattern=NODE_ID_PATTERN)
    layers: list[Digest] = Field(default_factory=list, max_length=MAX_ANNOUNCED_LAYERS)


class LayerHolder(_Wire):
    """A live node that announced a layer, and where its API is (its heartbeat's ``url``)."""

    node_id: str = Field(pattern=NODE_ID_PATTERN)
    url: str = Field(min_length=1, max_length=2048)


class LayerHolders(_Wire):
    """The scheduler's answer to "which live nodes hold layer ``digest``" (dead nodes left out by the same
    heartbeat TTL as placement)."""

    version: Literal[1] = PEER_RECORD_VERSION
    digest: Digest
    holders: list[LayerHolder] = Field(default_factory=list)
