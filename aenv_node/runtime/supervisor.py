"""The node supervisor: the root of the Trio task tree.

::

    run_node
    └── nursery (node)
        ├── signal watcher            SIGTERM / SIGINT -> graceful shutdown
        ├── services, in order        API server, TTL timer wheel, cache janitor,
        │                             pool refillers, metrics sampler, ...
        └── (each sandbox's nursery is owned by the sandbox manager service)

Start: migrate the database, record the node as running, run the reconcilers
(reality and the database agree before anything is served), then start the
services one by one (``nursery.start`` waits until each is ready).

Shutdown (SIGTERM/SIGINT, or ``Node.request_shutdown``): stop admitting new
operations, let in-flight ones finish for up to ``node.shutdown_grace_s``
(each commits its outcome or rolls back in shielded cleanup), then cancel the
nursery and record the node as stopped. A second signal cancels at once.
"""

from __future__ import annotations

import logging
import signal
from typing import Callable

import trio

from .node import Node

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


async def run_node(
    node: Node,
    *,
    handle_signals: bool = True,
    task_status: trio.TaskStatus[Node] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the node until shutdown is requested; returns when everything stopped."""
    await trio.to_thread.run_sync(node.db.upgrade)
    await node.register()
    await node.reconcile()
    error: str | None = None
    try:
        async with trio.open_nursery() as nursery:
            if handle_signals:
                nursery.start_soon(_watch_signals, node.shutdown, nursery.cancel_scope.cancel)
            for service in node.services:
                log.debug("starting service %s", service.name)
                await nursery.start(service.run)
            task_status.started(node)
            await node.shutdown.wait()
            node.tracker.start_draining()
            with trio.move_on_after(node.cfg.node.shutdown_grace_s) as grace:
                await node.tracker.wait_idle()
            if grace.cancelled_caught:
                error = f"shutdown grace expired with operations in flight: {node.tracker.active}"
                log.warning("%s", error)
            nursery.cancel_scope.cancel()
    except BaseException as exc:
        error = error or f"{type(exc).__name__}: {exc}"
        raise
    finally:
        with trio.CancelScope(shield=True):
            await node.unregister(error=error)
            node.db.close()
