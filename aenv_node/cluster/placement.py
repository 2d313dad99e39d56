"""Placement: which node a new sandbox goes to, from the nodes' last heartbeats. Pure: no I/O, no clock.

Three steps, as AgentENV's scheduler and E2B's orchestrator place:

1. **Filter by resources.** A node is a candidate when it is alive (a heartbeat within the TTL), not
   draining, not excluded, has a network slot free, and the sandbox's vCPUs and memory fit under its capacity
   times the overcommit ratio, counting what its heartbeat reports and what placements reserved since.
   Memory is overcommitted separately from CPU: guests touch a fraction of their RAM (paused ones none) but a
   node whose guests all touch theirs swaps, so its ratio is usually lower.
2. **Prefer warm nodes.** A node that already holds the template's snapshot starts the sandbox without
   fetching anything; the ones that do (or the ``prefer`` node: a paused sandbox's last node) are chosen
   from first; a cold node imports the template from the repository the nodes share (snapshot/share.py).
3. **Least loaded of K random candidates** ("power of K choices"): comparing a few random nodes instead of
   all spreads a burst of creates from several scheduler replicas, which would otherwise all pick the same
   least loaded node between two heartbeats, at almost the balance of a full scan.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from .models import NodeView, PlacementRequest

__all__ = ["PlacementPolicy", "NoCapacity", "choose_node", "fits", "load"]


class NoCapacity(Exception):
    """No live node can take the sandbox; the message says why for each kind of node left out."""


@dataclass(frozen=True)
class PlacementPolicy:
    #: vCPUs placed per host CPU
    cpu_overcommit: float = 4.0
    #: guest memory placed per MiB of host memory
    memory_overcommit: float = 1.5
    #: K of "least loaded of K random candidates"
    candidates: int = 3


def _used(view: NodeView) -> tuple[int, int]:
    load = view.status.load
    return load.vcpus + view.reserved_vcpus, load.memory_mb + view.reserved_memory_mb


def load(view: NodeView, policy: PlacementPolicy) -> float:
    """How full a node is, 0..1+: the fuller of its CPU and memory against their overcommitted capacity."""
    cap = view.status.capacity
    vcpus, memory = _used(view)
    return max(vcpus / (cap.vcpus * policy.cpu_overcommit), memory / (cap.memory_mb * policy.memory_overcommit))


def fits(view: NodeView, req: PlacementRequest, policy: PlacementPolicy) -> bool:
    """Whether ``req`` fits on the node (it being alive, not draining, is checked apart)."""
    cap = view.status.capacity
    vcpus, memory = _used(view)
    return (cap.slots_free > 0
            and vcpus + req.cpu_count <= cap.vcpus * policy.cpu_overcommit
            and memory + req.memory_mb <= cap.memory_mb * policy.memory_overcommit)


def choose_node(views: Sequence[NodeView], req: PlacementRequest, policy: PlacementPolicy,
                rng: random.Random) -> NodeView:
    """The node for ``req`` (module docstring); ``NoCapacity`` when none can take it."""
    excluded = set(req.exclude)
    live = [v for v in views if v.alive and not v.status.draining and v.status.node_id not in excluded]
    fitting = [v for v in live if fits(v, req, policy)]
    if not fitting:
        if not views:
            raise NoCapacity("no node has registered with the scheduler")
        if not live:
            raise NoCapacity(f"no live node takes sandboxes ({len(views)} known: dead, draining or excluded)")
        raise NoCapacity(f"no live node has room for {req.cpu_count} vCPUs and {req.memory_mb} MiB "
                         f"({len(live)} live nodes are full)")
    if req.prefer is not None:
        for v in fitting:
            if v.status.node_id == req.prefer:
                return v
    warm = [v for v in fitting if req.template_id in v.status.templates]
    pool = warm or fitting
    sample = rng.sample(pool, min(policy.candidates, len(pool)))
    return min(sample, key=lambda v: (load(v, policy), v.status.node_id))
