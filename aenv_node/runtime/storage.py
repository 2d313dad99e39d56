"""The node's storage service: the layer cache (opened here, janitor running), the capture buffers (warmed
here), and the shared repository (closed here when the node stops, after every sandbox is gone)."""

from __future__ import annotations

import logging

import trio

from ..storage.cache import LayerCache, run_janitor
from ..storage.cache_store import CacheStore
from .parts import NodeParts

__all__ = ["StorageService"]

log = logging.getLogger(__name__)


class StorageService:
    name = "storage"

    def __init__(self, parts: NodeParts) -> None:
        self.parts = parts

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        p = self.parts
        st = p.cfg.storage
        try:
            cache = await trio.to_thread.run_sync(lambda: LayerCache(
                p.cfg.cache_dir, p.repository, capacity_bytes=st.cache_capacity_bytes,
                high_watermark=st.cache_high_watermark, low_watermark=st.cache_low_watermark,
                store=CacheStore(p.db), peers=p.peers))
            p.cache = p.store.cache = cache
            async with trio.open_nursery() as nursery:
                nursery.start_soon(run_janitor, cache)
                nursery.start_soon(self._warm_capture_buffers)
                task_status.started()
                await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True):
                if p.cache is not None:
                    await trio.to_thread.run_sync(p.cache.close)
                p.cache = p.store.cache = None
                if p.peers is not None:
                    p.peers.source.close()
                await trio.to_thread.run_sync(p.repository.close)
                p.capture_buffers.close()

    async def _warm_capture_buffers(self) -> None:
        try:
            await self.parts.capture_buffers.warm()
        except (OSError, MemoryError) as exc:  # captures then take the slower path
            log.warning("could not make the capture buffers (%s): live captures will write files", exc)
