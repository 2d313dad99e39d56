"""Typed errors of the runtime layer."""

from __future__ import annotations


class RuntimeLayerError(Exception):
    """Base of runtime errors."""


class NodeDraining(RuntimeLayerError):
    """The node is shutting down and accepts no new operations."""

    http_status = 503

    def __init__(self) -> None:
        super().__init__("the node is shutting down; retry on another node or after restart")
