"""The Trio supervisor tree: the node, its services, and in-flight operations."""

from .errors import NodeDraining, RuntimeLayerError
from .node import Node, Reconciler, Service, ensure_api_key
from .operations import OperationTracker
from .supervisor import run_node

__all__ = [
    "Node",
    "Service",
    "Reconciler",
    "OperationTracker",
    "NodeDraining",
    "RuntimeLayerError",
    "ensure_api_key",
    "run_node",
]
