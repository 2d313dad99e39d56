"""The node: what every part of the running server shares.

A ``Node`` holds the effective configuration, the database, the API key, the
in-flight operation tracker and the services the supervisor runs. The API
layer gets one ``Node`` and asks it for everything; it never reaches into the
layers below on its own.
"""

from __future__ import annotations

import logging
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Awaitable, Callable, Protocol

import trio
from sqlalchemy.orm import Session

from .. import __version__
from ..config import Config
from ..state import Database, EventSubject, NodeState, utcnow
from ..state import Node as NodeRow
from ..state.repository import record_event
from .api_key import ApiKeyWatcher
from .operations import OperationTracker

__all__ = ["Node", "Service", "Reconciler", "node_id_for"]

log = logging.getLogger(__name__)


class Service(Protocol):
    """A long-running part of the node, started in the supervisor's nursery."""

    name: str

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None: ...


#: A reconciler brings reality and the database into agreement at start.
Reconciler = Callable[["Node"], Awaitable[None]]


def node_id_for(cfg: Config) -> str:
    return cfg.node.node_id or socket.gethostname()


@dataclass
class Node:
    cfg: Config
    db: Database
    api_key: str
    api_key_path: Path | None = None
    node_id: str = ""
    tracker: OperationTracker = field(default_factory=OperationTracker)
    services: list[Service] = field(default_factory=list)
    reconcilers: list[Reconciler] = field(default_factory=list)
    #: run by a graceful shutdown once in-flight operations are done and before any service stops (the
    #: sandbox service pauses every running sandbox here: a stop never kills one)
    drainers: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    started_at: float = field(default_factory=time.time)
    version: str = __version__
    #: Set to begin a graceful shutdown (the supervisor waits on it).
    shutdown: trio.Event = field(default_factory=trio.Event)
    #: Set once a shutdown has drained (in-flight operations done, drainers run). The API server stops
    #: accepting only then, so a request that arrives while the node drains gets a 503, not a refused
    #: connection.
    drained: trio.Event = field(default_factory=trio.Event)

    def __post_init__(self) -> None:
        if not self.node_id:
            self.node_id = node_id_for(self.cfg)
        if self.api_key_path is not None:  # a key from a file can be rotated under the running node
            self.services.append(ApiKeyWatcher(self, self.api_key_path))

    def request_shutdown(self) -> None:
        self.shutdown.set()

    async def register(self) -> None:
        """Record this node as running (one row per node id) with its event."""

        def work(s: Session) -> None:
            row = s.get(NodeRow, self.node_id)
            now = utcnow()
            if row is None:
                row = NodeRow(id=self.node_id, hostname=socket.gethostname(),
                              listen=self.cfg.api.listen, version=self.version)
                s.add(row)
            prev = row.state if row.state else None
            row.listen = self.cfg.api.listen
            row.version = self.version
            row.state = NodeState.RUNNING
            row.started_at = now
            row.stopped_at = None
            record_event(s, "node_start", subject=EventSubject.NODE, subject_id=self.node_id,
                         from_state=prev, to_state=NodeState.RUNNING)

        await self.db.run(work)

    async def unregister(self, *, error: str | None = None) -> None:
        def work(s: Session) -> None:
            row = s.get(NodeRow, self.node_id)
            if row is None:
                return
            prev = row.state
            row.state = NodeState.STOPPED
            row.stopped_at = utcnow()
            record_event(s, "node_stop", subject=EventSubject.NODE, subject_id=self.node_id,
                         from_state=prev, to_state=NodeState.STOPPED, error=error)

        await self.db.run(work)

    async def reconcile(self) -> None:
        for reconciler in self.reconcilers:
            await reconciler(self)
