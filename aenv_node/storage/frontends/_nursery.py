"""A nursery for the frontends' async context managers that does not wrap the body's own exception.

Trio wraps anything raised inside ``async with open_nursery()`` in an ExceptionGroup. For ``serve_nbd`` and
``mount_fuse`` the body is the caller's code: an error it raises (or a failure of exactly one of our tasks)
should come out as itself, so callers can ``except`` it as usual. Several failures stay grouped.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio


@asynccontextmanager
async def open_service_nursery() -> AsyncIterator[trio.Nursery]:
    try:
        async with trio.open_nursery() as nursery:
            yield nursery
    except BaseExceptionGroup as group:
        if len(group.exceptions) == 1 and not isinstance(group.exceptions[0], BaseExceptionGroup):
            raise group.exceptions[0] from None
        raise
