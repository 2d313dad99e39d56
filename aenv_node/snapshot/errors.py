"""Typed errors of the snapshot operations (mapped to HTTP once, at the API's edge)."""

from __future__ import annotations

__all__ = ["SnapshotError", "SnapshotNotFound", "SandboxConflict", "SandboxMovedAway", "ForkLimit", "StateDiskFull"]


class SnapshotError(Exception):
    """Base of the snapshot operations' errors."""


class SnapshotNotFound(SnapshotError):
    """A snapshot a sandbox should start from is unknown or no longer committed."""


class SandboxConflict(SnapshotError):
    """The sandbox is not in a state that allows the operation (e.g. pausing a paused one)."""


class SandboxMovedAway(SnapshotError):
    """Another node took over a sandbox this node still runs (it thought this node dead): this copy must stop,
    and leave the sandbox's record to the node that holds it."""

    def __init__(self, sandbox_id: str, owner: str) -> None:
        super().__init__(f"sandbox {sandbox_id} was taken over by node {owner}: this node's copy stops")
        self.sandbox_id = sandbox_id
        self.owner = owner


class ForkLimit(SnapshotError):
    """A fork asked for more (or fewer) children than the node allows."""


class StateDiskFull(SnapshotError):
    """The node's state disk had no room for a capture (ENOSPC); nothing of the capture is kept."""
