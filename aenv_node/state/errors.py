"""Typed errors of the state layer (mapped to API errors once, at the edge)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .models import SandboxState


class StateError(Exception):
    """Base of state-layer errors."""


class NotFound(StateError):
    """The row asked for does not exist (or is gone)."""


class IllegalTransition(StateError):
    """A lifecycle transition the state machine does not allow."""

    def __init__(self, sandbox_id: str, current: "SandboxState", wanted: "SandboxState", operation: str):
        self.sandbox_id = sandbox_id
        self.current = current
        self.wanted = wanted
        self.operation = operation
        super().__init__(
            f"cannot {operation} sandbox {sandbox_id}: it is {current.value}"
            f" (cannot go to {wanted.value})"
        )


class IdempotencyMismatch(StateError):
    """An ``Idempotency-Key`` used again with another request than the one it was first given with."""

    def __init__(self, key: str, sandbox_id: str) -> None:
        self.key = key
        self.sandbox_id = sandbox_id
        super().__init__(f"Idempotency-Key {key!r} was used for another request (it created sandbox {sandbox_id}); "
                         "use a new key for a new request")


class DatabaseBusy(StateError):
    """A transaction waited out the busy timeout for another connection's write lock (rolled back whole)."""
