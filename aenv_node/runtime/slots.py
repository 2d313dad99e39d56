"""The warm pool of network slots, with slot indexes persisted in ``network_slots``.

A restarted node must know which slot addresses it held (the reconciler
removes what is left of them), so every index the pool takes is a row first.
"""

from __future__ import annotations

import logging

import trio
from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from ..net import NetworkConfig, PoolExhausted, SlotPool
from ..state import Database, NetworkSlot, SlotState
from .parts import NodeParts

__all__ = ["DbIndexAllocator", "SlotService"]

log = logging.getLogger(__name__)


class DbIndexAllocator:
    """Slot indexes persisted in ``network_slots`` so a restarted node knows what it held."""

    def __init__(self, db: Database, netcfg: NetworkConfig) -> None:
        self.db = db
        self.netcfg = netcfg
        # the pool's refiller and acquire() may allocate at once: read-then-insert must not interleave
        self._lock = trio.Lock()

    async def allocate(self) -> int:
        async with self._lock:
            return await self.db.run(self._allocate)

    def _allocate(self, s: Session) -> int:
        used = set(s.scalars(select(NetworkSlot.slot_index)))
        for i in range(self.netcfg.capacity):
            if i not in used:
                sl = self.netcfg.slot(i)
                s.add(NetworkSlot(slot_index=i, netns=sl.netns, host_ip=sl.host_ip, slot_ip=sl.ns_ip,
                                  state=SlotState.WARM))
                return i
        raise PoolExhausted(f"all {self.netcfg.capacity} network slots are in use")

    async def free(self, index: int) -> None:
        await self.db.run(lambda s: s.execute(delete(NetworkSlot).where(NetworkSlot.slot_index == index)))


class SlotService:
    name = "slots"

    def __init__(self, parts: NodeParts) -> None:
        self.parts = parts

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        p = self.parts
        async with SlotPool(p.netcfg, DbIndexAllocator(p.db, p.netcfg), size=p.cfg.net.warm_slots) as pool:
            p.pool = pool
            try:
                task_status.started()
                await self._keep_filled(pool)
            finally:
                p.pool = None

    async def _keep_filled(self, pool: SlotPool) -> None:
        """The pool's refiller; an unexpected error is logged and the refiller restarted, never allowed to
        take down the node (and every sandbox with it)."""
        while True:
            try:
                await pool.run()
                await trio.sleep_forever()
            except Exception:
                log.exception("the network slot refiller failed; restarting it")
                await trio.sleep(1)
