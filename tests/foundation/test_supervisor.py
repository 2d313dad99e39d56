"""The node supervisor: start order, graceful shutdown, cancellation, signals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import trio
from sqlalchemy import select

from aenv_node.runtime import Node, NodeDraining, run_node
from aenv_node.state import Database, Event, Node as NodeRow, Sandbox, SandboxState
from aenv_node.state import repository as repo

from ..conftest import free_pool_cidr, free_port


def _node(cfg) -> Node:
    return Node(cfg, Database(cfg.database_path), "key")


class Recorder:
    """A service that records when it starts and stops (its cleanup taking ``stop_s``)."""

    def __init__(self, name: str, log: list[str], stop_s: float = 0.0) -> None:
        self.name = name
        self.log = log
        self.stop_s = stop_s

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        self.log.append(f"start {self.name}")
        task_status.started()
        try:
            await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True):
                await trio.sleep(self.stop_s)
            self.log.append(f"stop {self.name}")


def _node_events(db: Database) -> list[tuple[str, str | None]]:
    with db.session() as s:
        return [(e.operation, e.error) for e in s.scalars(select(Event).where(Event.subject == "node"))]


async def test_reconcilers_run_before_services_and_shutdown_stops_all(node_config) -> None:
    node = _node(node_config)
    log: list[str] = []

    async def reconciler(n: Node) -> None:
        log.append("reconcile")

    node.reconcilers.append(reconciler)
    node.services += [Recorder("a", log), Recorder("b", log)]
    async with trio.open_nursery() as nursery:
        await nursery.start(lambda task_status: run_node(node, handle_signals=False, task_status=task_status))
        assert log == ["reconcile", "start a", "start b"]
        node_config.run_dir.mkdir(parents=True, exist_ok=True)  # (what a sandbox's start makes)
        node.request_shutdown()
    assert sorted(log[3:]) == ["stop a", "stop b"]
    assert not node_config.run_dir.exists()  # the node's directory under /run went with it: it was empty
    db = Database(node_config.database_path)
    with db.session() as s:
        assert s.get(NodeRow, node.node_id).state == "stopped"
    assert _node_events(db) == [("node_start", None), ("node_stop", None)]


async def test_services_stop_one_at_a_time_in_reverse_start_order(node_config) -> None:
    """A service is stopped only once every service started after it has fully stopped: the sandboxes end
    before the slot pool and the cache they use close, even when their cleanup takes time (0.2 s here)."""
    node = _node(node_config)
    log: list[str] = []
    node.services += [Recorder("pool", log), Recorder("sandboxes", log, stop_s=0.2), Recorder("api", log)]
    async with trio.open_nursery() as nursery:
        await nursery.start(lambda task_status: run_node(node, handle_signals=False, task_status=task_status))
        node.request_shutdown()
    assert log == ["start pool", "start sandboxes", "start api", "stop api", "stop sandboxes", "stop pool"]


async def test_in_flight_operation_finishes_and_new_ones_are_refused(node_config) -> None:
    node = _node(node_config)
    finished = trio.Event()
    refused: list[bool] = []

    async def operation() -> None:
        async with node.tracker.operation("create"):
            await trio.sleep(0.3)
            with node.db.session() as s:
                repo.insert_sandbox(s, Sandbox(id="sb-op", template_id="base"))
                repo.transition(s, "sb-op", SandboxState.RUNNING, operation="create")
            finished.set()

    async with trio.open_nursery() as nursery:
        await nursery.start(lambda task_status: run_node(node, handle_signals=False, task_status=task_status))
        nursery.start_soon(operation)
        await trio.sleep(0.05)
        node.request_shutdown()
        await trio.sleep(0.05)
        try:
            async with node.tracker.operation("late"):
                refused.append(False)
        except NodeDraining:
            refused.append(True)
    assert finished.is_set() and refused == [True]
    db = Database(node_config.database_path)
    with db.session() as s:
        assert s.get(Sandbox, "sb-op").state == "running"


async def test_grace_expiry_cancels_and_rollback_leaves_truthful_state(node_config) -> None:
    cfg = node_config.__class__(**{**node_config.__dict__,
                                   "node": node_config.node.__class__(
                                       **{**node_config.node.__dict__, "shutdown_grace_s": 0.2})})
    node = _node(cfg)

    async def stuck_operation() -> None:
        with node.db.session() as s:
            repo.insert_sandbox(s, Sandbox(id="sb-stuck", template_id="base"))
        async with node.tracker.operation("create"):
            try:
                await trio.sleep_forever()
            finally:
                with trio.CancelScope(shield=True):
                    with node.db.session() as s:
                        repo.transition(s, "sb-stuck", SandboxState.ERROR, operation="create",
                                        error="cancelled by shutdown")

    async with trio.open_nursery() as outer:
        node.services.append(_OperationService(stuck_operation))
        await outer.start(lambda task_status: run_node(node, handle_signals=False, task_status=task_status))
        await trio.sleep(0.05)
        node.request_shutdown()
    db = Database(cfg.database_path)
    with db.session() as s:
        assert s.get(Sandbox, "sb-stuck").state == "error"
    ops = _node_events(db)
    assert ops[-1][0] == "node_stop" and "grace expired" in (ops[-1][1] or "")


class _OperationService:
    name = "op"

    def __init__(self, fn) -> None:
        self.fn = fn

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        await self.fn()


async def test_outer_cancellation_still_records_stop(node_config) -> None:
    node = _node(node_config)
    async with trio.open_nursery() as nursery:
        await nursery.start(lambda task_status: run_node(node, handle_signals=False, task_status=task_status))
        nursery.cancel_scope.cancel()  # not a shutdown request: a cancellation from outside
    db = Database(node_config.database_path)
    with db.session() as s:
        assert s.get(NodeRow, node.node_id).state == "stopped"


def _serve(state_dir: Path, port: int) -> subprocess.Popen:
    # no data plane: these nodes hold no sandbox, and a data plane would outlive the test (it outlives its node)
    env = {**os.environ, "AENV_STATE_DIR": str(state_dir), "AENV_NET_POOL_CIDR": free_pool_cidr(),
           "AENV_NET_EGRESS": "false", "AENV_IMAGES_CACHE_DIR": "/var/lib/aenv", "AENV_NODE_DATA_PLANE": "false"}
    return subprocess.Popen(
        [sys.executable, "-m", "aenv_node.cli.node", "serve", "--listen", f"127.0.0.1:{port}"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def _wait_health(url: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read()
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise AssertionError("node did not become healthy")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_real_process_stops_cleanly_on_signal(state_dir: Path, signum: int) -> None:
    port = free_port()
    proc = _serve(state_dir, port)
    try:
        _wait_health(f"http://127.0.0.1:{port}", proc)
        key_file = state_dir / "secrets" / "api-key"
        assert oct(key_file.stat().st_mode & 0o777) == "0o600"
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert f"API key in {key_file}" in err
    assert "shutting down gracefully" in err
    db = Database(state_dir / "aenv.db")
    assert _node_events(db) == [("node_start", None), ("node_stop", None)]
    # the port is free again: nothing leaked
    import socket

    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
