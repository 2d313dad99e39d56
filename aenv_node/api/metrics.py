"""Prometheus metrics of the API and the node, one registry per app.

A registry per app (not the process-global default) lets tests run several
nodes in one process. Sandbox counts by state are read from SQLite at scrape
time, so the numbers are the database's truth, not a cached counter. The layer cache's counters (hits,
misses, bytes from the repository, and the P2P ones: ranges and bytes got from peers, peer failures by reason,
ranges served to peers) are read from ``LayerCache.stats()`` at scrape time too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Iterator, Optional

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from sqlalchemy import func, select

from ..runtime import Node
from ..state import Sandbox
from ..storage.cache import LayerCache
from ..storage.cache_stats import CacheStats

__all__ = ["ApiMetrics", "CONTENT_TYPE"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _StateCollector:
    def __init__(self, node: Node) -> None:
        self.node = node

    def collect(self) -> Iterator[GaugeMetricFamily]:
        fam = GaugeMetricFamily("aenv_sandboxes", "Sandboxes by lifecycle state", labels=["state"])
        with self.node.db.session() as s:
            rows = s.execute(select(Sandbox.state, func.count()).group_by(Sandbox.state)).all()
        for state, count in rows:
            fam.add_metric([state], count)
        yield fam
        up = GaugeMetricFamily("aenv_node_in_flight_operations", "Operations in flight")
        up.add_metric([], len(self.node.tracker.active))
        yield up


class CacheCollector:
    """A layer cache's counters (``cache_stats.CacheStats``), read at each scrape (nothing while there are none):
    the node's own cache as ``aenv_cache_*``, the data plane's (the sandboxes' disks) as ``aenv_dataplane_cache_*``."""

    def __init__(self, stats: Callable[[], Optional[CacheStats]], prefix: str = "aenv_cache") -> None:
        self.stats = stats
        self.prefix = prefix

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        st = self.stats()
        if st is None:
            return
        p = self.prefix
        for name, text, value in (("cached_bytes", "Bytes in the local layer cache", st.cached_bytes),
                                  ("capacity_bytes", "Capacity of the local layer cache", st.capacity_bytes)):
            g = GaugeMetricFamily(f"{p}_{name}", text)
            g.add_metric([], value)
            yield g
        for name, text, value in (
                ("hits", "Cache chunk reads served from the cache", st.hits),
                ("misses", "Cache chunk reads that had to fetch", st.misses),
                ("repository_fetches", "Ranges the cache read from the repository", st.fetches),
                ("repository_bytes", "Bytes the cache read from the repository", st.fetched_bytes),
                ("evicted_bytes", "Bytes evicted from the cache", st.evicted_bytes),
                ("peer_hits", "Ranges the cache got from peer nodes (checked by checksum)", st.peer_fetches),
                ("peer_bytes", "Bytes the cache got from peer nodes", st.peer_bytes),
                ("peer_fallbacks", "Ranges read from the repository with P2P on (no record, holder or peer)",
                 st.peer_fallbacks),
                ("served_ranges", "Ranges served to peer nodes", st.served_ranges),
                ("served_bytes", "Bytes served to peer nodes", st.served_bytes),
                ("served_absent", "Peer range requests for ranges not cached here (404)", st.served_absent),
                ("served_busy", "Peer range requests refused at p2p.max_concurrent_serves (503)", st.served_busy)):
            c = CounterMetricFamily(f"{p}_{name}", text)
            c.add_metric([], value)
            yield c
        failures = CounterMetricFamily(f"{p}_peer_failures", "Peer range reads that failed, by reason",
                                       labels=["reason"])
        for reason, n in sorted(st.peer_failures.items()):
            failures.add_metric([reason], n)
        yield failures


class ApiMetrics:
    def __init__(self, node: Node, cache: Optional[Callable[[], Optional[LayerCache]]] = None,
                 dataplane_cache: Optional[Callable[[], Optional[CacheStats]]] = None) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "aenv_api_requests", "API requests", ["endpoint", "method", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "aenv_api_request_seconds", "API request latency", ["endpoint"],
            registry=self.registry,
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )
        self.registry.register(_StateCollector(node))
        if cache is not None:
            own = cache
            self.registry.register(CacheCollector(lambda: None if (c := own()) is None else c.stats()))
        if dataplane_cache is not None:
            self.registry.register(CacheCollector(dataplane_cache, "aenv_dataplane_cache"))

    def observe_request(self, endpoint: str, method: str, status: int, seconds: float) -> None:
        self.requests.labels(endpoint, method, str(status)).inc()
        self.latency.labels(endpoint).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
