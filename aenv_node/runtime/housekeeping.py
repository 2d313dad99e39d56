"""Collections of what no longer serves: local snapshot and layer files, the shared repository, old rows.

Three services. ``LocalGc`` runs the garbage collector of this node's files
(``snapshot/gc.py``): its start-up pass before any sandbox runs, then a
collection per request (a pause, a kill, a compaction asks for one) and every
``snapshot.gc_interval_s``. ``RepositoryGc`` collects the shared repository
every ``storage.repository_gc_interval_s`` (0: never): snapshot manifests no
sandbox record reaches and layers no kept manifest names, older than
``storage.repository_gc_grace_s`` (storage/repository/gc.py). ``RowExpiry`` deletes the logs of sandboxes
that ended more than ``logs.retention_s`` ago (``state/sandbox_logs.py``) and the idempotency keys of creates
older than a day (``state/idempotency.py``), at start and every ``snapshot.gc_interval_s``.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading

import trio

from ..state import EventSubject, utcnow
from ..state.repository import record_event
from ..state.idempotency import KEY_TTL, expire_keys
from ..state.sandbox_logs import expire_ended
from ..storage.repository.gc import GcReport
from .parts import NodeParts

__all__ = ["LocalGc", "RepositoryGc", "RowExpiry"]

log = logging.getLogger(__name__)


class LocalGc:
    name = "local-gc"

    def __init__(self, parts: NodeParts) -> None:
        self.parts = parts

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        await self.parts.gc.startup()
        task_status.started()
        await self.parts.gc.run()


class RepositoryGc:
    name = "repository-gc"

    def __init__(self, parts: NodeParts) -> None:
        self.parts = parts

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        st = self.parts.cfg.storage
        if st.repository_gc_interval_s <= 0:
            return
        while True:
            await trio.sleep(st.repository_gc_interval_s)
            try:
                report, incomplete = await self.collect_once()
            except Exception as exc:  # an unreachable repository: try again next interval
                log.warning("repository garbage collection failed: %s", exc)
                continue
            log.info("repository gc: removed %d manifests and %d layers (%.1f MiB) and %d cut uploads in %.1f s; "
                     "kept %d manifests, %d layers", len(report.manifests_removed), len(report.layers_removed),
                     report.bytes_removed / 2**20, incomplete, report.duration_s, report.manifests_kept,
                     report.layers_kept)
            await self.parts.db.run(lambda s: record_event(
                s, "repository_gc", subject=EventSubject.NODE, subject_id=self.parts.node_id,
                duration_ms=report.duration_s * 1000, detail={**report.summary(), "incomplete_removed": incomplete}))

    async def collect_once(self) -> tuple[GcReport, int]:
        """One collection in a thread this task owns: a cancellation (shutdown) asks it to stop between two
        deletions and waits for it. Then the leftovers of uploads a crash cut (on any node: temporary files,
        pending multipart uploads) older than the same grace, which a publish completes within; returns the
        report and how many of those went."""
        stop = threading.Event()
        grace = self.parts.cfg.storage.repository_gc_grace_s

        async def stop_on_cancel() -> None:
            try:
                await trio.sleep_forever()
            finally:
                stop.set()

        async with trio.open_nursery() as n:
            n.start_soon(stop_on_cancel)
            report = await trio.to_thread.run_sync(
                lambda: self.parts.repository.collect_garbage(grace, stop=stop))
            n.cancel_scope.cancel()
        incomplete = await trio.to_thread.run_sync(self.parts.repository.sweep_incomplete, grace)
        return report, incomplete


class RowExpiry:
    name = "row-expiry"

    def __init__(self, parts: NodeParts) -> None:
        self.parts = parts

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            try:
                await self.expire_once()
            except Exception:
                log.exception("expiring old sandbox logs and idempotency keys failed; retrying later")
            await trio.sleep(self.parts.cfg.snapshot.gc_interval_s)

    async def expire_once(self) -> tuple[int, int]:
        """Delete the logs of sandboxes that ended over ``logs.retention_s`` ago and the idempotency keys older
        than ``KEY_TTL``; returns (log lines, keys)."""
        now = utcnow()
        before = now - dt.timedelta(seconds=self.parts.cfg.logs.retention_s)
        lines = await self.parts.db.run(expire_ended, before)
        keys = await self.parts.db.run(expire_keys, now - KEY_TTL)
        if lines or keys:
            log.info("expired %d log lines of sandboxes that ended before %s and %d idempotency keys", lines,
                     before.isoformat(), keys)
        return lines, keys
