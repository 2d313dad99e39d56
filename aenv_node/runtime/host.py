"""The host side of the node's networking: checked and set up before any slot exists, torn down last.

The node owns a range of addresses (``net.pool_cidr``) and host-wide tables
(NAT, isolation rules). Before it sets them up it refuses to start when
anything else already routes part of that range (another node on this host
would get this node's guest traffic); KSM is switched on here when configured.
"""

from __future__ import annotations

import ipaddress
import json
import logging
from pathlib import Path

import trio

from ..dataplane import DataPlaneError
from ..net import ensure_host_networking, teardown_host_networking
from .errors import PoolInUse
from .parts import NodeParts

__all__ = ["HostNetwork"]

log = logging.getLogger(__name__)


class HostNetwork:
    name = "host-network"

    def __init__(self, parts: NodeParts) -> None:
        self.parts = parts

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        if self.parts.cfg.vmm.ksm:
            await trio.to_thread.run_sync(Path("/sys/kernel/mm/ksm/run").write_text, "1")
        await self._check_pool_is_free()
        await ensure_host_networking(self.parts.netcfg)
        try:
            task_status.started()
            await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True):
                running = await self._left_running()
                if running:
                    # sandboxes left running in the data plane (a stop, an upgrade): their isolation and
                    # egress rules stay, or until the next start they could reach the host and each other
                    log.info("host networking kept: %d VMMs run on in the data plane", running)
                else:
                    await teardown_host_networking(self.parts.netcfg)

    async def _left_running(self) -> int:
        """How many VMMs the data plane still runs (0 without one, or when it does not answer)."""
        if self.parts.dataplane is None:
            return 0
        try:
            return len(await self.parts.dataplane.children())
        except DataPlaneError:
            return 0

    async def _check_pool_is_free(self) -> None:
        """Refuse to start when another node (or anything else) routes part of our slot range: the
        host would send this node's guest traffic into the other's namespaces."""
        out = await trio.run_process(["ip", "-j", "-4", "route", "show"], capture_stdout=True)
        pool = self.parts.netcfg.pool
        ours = self.parts.netcfg.host_veth_prefix
        for route in json.loads(out.stdout or b"[]"):
            dst = route.get("dst", "")
            if dst in ("", "default"):
                continue
            try:
                net = ipaddress.ip_network(dst, strict=False)
            except ValueError:
                continue
            if net.overlaps(pool) and not str(route.get("dev", "")).startswith(ours):
                raise PoolInUse(
                    f"net.pool_cidr {pool} overlaps {dst} (dev {route.get('dev')}), already routed on this "
                    "host (another node?): give this node its own pool_cidr")
