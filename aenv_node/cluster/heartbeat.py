"""A node's heartbeat to the scheduler (``cluster.scheduler_url``): a node service that says every
``cluster.heartbeat_interval_s`` who the node is, where its API is, what it has and holds, which templates it
has warm, and whether it takes new sandboxes.

The figures come from the node's own state (the ``sandboxes`` table: running sandboxes hold their vCPUs and
memory, paused ones none) and from the host (CPUs, memory, the state disk's free space), read at each beat so
that a node that grew shows it. A scheduler that does not answer is retried at the next beat; the node goes on
serving what is bound to it meanwhile. When the node begins to shut down it says once more, at once, that it
drains, so that no placement picks it while it pauses its sandboxes.
"""

from __future__ import annotations

import logging
import os
import shutil

import httpx
import trio
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from .. import __version__
from ..runtime import Node
from ..state import BuildStatus, SandboxState
from ..state import Sandbox as SandboxRow
from ..state import Template as TemplateRow
from .models import NodeCapacity, NodeLoad, NodeStatus, NodeView

__all__ = ["HeartbeatSender", "host_memory_mb"]

log = logging.getLogger(__name__)

#: states in which a sandbox holds its vCPUs and memory on the node
_HOLDING = (SandboxState.CREATING, SandboxState.RUNNING, SandboxState.PAUSING, SandboxState.RESUMING,
            SandboxState.SNAPSHOTTING, SandboxState.FORKING)


def host_memory_mb() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    raise RuntimeError("/proc/meminfo has no MemTotal")


class HeartbeatSender:
    name = "heartbeat"

    def __init__(self, node: Node, *, slot_capacity: int) -> None:
        self.node = node
        cfg = node.cfg
        self.url = cfg.cluster.scheduler_url.rstrip("/") + f"/v1/nodes/{node.node_id}"
        self.advertise = cfg.cluster.advertise_url or f"http://{cfg.api.listen}"
        self.interval = cfg.cluster.heartbeat_interval_s
        self.slot_capacity = slot_capacity
        #: beats the scheduler took, and the last error (for the node's logs and tests)
        self.sent = 0
        self.last_error: str | None = None

    def _figures(self, s: Session) -> tuple[NodeLoad, list[str]]:
        held = s.execute(select(func.count(), func.coalesce(func.sum(SandboxRow.cpu_count), 0),
                                func.coalesce(func.sum(SandboxRow.memory_mb), 0))
                         .where(SandboxRow.state.in_(_HOLDING))).one()
        paused = s.scalar(select(func.count()).select_from(SandboxRow)
                          .where(SandboxRow.state == SandboxState.PAUSED)) or 0
        templates: list[str] = []
        for tid, alias in s.execute(select(TemplateRow.id, TemplateRow.alias)
                                    .where(TemplateRow.status == BuildStatus.READY)):
            templates.append(tid)
            if alias:
                templates.append(alias)
        return NodeLoad(running=held[0], paused=paused, vcpus=int(held[1]), memory_mb=int(held[2])), templates

    async def status(self, *, draining: bool = False) -> NodeStatus:
        load, templates = await self.node.db.run(self._figures)
        disk = shutil.disk_usage(self.node.cfg.state_dir)
        capacity = NodeCapacity(vcpus=os.cpu_count() or 1, memory_mb=host_memory_mb(),
                                disk_free_mb=disk.free // (1024 * 1024),
                                slots_free=max(0, self.slot_capacity - load.running))
        return NodeStatus(node_id=self.node.node_id, url=self.advertise, software=__version__,
                          capacity=capacity, load=load, templates=templates[:10_000],
                          draining=draining or self.node.tracker.draining)

    async def beat(self, client: httpx.AsyncClient, *, draining: bool = False) -> bool:
        """Send one heartbeat; whether the scheduler took it."""
        try:
            status = await self.status(draining=draining)
            r = await client.put(self.url, content=status.model_dump_json(),
                                 headers={"X-API-KEY": self.node.api_key, "Content-Type": "application/json"})
        except (httpx.HTTPError, OSError) as exc:
            self._failed(f"{type(exc).__name__}: {exc}")
            return False
        if r.status_code != 204:
            self._failed(f"{r.status_code} {r.text[:200]}")
            return False
        if self.last_error is not None:
            log.info("heartbeats reach the scheduler again")
        self.sent += 1
        self.last_error = None
        return True

    async def owner_is_dead(self, owner: str) -> bool:
        """For ``SnapshotOperations.owner_dead``: whether the node an ownership record names (``<node id>/<tag>``)
        is dead to the scheduler: known to it, and without a heartbeat for its TTL. A node the scheduler does not
        know, or a scheduler that does not answer, is not: a take-over must never race a node that lives."""
        node_id = owner.split("/", 1)[0]
        if node_id == self.node.node_id:
            return False
        nodes_url = self.url.rsplit("/", 1)[0]
        try:
            async with httpx.AsyncClient(timeout=5) as client:
                r = await client.get(nodes_url, headers={"X-API-KEY": self.node.api_key})
        except (httpx.HTTPError, OSError) as exc:
            log.warning("asking the scheduler whether node %s is dead failed: %s", node_id, exc)
            return False
        if r.status_code != 200:
            log.warning("asking the scheduler whether node %s is dead failed: %s %s", node_id, r.status_code,
                        r.text[:200])
            return False
        for item in r.json():
            view = NodeView.model_validate(item)
            if view.status.node_id == node_id:
                return not view.alive
        return False

    def _failed(self, error: str) -> None:
        if error != self.last_error:
            log.warning("heartbeat to %s failed: %s", self.url, error)
        self.last_error = error

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with httpx.AsyncClient(timeout=5) as client:
            await self.beat(client)
            task_status.started()
            try:
                while not self.node.shutdown.is_set():
                    with trio.move_on_after(self.interval):
                        await self.node.shutdown.wait()
                    if not self.node.shutdown.is_set():
                        await self.beat(client)
            finally:
                if self.node.shutdown.is_set():
                    # shielded, and also when the stop cancels a beat in flight: a node with nothing to drain
                    # stops this service right away, and the scheduler must hear that it drains before it places
                    # anything more here (bounded: a scheduler that hangs is no reason to hold the shutdown)
                    with trio.CancelScope(shield=True), trio.move_on_after(5):
                        await self.beat(client, draining=True)
            # the node drains (pauses, publishes); keep saying so until it stops serving
            while not self.node.drained.is_set():
                with trio.move_on_after(self.interval):
                    await self.node.drained.wait()
                await self.beat(client, draining=True)
