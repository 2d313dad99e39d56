"""Several nodes as one cluster: the scheduler places sandboxes and knows where each lives, from the nodes'
heartbeats, with all of its state in Redis (docs/cluster.md).

- ``models``: what the cluster's processes say to each other and keep in Redis;
- ``placement``: the pure placement rule (resources, warm templates, least loaded of K);
- ``store``: the Redis records;
- ``scheduler``: the scheduler's HTTP service;
- ``heartbeat``: a node's heartbeat, a node service.
"""

from .heartbeat import HeartbeatSender
from .models import Binding, NodeCapacity, NodeLoad, NodeStatus, NodeView, Placement, PlacementRequest
from .placement import NoCapacity, PlacementPolicy, choose_node
from .scheduler import create_scheduler_app, run_scheduler
from .store import ClusterStore, StoreUnavailable

__all__ = [
    "Binding",
    "ClusterStore",
    "HeartbeatSender",
    "NoCapacity",
    "NodeCapacity",
    "NodeLoad",
    "NodeStatus",
    "NodeView",
    "Placement",
    "PlacementPolicy",
    "PlacementRequest",
    "StoreUnavailable",
    "choose_node",
    "create_scheduler_app",
    "run_scheduler",
]
