"""Persistence of the local cache's per-layer counters in the node database (``cache_entries``).

The cache keeps its counters in memory and hands this store a batch of changed rows now and then (every
``flush_interval_s`` and on close), so reads never wait for SQLite; one flush is one transaction of upserts.
The sparse files and their bitmaps are the truth about *what* is cached; these rows are the truth about *how the
cache has been used* (hits, misses, bytes fetched and evicted) and are what ``sqlite3 aenv.db`` shows an operator.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Iterable

from sqlalchemy import delete, select
from sqlalchemy.dialects.sqlite import insert

from ..state.db import Database
from ..state.models import CacheEntry
from .cache_layer import CachedLayer

__all__ = ["CacheStore", "CacheRow"]


@dataclass
class CacheRow:
    """One layer's counters, as the cache hands them over (timestamps are unix seconds)."""

    layer_digest: str
    path: str
    size_bytes: int
    cached_bytes: int
    hits: int
    misses: int
    fetched_bytes: int
    evicted_bytes: int
    created_at: float
    last_access_at: float

    @classmethod
    def of(cls, x: CachedLayer) -> CacheRow:
        """The row of a cached layer's current counters (the caller holds the cache's lock)."""
        return cls(
            layer_digest=x.digest,
            path=str(x.data_path),
            size_bytes=x.size,
            cached_bytes=x.cached_bytes,
            hits=x.hits,
            misses=x.misses,
            fetched_bytes=x.fetched_bytes,
            evicted_bytes=x.evicted_bytes,
            created_at=x.created_at,
            last_access_at=x.last_access_at,
        )


def _ts(t: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(t, dt.timezone.utc)


class CacheStore:
    """Reads and batch-writes ``cache_entries`` rows.  Blocking; called from the cache's threads."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def load(self) -> dict[str, CacheRow]:
        with self.db.session() as s:
            rows = s.scalars(select(CacheEntry)).all()
            return {
                r.layer_digest: CacheRow(
                    layer_digest=r.layer_digest,
                    path=r.path,
                    size_bytes=r.size_bytes,
                    cached_bytes=r.cached_bytes,
                    hits=r.hits,
                    misses=r.misses,
                    fetched_bytes=r.fetched_bytes,
                    evicted_bytes=r.evicted_bytes,
                    created_at=r.created_at.timestamp(),
                    last_access_at=r.last_access_at.timestamp(),
                )
                for r in rows
            }

    def save(self, rows: Iterable[CacheRow]) -> int:
        """Upsert ``rows`` in one transaction; return how many were written."""
        values = [
            {
                "layer_digest": r.layer_digest,
                "path": r.path,
                "size_bytes": r.size_bytes,
                "cached_bytes": r.cached_bytes,
                "hits": r.hits,
                "misses": r.misses,
                "fetched_bytes": r.fetched_bytes,
                "evicted_bytes": r.evicted_bytes,
                "created_at": _ts(r.created_at),
                "last_access_at": _ts(r.last_access_at),
            }
            for r in rows
        ]
        if not values:
            return 0
        stmt = insert(CacheEntry)
        stmt = stmt.on_conflict_do_update(
            index_elements=[CacheEntry.layer_digest],
            set_={
                c: stmt.excluded[c]
                for c in (
                    "path",
                    "size_bytes",
                    "cached_bytes",
                    "hits",
                    "misses",
                    "fetched_bytes",
                    "evicted_bytes",
                    "last_access_at",
                )
            },
        )
        with self.db.session() as s:
            s.execute(stmt, values)
        return len(values)

    def delete(self, digests: Iterable[str]) -> None:
        ds = list(digests)
        if ds:
            with self.db.session() as s:
                s.execute(delete(CacheEntry).where(CacheEntry.layer_digest.in_(ds)))
