"""Several nodes as one cluster: the scheduler places sandboxes and knows where each lives, from the nodes'
heartbeats, with all of its state in Redis (docs/cluster.md).

- ``models``: what the cluster's processes say to each other and keep in Redis;
- ``placement``: the pure placement rule (resources, warm templates, least loaded of K);
- ``store``: the Redis records;
- ``scheduler``: the scheduler's HTTP service;
- ``heartbeat``: a node's heartbeat, a node service;
- ``merge``: one listing out of every node's (sandboxes, snapshots, templates), pure;
- ``scheduler_client``: the gateway's client of the scheduler, with its short caches;
- ``gateway``: the E2B API and sandbox traffic in front of the nodes (``gateway_io``: its own answers).
"""

from .gateway import Gateway, run_gateway
from .heartbeat import HeartbeatSender
from .models import Binding, NodeCapacity, NodeLoad, NodeStatus, NodeView, Placement, PlacementRequest
from .placement import NoCapacity, PlacementPolicy, choose_node
from .scheduler import create_scheduler_app, run_scheduler
from .scheduler_client import NoPlacement, SchedulerClient, SchedulerUnavailable
from .store import ClusterStore, StoreUnavailable

__all__ = [
    "Binding",
    "ClusterStore",
    "Gateway",
    "NoPlacement",
    "HeartbeatSender",
    "NoCapacity",
    "NodeCapacity",
    "NodeLoad",
    "NodeStatus",
    "NodeView",
    "Placement",
    "PlacementPolicy",
    "PlacementRequest",
    "SchedulerClient",
    "SchedulerUnavailable",
    "StoreUnavailable",
    "choose_node",
    "create_scheduler_app",
    "run_gateway",
    "run_scheduler",
]
