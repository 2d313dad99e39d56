"""The Trio supervisor tree: the node, its services, and in-flight operations."""

from .errors import NodeDraining, RuntimeLayerError
from .api_key import ApiKeyWatcher, ensure_api_key, rotate_api_key
from .node import Node, Reconciler, Service
from .operations import OperationTracker
from .supervisor import run_node

__all__ = [
    "Node",
    "Service",
    "Reconciler",
    "OperationTracker",
    "NodeDraining",
    "RuntimeLayerError",
    "ApiKeyWatcher",
    "ensure_api_key",
    "rotate_api_key",
    "run_node",
]
