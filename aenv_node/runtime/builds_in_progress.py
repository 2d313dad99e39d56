"""Which templates have a build in progress, so that what names one waits for it instead of failing.

A create, or a build FROM a template, that names a template with nothing ready yet but a build under way (the
node's ``base`` at first start, a user template's first build) waits for that build rather than answering
"not found". A template with a ready build serves that one while it is rebuilt: waiting is only for names
that resolve to nothing yet. A build waiting for its parent holds no build slot (it waits before taking one),
so a parent queued behind it cannot deadlock.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Awaitable, Callable, Iterable

import trio

__all__ = ["BuildsInProgress"]


class BuildsInProgress:
    """Counts builds in progress by template key (its id and its alias); wakes waiters when any ends."""

    def __init__(self) -> None:
        self._active: Counter[str] = Counter()
        self._ended: dict[str, trio.Event] = {}

    def enter(self, keys: Iterable[str | None]) -> tuple[str, ...]:
        """A build of the template known by ``keys`` starts (call before it is scheduled, so a request that
        arrives meanwhile already sees it). Returns the keys to give ``leave``."""
        held = tuple(dict.fromkeys(k for k in keys if k))
        for k in held:
            self._active[k] += 1
        return held

    def leave(self, keys: tuple[str, ...]) -> None:
        """That build ended (ready or failed): wake whoever waits on its template."""
        for k in keys:
            self._active[k] -= 1
            if self._active[k] <= 0:
                del self._active[k]
            ev = self._ended.pop(k, None)
            if ev is not None:
                ev.set()

    def busy(self, key: str) -> bool:
        return self._active[key] > 0

    def any(self) -> bool:
        """Is any build in progress?"""
        return bool(self._active)

    async def wait(self, key: str, ready: Callable[[], Awaitable[bool]], timeout_s: float) -> None:
        """While a build of ``key`` is in progress and ``ready()`` says the name resolves to nothing, wait for
        a build of it to end (at most ``timeout_s`` in all)."""
        with trio.move_on_after(timeout_s):
            while self.busy(key) and not await ready():
                await self._ended.setdefault(key, trio.Event()).wait()
