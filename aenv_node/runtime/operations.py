"""In-flight operation tracking, so a shutdown lets operations finish.

On SIGTERM the supervisor stops admitting new state-changing operations
(they get ``NodeDraining`` -> 503), waits up to the configured grace period
for the running ones to finish (each one commits its outcome or rolls back in
its own shielded cleanup), and only then cancels the node's nursery.
"""

from __future__ import annotations

import contextlib
from typing import AsyncIterator

import trio

from .errors import NodeDraining

__all__ = ["OperationTracker"]


class OperationTracker:
    def __init__(self) -> None:
        self._active: dict[int, str] = {}
        self._next = 0
        self._draining = False
        self._idle = trio.Event()
        self._idle.set()

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def active(self) -> list[str]:
        return list(self._active.values())

    @contextlib.asynccontextmanager
    async def operation(self, name: str) -> AsyncIterator[None]:
        """Admit one operation (raises ``NodeDraining`` while shutting down)."""
        if self._draining:
            raise NodeDraining()
        key = self._next
        self._next += 1
        self._active[key] = name
        if self._idle.is_set():
            self._idle = trio.Event()
        try:
            yield
        finally:
            del self._active[key]
            if not self._active:
                self._idle.set()

    def start_draining(self) -> None:
        self._draining = True

    async def wait_idle(self) -> None:
        await self._idle.wait()
