"""Prometheus metrics of the API and the node, one registry per app.

A registry per app (not the process-global default) lets tests run several
nodes in one process. Sandbox counts by state are read from SQLite at scrape
time, so the numbers are the database's truth, not a cached counter.
"""

from __future__ import annotations

from typing import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from sqlalchemy import func, select

from ..runtime import Node
from ..state import Sandbox

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


class ApiMetrics:
    def __init__(self, node: Node) -> None:
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

    def observe_request(self, endpoint: str, method: str, status: int, seconds: float) -> None:
        self.requests.labels(endpoint, method, str(status)).inc()
        self.latency.labels(endpoint).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
