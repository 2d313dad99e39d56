"""A node's heartbeat (``cluster/heartbeat.py``) as the real scheduler receives it: the node's own figures from
its state (running sandboxes hold their vCPUs and memory, paused ones nothing), the host's, its ready
templates; a scheduler that is down and comes back; a shutdown that says at once that the node drains."""

from __future__ import annotations

import datetime as dt
import os
from pathlib import Path
from typing import Any

import httpx
import trio

from aenv_node.cluster import HeartbeatSender
from aenv_node.cluster.heartbeat import host_memory_mb
from aenv_node.config import load_config
from aenv_node.runtime import Node, run_node
from aenv_node.state import BuildStatus, Database, Sandbox, SandboxState, Template, utcnow
from aenv_node.state import repository as repo

from ..conftest import free_port
from .conftest import RedisServer, SchedulerProcess, start_scheduler


def _node(tmp: Path, scheduler_url: str) -> Node:
    cfg = load_config(environ={}, overrides={
        "node": {"state_dir": str(tmp / "state"), "node_id": "node-a", "shutdown_grace_s": 5, "data_plane": False},
        "api": {"listen": f"127.0.0.1:{free_port()}", "api_key": "cluster-key"},
        "net": {"egress": False},
        "cluster": {"scheduler_url": scheduler_url, "advertise_url": "http://10.1.2.3:8000",
                    "heartbeat_interval_s": 0.2},
    })
    cfg.state_dir.mkdir(parents=True)
    return Node(cfg, Database(cfg.database_path), "cluster-key")


def _add(node: Node, sid: str, state: SandboxState, cpu: int, mb: int) -> None:
    now = utcnow()
    with node.db.session() as s:
        repo.insert_sandbox(s, Sandbox(id=sid, template_id="app", cpu_count=cpu, memory_mb=mb, started_at=now,
                                       end_at=now + dt.timedelta(minutes=5), envd_version="0.6.4"))
    with node.db.session() as s:
        repo.transition(s, sid, SandboxState.RUNNING, operation="create")
    if state == SandboxState.PAUSED:
        with node.db.session() as s:
            repo.transition(s, sid, SandboxState.PAUSING, operation="pause")
            repo.transition(s, sid, SandboxState.PAUSED, operation="pause")


async def _view(sched: SchedulerProcess) -> dict[str, Any]:
    async with httpx.AsyncClient(headers={"X-API-KEY": sched.api_key}) as c:
        views = (await c.get(f"{sched.url}/v1/nodes")).json()
    return {v["status"]["node_id"]: v for v in views}.get("node-a", {})


async def test_the_scheduler_sees_what_the_node_holds_and_that_it_drains(
        tmp_path: Path, scheduler: SchedulerProcess) -> None:
    node = _node(tmp_path, scheduler.url)
    await trio.to_thread.run_sync(node.db.upgrade)
    _add(node, "r1", SandboxState.RUNNING, 2, 1024)
    _add(node, "r2", SandboxState.RUNNING, 1, 512)
    _add(node, "p1", SandboxState.PAUSED, 4, 4096)
    with node.db.session() as s:
        s.add(Template(id="tpl1", alias="app", status=BuildStatus.READY))
        s.add(Template(id="tpl2", alias="broken", status=BuildStatus.ERROR))
    sender = HeartbeatSender(node, slot_capacity=10)
    node.services.append(sender)
    async with trio.open_nursery() as nursery:
        await nursery.start(lambda task_status: run_node(node, handle_signals=False, task_status=task_status))
        view = await _view(scheduler)
        status = view["status"]
        assert view["alive"] and status["url"] == "http://10.1.2.3:8000" and not status["draining"]
        assert status["load"] == {"running": 2, "paused": 1, "vcpus": 3, "memory_mb": 1536}
        assert status["capacity"]["vcpus"] == os.cpu_count()
        assert status["capacity"]["memory_mb"] == host_memory_mb()
        assert status["capacity"]["slots_free"] == 8 and status["capacity"]["disk_free_mb"] > 0
        assert sorted(status["templates"]) == ["app", "tpl1"]
        # a new sandbox shows at the next beat
        _add(node, "r3", SandboxState.RUNNING, 1, 256)
        with trio.fail_after(5):
            while (await _view(scheduler))["status"]["load"]["running"] != 3:
                await trio.sleep(0.1)
        node.request_shutdown()
        with trio.fail_after(5):
            while not (await _view(scheduler))["status"]["draining"]:
                await trio.sleep(0.05)
    assert sender.last_error is None and sender.sent >= 3


async def test_a_scheduler_that_was_down_gets_beats_again(tmp_path: Path, redis_server: RedisServer) -> None:
    port = free_port()
    node = _node(tmp_path, f"http://127.0.0.1:{port}")
    sender = HeartbeatSender(node, slot_capacity=4)
    node.services.append(sender)
    async with trio.open_nursery() as nursery:
        await nursery.start(lambda task_status: run_node(node, handle_signals=False, task_status=task_status))
        assert sender.sent == 0 and sender.last_error is not None  # nobody listens: the node runs on
        sched = await trio.to_thread.run_sync(
            lambda: start_scheduler(tmp_path / "sched", redis_server.url, "cluster-key", port=port))
        try:
            with trio.fail_after(10):
                while not (await _view(sched)).get("alive"):
                    await trio.sleep(0.1)
            assert sender.last_error is None
        finally:
            node.request_shutdown()
            await trio.to_thread.run_sync(sched.stop)
