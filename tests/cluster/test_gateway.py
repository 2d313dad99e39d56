"""The cluster through its gateway, with the unmodified E2B SDK: two real nodes (each its own state, slot pool and
data plane, booting real guests), a real Redis, a scheduler and two gateways.

One module, one cluster, the flows in order (each builds on the last): creates spread over the nodes, commands
and files go through the gateway's proxy to the right guest, listings are merged with working pagination through
either gateway, a pause and resume and a fork stay on their node, kills unbind, a create placed on a node that
just died is retried on the other, a paused sandbox whose node stopped resumes on the other node (through the
repository the nodes share), and a restarted scheduler loses no binding."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox

from ..conftest import free_port
from ..sandbox.conftest import NodeProcess, start_node, stop_node
from .conftest import (
    GatewayProcess,
    RedisServer,
    SchedulerProcess,
    start_gateway,
    start_redis,
    start_scheduler,
)

pytestmark = [pytest.mark.vm, pytest.mark.slow]

KEY = "aenv_cluster_test_key_0123456789abcdef"
#: the test is about routing, not capacity: this 2-CPU machine holds every sandbox the module makes
SCHEDULER_FLAGS = ("--node-ttl", "10", "--cpu-overcommit", "64")


@dataclass
class Cluster:
    tmp: Path
    redis: RedisServer
    scheduler: SchedulerProcess
    gateways: list[GatewayProcess]
    nodes: dict[str, NodeProcess]

    def restart(self, node_id: str) -> None:
        """Start a stopped node again on its state and port (its base template is there already)."""
        port = int(self.nodes[node_id].url.rsplit(":", 1)[1])
        self.nodes[node_id] = _start_cluster_node(self.tmp, node_id, self.scheduler.url, port)

    def alive(self, node_id: str) -> bool:
        with self.scheduler.client() as c:
            views = {v["status"]["node_id"]: v for v in c.get("/v1/nodes").json()}
        view = views.get(node_id)
        return bool(view and view["alive"] and not view["status"]["draining"])

    def node_of(self, sandbox_id: str) -> str:
        with self.scheduler.client() as c:
            r = c.get(f"/v1/bindings/{sandbox_id}")
        assert r.status_code == 200, r.text
        return str(r.json()["binding"]["node_id"])

    def bound(self, sandbox_id: str) -> bool:
        with self.scheduler.client() as c:
            return c.get(f"/v1/bindings/{sandbox_id}").status_code == 200


def _start_cluster_node(tmp: Path, node_id: str, scheduler_url: str, port: int = 0) -> NodeProcess:
    """A node of the cluster: its own state and slot pool, the cluster's key, the repository all nodes share
    (a directory here; a shared filesystem or S3 bucket across hosts)."""
    state = tmp / node_id
    (state / "secrets").mkdir(parents=True, exist_ok=True)
    key_file = state / "secrets" / "api-key"
    key_file.write_text(KEY)
    key_file.chmod(0o600)
    port = port or free_port()
    return start_node(state, port=port, AENV_NODE_NODE_ID=node_id, AENV_CLUSTER_SCHEDULER_URL=scheduler_url,
                      AENV_CLUSTER_ADVERTISE_URL=f"http://127.0.0.1:{port}",
                      AENV_CLUSTER_HEARTBEAT_INTERVAL_S="0.5",
                      AENV_STORAGE_REPOSITORY_PATH=str(tmp / "repository"))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("cluster")
    redis = start_redis(tmp / "redis")
    sched = start_scheduler(tmp / "sched", redis.url, KEY, *SCHEDULER_FLAGS)
    nodes: dict[str, NodeProcess] = {}
    gateways: list[GatewayProcess] = []
    try:
        for node_id in ("n1", "n2"):
            nodes[node_id] = _start_cluster_node(tmp, node_id, sched.url)
        gateways = [start_gateway(tmp / f"gw{i}", sched.url, KEY) for i in (1, 2)]
        cluster = Cluster(tmp, redis, sched, gateways, nodes)
        yield cluster
        sched = cluster.scheduler  # a test may have restarted it
    finally:
        for gw in gateways:
            gw.stop()
        for n in nodes.values():
            stop_node(n.proc)
        sched.stop()
        redis.stop()


@pytest.fixture
def via_gateway(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> GatewayProcess:
    for k, v in cluster.gateways[0].sdk_env().items():
        monkeypatch.setenv(k, v)
    return cluster.gateways[0]


def test_creates_spread_and_traffic_reaches_each_guest(cluster: Cluster, via_gateway: GatewayProcess) -> None:
    boxes = [Sandbox.create(metadata={"suite": "gateway"}) for _ in range(4)]
    try:
        placed = {sb.sandbox_id: cluster.node_of(sb.sandbox_id) for sb in boxes}
        # least loaded of the candidates: both nodes get some (a placement's reservation and the heartbeat that
        # counts it overlap for a beat, so the split need not be even)
        assert set(placed.values()) == {"n1", "n2"}, placed
        for sb in boxes:  # each command reaches its own guest through the gateway and its node's proxy
            sb.files.write("/tmp/who", sb.sandbox_id)
            out = sb.commands.run("cat /tmp/who")
            assert out.stdout == sb.sandbox_id, out
        # the node itself knows only its own
        for sid, node_id in placed.items():
            with cluster.nodes[node_id].api() as c:
                assert c.get(f"/sandboxes/{sid}").status_code == 200
            other = "n2" if node_id == "n1" else "n1"
            with cluster.nodes[other].api() as c:
                assert c.get(f"/sandboxes/{sid}").status_code == 404

        # listings merged, and paged across both nodes through either gateway
        listed = {s.sandbox_id for s in Sandbox.list(query=None).next_items()}
        assert set(placed) <= listed
        for gw in cluster.gateways:
            seen: list[str] = []
            token = None
            with gw.client() as c:
                while True:
                    r = c.get("/v2/sandboxes", params={"limit": 1, **({"nextToken": token} if token else {})})
                    assert r.status_code == 200, r.text
                    seen += [s["sandboxID"] for s in r.json()]
                    token = r.headers.get("x-next-token")
                    if not token:
                        break
            assert sorted(seen) == sorted(set(seen)) and set(placed) <= set(seen), seen
        paginator = Sandbox.list(limit=1)
        paged: list[str] = []
        while paginator.has_next:
            paged += [s.sandbox_id for s in paginator.next_items()]
        assert set(placed) <= set(paged) and len(paged) == len(set(paged)), paged
    finally:
        for sb in boxes:
            sb.kill()
    for sb in boxes:  # kills through the gateway unbind
        assert not cluster.bound(sb.sandbox_id)
    with cluster.gateways[1].client() as c:
        r = c.get(f"/sandboxes/{boxes[0].sandbox_id}")
        assert r.status_code == 404 and r.json()["code"] == 404, r.text


def test_pause_resume_and_fork_stay_on_the_node(cluster: Cluster, via_gateway: GatewayProcess) -> None:
    sb = Sandbox.create()
    children: list[Sandbox] = []
    try:
        home = cluster.node_of(sb.sandbox_id)
        sb.files.write("/root/state", "kept")
        sb.pause()
        assert Sandbox.get_info(sb.sandbox_id).state.value == "paused"
        resumed = Sandbox.connect(sb.sandbox_id)
        assert resumed.files.read("/root/state") == "kept"
        assert cluster.node_of(sb.sandbox_id) == home
        forks = resumed.fork(count=2)
        for child in forks:
            assert isinstance(child, Sandbox), child
            children.append(child)
            assert cluster.node_of(child.sandbox_id) == home  # a child shares its parent's layers there
            child.files.write("/root/state", child.sandbox_id)
            assert child.files.read("/root/state") == child.sandbox_id
        assert resumed.files.read("/root/state") == "kept"
    finally:
        for child in children:
            child.kill()
        sb.kill()


def test_a_paused_sandbox_resumes_on_another_node_when_its_node_stops(cluster: Cluster,
                                                                      via_gateway: GatewayProcess) -> None:
    sb = Sandbox.create()
    home = cluster.node_of(sb.sandbox_id)
    other = "n2" if home == "n1" else "n1"
    try:
        sb.files.write("/root/state", "moved with me")
        sb.pause()
        record = cluster.tmp / "repository" / "manifests" / f"sandbox-{sb.sandbox_id}.json"
        deadline = time.monotonic() + 120  # the pause's publish to the shared repository completes
        while not (record.exists() and json.loads(record.read_text())["state"] == "paused"):
            assert time.monotonic() < deadline, f"not published: {cluster.nodes[home].log()[-3000:]}"
            time.sleep(0.2)
        stop_node(cluster.nodes[home].proc)  # a graceful stop: its heartbeat says it drains, then stops
        assert not cluster.alive(home)
        moved = Sandbox.connect(sb.sandbox_id)  # through the gateway: resumed on the other node
        assert cluster.node_of(sb.sandbox_id) == other
        assert moved.files.read("/root/state") == "moved with me"
        assert moved.commands.run("echo here").stdout.strip() == "here"
        assert json.loads(record.read_text())["owner"].startswith(f"{other}/")
        assert f"sandbox {sb.sandbox_id} moved from node {home} to node {other}" in via_gateway.log()
    finally:
        Sandbox.kill(sb.sandbox_id)
        cluster.restart(home)
    assert not cluster.bound(sb.sandbox_id)


def test_a_create_on_a_dead_node_is_retried_and_a_restarted_scheduler_keeps_bindings(
        cluster: Cluster, via_gateway: GatewayProcess, tmp_path: Path) -> None:
    keep = Sandbox.create()
    try:
        home = cluster.node_of(keep.sandbox_id)
        # the scheduler restarts (same Redis): every binding is still there, traffic still flows
        port = int(cluster.scheduler.url.rsplit(":", 1)[1])
        assert cluster.scheduler.stop() == 0
        cluster.scheduler = start_scheduler(tmp_path / "sched2", cluster.redis.url, KEY, *SCHEDULER_FLAGS, port=port)
        assert keep.commands.run("echo still").stdout.strip() == "still"
        assert cluster.node_of(keep.sandbox_id) == home

        # the other node dies without a word: until its heartbeats are missed for the TTL the scheduler may
        # still place there; the gateway's create then fails there and is retried here
        dead = "n2" if home == "n1" else "n1"
        victim = cluster.nodes[dead]
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait(10)
        made = [Sandbox.create() for _ in range(3)]
        try:
            assert {cluster.node_of(m.sandbox_id) for m in made} == {home}
            for m in made:
                assert m.commands.run("echo ok").stdout.strip() == "ok"
        finally:
            for m in made:
                m.kill()
        # the dead node held fewer sandboxes, so the least-loaded rule placed the first create there
        assert f"create on node {dead} failed" in via_gateway.log(), via_gateway.log()[-3000:]
    finally:
        keep.kill()
        # the killed node comes back on its state: its start takes its orphaned network slots back (a SIGKILL
        # left them), and the module's end stops it gracefully, which removes them
        cluster.restart(dead)


def test_bad_requests_get_e2b_errors(cluster: Cluster) -> None:
    gw = cluster.gateways[1]
    with httpx.Client(base_url=gw.url, timeout=30) as anon:
        r = anon.get("/v2/sandboxes")
        assert r.status_code == 401 and r.json() == {"code": 401, "message": "missing X-API-KEY header"}
    with gw.client(key="wrong") as c:
        assert c.get("/sandboxes").status_code == 401
    with gw.client() as c:
        r = c.get("/sandboxes/inope/metrics")
        assert r.status_code == 404 and r.json()["code"] == 404, r.text
        r = c.post("/sandboxes", json={"templateID": "no-such-template"})
        assert r.status_code in (400, 404) and "no-such-template" in r.json()["message"], r.text
        r = c.get("/v2/sandboxes", params={"limit": "many"})  # the nodes' own validation, passed on
        assert r.status_code == 400 and "limit" in r.json()["message"], r.text
        r = c.get("/no/such/route")
        assert r.status_code == 404 and r.json()["code"] == 404
    assert os.path.exists(gw.log_path)
