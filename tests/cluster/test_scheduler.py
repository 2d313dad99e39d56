"""The scheduler process against a real Redis: registration and heartbeats, a TTL that makes a silent node
unschedulable, placements that reserve what they place until the node's heartbeats count it, bindings, a
restart and a second replica that lose nothing, a Redis that goes away, and bad requests."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from aenv_node.cluster import NodeCapacity, NodeLoad, NodeStatus

from .conftest import RedisServer, SchedulerProcess, start_scheduler


def _status(node_id: str, *, vcpus: int = 4, memory_mb: int = 8192, used_vcpus: int = 0, used_mb: int = 0,
            running: int = 0, templates: tuple[str, ...] = (), draining: bool = False) -> dict[str, Any]:
    return NodeStatus(node_id=node_id, url=f"http://{node_id}.test:8000", software="test",
                      capacity=NodeCapacity(vcpus=vcpus, memory_mb=memory_mb, disk_free_mb=10_000, slots_free=64),
                      load=NodeLoad(running=running, paused=0, vcpus=used_vcpus, memory_mb=used_mb),
                      templates=list(templates), draining=draining).model_dump(mode="json")


def _beat(sched: SchedulerProcess, node_id: str, **kw: Any) -> None:
    with sched.client() as c:
        r = c.put(f"/v1/nodes/{node_id}", json=_status(node_id, **kw))
        assert r.status_code == 204, r.text


def _place(sched: SchedulerProcess, *, cpu: int = 1, mb: int = 512, template: str = "base",
           **kw: Any) -> dict[str, Any]:
    with sched.client() as c:
        r = c.post("/v1/placements", json={"template_id": template, "cpu_count": cpu, "memory_mb": mb, **kw})
    assert r.status_code in (201, 503), r.text
    return {"status": r.status_code, **r.json()}


def test_heartbeats_register_nodes_and_a_silent_node_is_dead_after_the_ttl(
        tmp_path: Path, redis_server: RedisServer) -> None:
    scheduler = start_scheduler(tmp_path / "ttl", redis_server.url, "cluster-key", "--node-ttl", "2")
    try:
        _silent_nodes_die(scheduler)
    finally:
        assert scheduler.stop() == 0, scheduler.log()[-3000:]


def _silent_nodes_die(scheduler: SchedulerProcess) -> None:
    _beat(scheduler, "a")
    _beat(scheduler, "b", draining=True)
    with scheduler.client() as c:
        views = {v["status"]["node_id"]: v for v in c.get("/v1/nodes").json()}
    assert views["a"]["alive"] and views["b"]["alive"] and views["b"]["status"]["draining"]
    # b drains: everything goes to a
    assert {_place(scheduler)["node_id"] for _ in range(5)} == {"a"}
    time.sleep(2.2)  # --node-ttl 2: both are silent past it
    _beat(scheduler, "b")
    with scheduler.client() as c:
        views = {v["status"]["node_id"]: v for v in c.get("/v1/nodes").json()}
    assert not views["a"]["alive"] and views["b"]["alive"]
    assert {_place(scheduler)["node_id"] for _ in range(5)} == {"b"}
    time.sleep(2.5)
    refused = _place(scheduler)
    assert refused["status"] == 503 and "no live node" in refused["message"], refused
    with scheduler.client() as c:
        assert c.delete("/v1/nodes/a").status_code == 204
        assert c.delete("/v1/nodes/a").status_code == 404
        assert [v["status"]["node_id"] for v in c.get("/v1/nodes").json()] == ["b"]


def test_placements_reserve_until_the_node_counts_them(scheduler: SchedulerProcess) -> None:
    """A node of 4 CPUs at the default overcommit (4x) takes 16 vCPUs: 16 one-vCPU placements fit before any
    heartbeat, the 17th does not. Binding a placement and two heartbeats that count it release its reservation;
    a failed create gives its share back at once."""
    _beat(scheduler, "a", vcpus=4, memory_mb=1 << 20)
    placed = [_place(scheduler) for _ in range(16)]
    assert all(p["status"] == 201 and p["node_id"] == "a" for p in placed)
    full = _place(scheduler)
    assert full["status"] == 503 and "room for 1 vCPUs" in full["message"], full
    with scheduler.client() as c:
        # one create failed: its share comes back
        assert c.delete(f"/v1/placements/a/{placed[0]['placement_id']}").status_code == 204
        assert _place(scheduler)["status"] == 201
        # the other 15 were created and bound; the node's heartbeats now count all 16
        for i, p in enumerate(placed[1:]):
            assert c.put(f"/v1/bindings/sb{i}", json={"node_id": "a", "placement_id": p["placement_id"]}
                         ).status_code == 204
        view = c.get("/v1/nodes").json()[0]
        assert view["reserved_vcpus"] == 16
        _beat(scheduler, "a", vcpus=4, memory_mb=1 << 20, used_vcpus=15, running=15)
        assert c.get("/v1/nodes").json()[0]["reserved_vcpus"] == 16  # this beat may predate the bindings
        _beat(scheduler, "a", vcpus=4, memory_mb=1 << 20, used_vcpus=15, running=15)
        view = c.get("/v1/nodes").json()[0]
        assert view["reserved_vcpus"] == 1, view  # the unbound one stays reserved (until it expires)
        assert view["status"]["load"]["vcpus"] == 15


def test_placement_prefers_the_named_node_then_warm_nodes(scheduler: SchedulerProcess) -> None:
    _beat(scheduler, "cold", vcpus=64)
    _beat(scheduler, "warm", vcpus=4, used_vcpus=10, templates=("app",))
    assert {_place(scheduler, template="app")["node_id"] for _ in range(4)} == {"warm"}
    assert _place(scheduler, template="app", exclude=["warm"])["node_id"] == "cold"
    assert _place(scheduler, template="other", prefer="warm")["node_id"] == "warm"
    # a preferred node without room is passed over
    assert _place(scheduler, template="app", cpu=8, prefer="warm")["node_id"] == "cold"


def test_bindings_and_nodes_survive_a_restart_and_a_second_replica_sees_them(
        tmp_path: Path, redis_server: RedisServer, scheduler: SchedulerProcess) -> None:
    _beat(scheduler, "a")
    with scheduler.client() as c:
        assert c.put("/v1/bindings/sb-1", json={"node_id": "a"}).status_code == 204
    second = start_scheduler(tmp_path / "second", redis_server.url, "cluster-key")
    try:
        with second.client() as c:
            got = c.get("/v1/bindings/sb-1").json()
            assert got["binding"]["node_id"] == "a" and got["node"]["status"]["url"] == "http://a.test:8000"
            assert c.put("/v1/bindings/sb-2", json={"node_id": "a"}).status_code == 204
    finally:
        assert second.stop() == 0
    assert scheduler.stop() == 0
    again = start_scheduler(tmp_path / "again", redis_server.url, "cluster-key")
    try:
        with again.client() as c:
            assert c.get("/v1/bindings/sb-2").json()["binding"]["node_id"] == "a"
            assert c.delete("/v1/bindings/sb-2").status_code == 204
            r = c.get("/v1/bindings/sb-2")
            assert r.status_code == 404 and r.json() == {"code": 404, "message": "sandbox sb-2 is bound to no node"}
            assert [v["status"]["node_id"] for v in c.get("/v1/nodes").json()] == ["a"]
    finally:
        assert again.stop() == 0


def test_bad_requests_and_a_lost_redis_are_clear_errors(scheduler: SchedulerProcess,
                                                        redis_server: RedisServer) -> None:
    with scheduler.client(key="wrong") as c:
        r = c.get("/v1/nodes")
        assert r.status_code == 401 and r.json()["code"] == 401
    with scheduler.client() as c:
        r = c.put("/v1/nodes/a", json={**_status("a"), "capacity": {"vcpus": 0}})
        assert r.status_code == 400 and "capacity" in r.json()["message"], r.text
        r = c.put("/v1/nodes/a", json=_status("b"))
        assert r.status_code == 400 and "sent for 'a'" in r.json()["message"]
        assert c.put("/v1/nodes/bad id!", json=_status("a")).status_code == 400
        r = c.post("/v1/placements", json={"template_id": "t", "cpu_count": "2", "memory_mb": 1})
        assert r.status_code == 400 and "cpu_count" in r.json()["message"]
        r = c.put("/v1/nodes/a", json={**_status("a"), "version": 2})
        assert r.status_code == 400 and "version" in r.json()["message"]
        assert c.post("/v1/placements", content=b"{not json").status_code == 400
        redis_server.stop()
        r = c.get("/v1/nodes")
        assert r.status_code == 503 and "redis" in r.json()["message"], r.text
        assert c.get("/health").status_code == 503
    assert "Traceback" not in scheduler.log()
