"""The node's network services for its guests: the DNS forwarder and the egress proxy (``net.dns``,
``net.egress_proxy``), run while the node runs, with the policies of the sandboxes it runs.

Both exist only with ``net.egress`` on (without egress nothing leaves the machine, DNS included) and their
port set. The host table sends them what they serve from the node's first start on; a sandbox whose policy
the node does not know yet (while it starts and takes over sandboxes the previous run left running) gets
no answer, and its guest's resolver or client retries.
"""

from __future__ import annotations

import logging

import trio

from ..net import DnsForwarder, EgressProxy, Resolver, host_nameservers
from .parts import NodeParts
from .registry import LiveSandboxes

__all__ = ["GuestNetwork"]

log = logging.getLogger(__name__)


class GuestNetwork:
    name = "guest-network"

    def __init__(self, parts: NodeParts, registry: LiveSandboxes) -> None:
        self.parts = parts
        self.registry = registry
        upstreams = list(parts.cfg.net.dns_upstreams) or host_nameservers()
        self.resolver = Resolver(upstreams)
        netcfg = parts.netcfg
        self.forwarder = (DnsForwarder(netcfg, self.resolver, self._serves, port=netcfg.dns_port)
                          if netcfg.dns_port is not None else None)
        self.proxy = (EgressProxy(netcfg, self.resolver, registry.policy_of_slot, port=netcfg.proxy_port)
                      if netcfg.proxy_port is not None else None)

    def _serves(self, index: int) -> bool:
        policy = self.registry.policy_of_slot(index)
        return policy is not None and (policy.internet or bool(policy.domains))

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            if self.forwarder is not None:
                if not self.resolver.upstreams:
                    log.warning("no DNS upstream (net.dns_upstreams empty, none in /etc/resolv.conf): guests "
                                "get SERVFAIL for every name")
                port = await nursery.start(self.forwarder.run)
                log.info("guest DNS on port %d, forwarded to %s", port,
                         ", ".join(f"{h}:{p}" for h, p in self.resolver.upstreams) or "nobody")
            if self.proxy is not None:
                port = await nursery.start(self.proxy.run)
                log.info("egress proxy (allowOut domain names) on port %d", port)
            task_status.started()
