"""What the local layer cache reports about itself: per-layer and total counters, as plain values.

Why apart from the cache: these are the cache's public report (its janitor, the benchmarks and the tests read
them), a snapshot taken under the cache's lock and then handed out, so a caller never sees the cache's live,
lock-guarded state.  The counters themselves live on each :class:`~.cache_layer.CachedLayer`; the
SQLite copy of them is :mod:`.cache_store`'s.  The P2P counters (ranges got from and served to peers,
:mod:`.cache_peers`) are the cache's totals, not per layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .cache_layer import CachedLayer
from .cache_peers import PeerCounters

__all__ = ["CacheStats", "LayerCacheStats", "layer_stats", "total_stats"]


@dataclass
class LayerCacheStats:
    digest: str
    size_bytes: int
    cached_bytes: int
    hits: int
    misses: int
    fetches: int
    fetched_bytes: int
    evicted_bytes: int
    adopted_bytes: int
    last_access_at: float


@dataclass
class CacheStats:
    """Totals over all layers (``hits``/``misses`` count chunks; ``fetches`` and ``fetched_bytes`` count
    repository reads; ``peer_*`` ranges got from peers, ``served_*`` ranges served to them)."""

    entries: int
    capacity_bytes: int
    cached_bytes: int
    hits: int
    misses: int
    fetches: int
    fetched_bytes: int
    evicted_bytes: int
    adopted_bytes: int
    write_errors: int
    #: P2P on for this cache
    p2p: bool = False
    peer_fetches: int = 0
    peer_bytes: int = 0
    #: reason (``cache_peers.FAILURE_REASONS``) -> peer reads that failed so
    peer_failures: dict[str, int] = field(default_factory=dict)
    peer_fallbacks: int = 0
    served_ranges: int = 0
    served_bytes: int = 0
    served_absent: int = 0
    served_busy: int = 0


def layer_stats(x: CachedLayer) -> LayerCacheStats:
    """One layer's counters (the caller holds the cache's lock)."""
    return LayerCacheStats(
        digest=x.digest,
        size_bytes=x.size,
        cached_bytes=x.cached_bytes,
        hits=x.hits,
        misses=x.misses,
        fetches=x.fetches,
        fetched_bytes=x.fetched_bytes,
        evicted_bytes=x.evicted_bytes,
        adopted_bytes=x.adopted_bytes,
        last_access_at=x.last_access_at,
    )


def total_stats(
    ls: Sequence[CachedLayer], *, capacity_bytes: int, cached_bytes: int, write_errors: int,
    peers: PeerCounters | None = None,
) -> CacheStats:
    """The totals over ``ls``, every layer of the cache (the caller holds the cache's lock), and the P2P
    counters ``peers`` (None: P2P is off)."""
    p = peers or PeerCounters()
    return CacheStats(
        entries=len(ls),
        capacity_bytes=capacity_bytes,
        cached_bytes=cached_bytes,
        hits=sum(x.hits for x in ls),
        misses=sum(x.misses for x in ls),
        fetches=sum(x.fetches for x in ls),
        fetched_bytes=sum(x.fetched_bytes for x in ls),
        evicted_bytes=sum(x.evicted_bytes for x in ls),
        adopted_bytes=sum(x.adopted_bytes for x in ls),
        write_errors=write_errors,
        p2p=peers is not None,
        peer_fetches=p.peer_fetches,
        peer_bytes=p.peer_bytes,
        peer_failures=dict(p.peer_failures),
        peer_fallbacks=p.peer_fallbacks,
        served_ranges=p.served_ranges,
        served_bytes=p.served_bytes,
        served_absent=p.served_absent,
        served_busy=p.served_busy,
    )
