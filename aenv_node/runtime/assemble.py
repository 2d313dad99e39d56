"""Putting a node together: its parts, its reconciler and its services, in start order.

``install_sandbox_services(node)`` adds to ``node.services`` (started in this
order by ``run_node``, stopped in the reverse order) and ``node.reconcilers``:

====================  ==========================================================
p2p-announce          the layers cached here, to the scheduler's index (p2p.enabled)
host-network          host tables for the slot range (refuses an overlapping one)
storage               layer cache + janitor, capture buffers, the repository
slots                 the warm pool of network slots
local-gc              start-up sweep, then a collection per request
snapshot-operations   publishes and compactions after pauses; pauses persisting after they answered
sandboxes             the nursery every running sandbox is a task in
guest-network         the DNS forwarder and egress proxy the guests use (with egress)
templates             the default template kept built for the current kit
cut-pauses            pauses again what a crash cut in a pause (taken over from the data plane)
ttl                   pauses or kills sandboxes at their end
periodic-snapshots    a snapshot of every running sandbox per interval
repository-gc         collects the shared repository per interval
====================  ==========================================================

It returns the ``SandboxService`` the API serves (the API server goes last).
"""

from __future__ import annotations

from ..snapshot.operations import SnapshotOperations
from .guest_network import GuestNetwork
from .host import HostNetwork
from .housekeeping import LocalGc, RepositoryGc, RowExpiry
from .lifetimes import CutPauses, PeriodicSnapshots, TtlWheel
from .node import Node
from .parts import NodeParts
from .peers import install_peers
from .reconcile import Reconciler
from .registry import LiveSandboxes
from .sandboxes import SandboxService
from .slots import SlotService
from .storage import StorageService
from .templates import TemplateService

__all__ = ["install_sandbox_services"]


def install_sandbox_services(node: Node, *, build_default_template: bool = True) -> SandboxService:
    cfg = node.cfg
    parts = NodeParts.build(cfg, node.db, node.node_id)
    install_peers(node, parts)  # P2P layer ranges (p2p.enabled): the cache's peer source, the announcer
    registry = LiveSandboxes(parts)
    ops = SnapshotOperations(
        node.db, store=parts.store, gc=parts.gc, repository=parts.repository, buffers=parts.capture_buffers,
        launcher=registry, node_id=node.node_id, owner=parts.owner, vmm_name=parts.driver.name,
        default_timeout_s=cfg.sandbox.default_timeout_s, fork_max_count=cfg.sandbox.fork_max_count,
        compact_after_layers=cfg.snapshot.compact_after_layers, quiesce=cfg.snapshot.quiesce,
        publish_retry_s=cfg.snapshot.publish_retry_interval_s, answer_early=parts.dataplane is not None)
    templates = TemplateService(parts, build_default=build_default_template and cfg.templates.build_default)
    service = SandboxService(node, parts, registry, ops, templates)
    node.reconcilers.append(Reconciler(parts, ops))
    node.services.extend([
        HostNetwork(parts), StorageService(parts), SlotService(parts), LocalGc(parts), ops, registry,
        GuestNetwork(parts, registry), templates,
        CutPauses(service), TtlWheel(service), PeriodicSnapshots(service), RepositoryGc(parts), RowExpiry(parts),
    ])
    return service
