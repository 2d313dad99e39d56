"""Sandbox lifetimes: the TTL wheel, periodic snapshots, and pauses a crash cut.

``TtlWheel`` ends every running sandbox whose ``end_at`` passed: paused
(autoPause, the default) or killed. ``PeriodicSnapshots`` snapshots every
running sandbox each ``snapshot.periodic_interval_s`` (0: off), keeping only
its newest periodic snapshot: after a node crash the reconciler turns a
sandbox that has one into a paused sandbox at that snapshot instead of a
killed one, so long trajectories lose at most one interval. On a node of a
cluster each periodic snapshot is also published to the repository as the
sandbox's checkpoint, so that another node resumes it from there if this one
dies for good;
a checkpoint that finds the sandbox taken over (this node was thought dead)
kills this copy.
"""

from __future__ import annotations

import logging

import trio
from sqlalchemy import select
from sqlalchemy.orm import Session

from ..snapshot.errors import SandboxMovedAway
from ..state import Sandbox, SandboxState, utcnow
from .sandboxes import SandboxService

__all__ = ["CutPauses", "TtlWheel", "PeriodicSnapshots"]

log = logging.getLogger(__name__)


class CutPauses:
    """At start, pause again each sandbox whose pause the previous run's crash cut (``NodeParts.cut_pauses``).

    With a data plane a pause answers once the guest is captured, before it is persisted
    (snapshot/operations.py): a control-plane crash in between leaves the VMM paused in the data plane and
    the row pausing with nothing committed. The reconciler takes such a sandbox over (its vCPUs resumed,
    its filesystem thawed: a running sandbox like any other); here it is paused again, before the node
    serves, so no caller sees it run. A cut pause that had not answered yet is finished too: its caller got
    an error, and a sandbox the API showed as paused ends paused."""

    name = "cut-pauses"

    def __init__(self, sandboxes: SandboxService) -> None:
        self.sandboxes = sandboxes

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        cut, self.sandboxes.parts.cut_pauses = self.sandboxes.parts.cut_pauses, []
        for sid in cut:
            if self.sandboxes.registry.get(sid) is None:
                continue  # its take-over failed: the registry recorded its end
            try:
                await self.sandboxes.pause(sid, reason="reconcile")
                log.info("paused %s again: the previous run's crash cut its pause", sid)
            except Exception as exc:  # it runs on, with the failure in its events
                log.warning("pausing %s again after the crash that cut its pause failed: %s", sid, exc)
        task_status.started()


class TtlWheel:
    name = "ttl"

    def __init__(self, sandboxes: SandboxService) -> None:
        self.sandboxes = sandboxes
        self._expiring: set[str] = set()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        interval = self.sandboxes.cfg.sandbox.ttl_check_interval_s
        async with trio.open_nursery() as nursery:
            task_status.started()
            while True:
                await trio.sleep(interval)
                now = utcnow()

                def expired(s: Session) -> list[tuple[str, bool]]:
                    return [(sid, auto) for sid, auto in s.execute(select(Sandbox.id, Sandbox.auto_pause).where(
                        Sandbox.state == SandboxState.RUNNING, Sandbox.end_at <= now)).all()]

                for sid, auto_pause in await self.sandboxes.db.run(expired):
                    if self.sandboxes.registry.get(sid) is not None and sid not in self._expiring:
                        self._expiring.add(sid)
                        log.info("sandbox %s reached its end: %s", sid, "pausing" if auto_pause else "killing")
                        nursery.start_soon(self._expire, sid, auto_pause)

    async def _expire(self, sid: str, auto_pause: bool) -> None:
        try:
            if auto_pause:
                await self.sandboxes.pause(sid, reason="timeout")
            else:
                await self.sandboxes.kill(sid, reason="timeout")
        except Exception as exc:  # the sandbox may have gone meanwhile
            log.info("end of %s: %s", sid, exc)
        finally:
            self._expiring.discard(sid)


class PeriodicSnapshots:
    name = "periodic-snapshots"

    def __init__(self, sandboxes: SandboxService) -> None:
        self.sandboxes = sandboxes

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        interval = self.sandboxes.cfg.snapshot.periodic_interval_s
        if interval <= 0:
            return
        while True:
            await trio.sleep(interval)
            for sid, handle in list(self.sandboxes.registry.live.items()):
                if handle.op_lock.locked() or handle.done.is_set():
                    continue
                try:
                    await self.sandboxes.periodic_snapshot(handle)
                except SandboxMovedAway as exc:
                    # another node resumed it from its checkpoint while this one was thought dead (a partition):
                    # two copies must not run; the record is the other node's, and the kill leaves it alone
                    log.error("%s", exc)
                    await self.sandboxes.kill(sid, reason="moved_away")
                except Exception as exc:
                    log.warning("periodic snapshot of %s failed: %s", sid, exc)
