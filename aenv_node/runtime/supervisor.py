"""The node supervisor: the root of the Trio task tree.

::

    run_node
    └── nursery (node)
        ├── signal watcher            SIGTERM / SIGINT -> graceful shutdown
        └── one cancel scope per service, in start order (runtime/assemble.py):
            host-network, storage, slots, local-gc, snapshot-operations,
            sandboxes (a task per running sandbox), templates, ttl,
            periodic-snapshots, repository-gc, api

Start: migrate the database, record the node as running, run the reconcilers
(reality and the database agree before anything is served), then start the
services one by one (``nursery.start`` waits until each is ready).

Shutdown (SIGTERM/SIGINT, or ``Node.request_shutdown``): stop admitting new
operations, let in-flight ones finish for up to ``node.shutdown_grace_s``
(each commits its outcome or rolls back in shielded cleanup), run the node's
drainers (every running sandbox is paused and published: a stop never kills
a sandbox, and a resume that completed just before it is kept; the API keeps
answering meanwhile, 503 for new operations), then stop the
services one at a time in reverse start order, each fully before the next
(the API before the sandboxes, the sandboxes before the slot pool and the
cache they use), and record the node as stopped. A second signal cancels
everything at once.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import time
from dataclasses import dataclass, field
from typing import Callable

import trio

from .node import Node, Service

__all__ = ["run_node"]

log = logging.getLogger(__name__)


async def _watch_signals(shutdown: trio.Event, cancel_now: Callable[[], None]) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            if shutdown.is_set():
                log.warning("second %s: cancelling now", signal.Signals(signum).name)
                cancel_now()
                return
            log.info("%s: shutting down gracefully", signal.Signals(signum).name)
            shutdown.set()


@dataclass
class _Running:
    """A started service: its own cancel scope, and an event set once it has fully stopped."""

    service: Service
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    stopped: trio.Event = field(default_factory=trio.Event)

    async def stop(self) -> None:
        self.scope.cancel()
        await self.stopped.wait()


async def _host(service: Service, *, task_status: trio.TaskStatus[_Running]) -> None:
    running = _Running(service)
    try:
        with running.scope:
            async with trio.open_nursery() as nursery:
                await nursery.start(service.run)
                task_status.started(running)
    finally:
        running.stopped.set()


async def run_node(
    node: Node,
    *,
    handle_signals: bool = True,
    task_status: trio.TaskStatus[Node] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the node until shutdown is requested; returns when everything stopped.

    Once every service runs it logs how long each start phase took (migrations, reconcile, each service's
    start): a restart of a node holding thousands of sandboxes is read from that line
    (``bench/fleet_state.py``)."""
    t0 = time.monotonic()
    await trio.to_thread.run_sync(node.db.upgrade)
    t_migrated = time.monotonic()
    await node.register()
    await node.reconcile()
    t_reconciled = time.monotonic()
    service_s: dict[str, float] = {}
    error: str | None = None
    try:
        async with trio.open_nursery() as nursery:
            if handle_signals:
                nursery.start_soon(_watch_signals, node.shutdown, nursery.cancel_scope.cancel)
            started: list[_Running] = []
            for service in node.services:
                log.debug("starting service %s", service.name)
                t_service = time.monotonic()
                started.append(await nursery.start(_host, service))
                service_s[service.name] = time.monotonic() - t_service
            slowest = sorted(service_s.items(), key=lambda kv: -kv[1])[:3]
            log.info("node started in %.3f s: migrations %.3f s, reconcile %.3f s, services %.3f s (slowest: %s)",
                     time.monotonic() - t0, t_migrated - t0, t_reconciled - t_migrated,
                     sum(service_s.values()), ", ".join(f"{n} {v:.3f} s" for n, v in slowest))
            task_status.started(node)
            await node.shutdown.wait()
            node.tracker.start_draining()
            with trio.move_on_after(node.cfg.node.shutdown_grace_s) as grace:
                await node.tracker.wait_idle()
            if grace.cancelled_caught:
                error = f"shutdown grace expired with operations in flight: {node.tracker.active}"
                log.warning("%s", error)
            for drain in node.drainers:
                await drain()
            node.drained.set()
            for running in reversed(started):
                log.debug("stopping service %s", running.service.name)
                await running.stop()
            nursery.cancel_scope.cancel()
    except BaseException as exc:
        error = error or f"{type(exc).__name__}: {exc}"
        raise
    finally:
        with trio.CancelScope(shield=True):
            await node.unregister(error=error)
            node.db.close()
        # the node's directory under /run, if nothing is left in it (a data plane that runs on keeps its socket
        # there, and removes the directory when it stops)
        with contextlib.suppress(OSError):
            node.cfg.run_dir.rmdir()
