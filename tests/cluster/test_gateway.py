"""The cluster through its gateway, with the unmodified E2B SDK: three real nodes, each on a host of its own (a
network namespace with its own address on a LAN the module makes; its own state, slot pool and data plane,
booting real guests), a real Redis, a scheduler and two gateways on the control host (the test's namespace).

One module, one cluster, the flows in order (each builds on the last): creates spread over the nodes, commands
and files go through the gateway's proxy to the right guest, listings are merged with working pagination through
either gateway, a pause and resume and a fork stay on their node, kills unbind, a user snapshot taken on one node
starts sandboxes on another (templates shared through the repository), a node drained with ``aenv-node drain``
pauses its sandbox and it resumes on another node, a node that dies leaves its running sandbox resumable
elsewhere from its checkpoint, a create placed on a node that just died is retried on another and the paused
sandbox of that node resumes on another, and a restarted scheduler loses no binding."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox

from ..conftest import free_port
from ..sandbox.conftest import NodeProcess, kill_running, start_node, stop_node
from .hosts import Lan, in_namespace, make_lan
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
#: the nodes' periodic snapshots (checkpoints in the repository)
CHECKPOINT_S = 8


NODES = ("n1", "n2", "n3")


@dataclass
class Cluster:
    tmp: Path
    lan: Lan
    redis: RedisServer
    scheduler: SchedulerProcess
    gateways: list[GatewayProcess]
    nodes: dict[str, NodeProcess]

    def restart(self, node_id: str) -> None:
        """Start a stopped node again on its host, state and port (its base template is there already)."""
        port = int(self.nodes[node_id].url.rsplit(":", 1)[1])
        self.nodes[node_id] = _start_cluster_node(self.tmp, self.lan, node_id, self.scheduler.url, port)

    def others(self, node_id: str) -> list[str]:
        """The other nodes, in id order."""
        return [n for n in NODES if n != node_id]

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


def _start_cluster_node(tmp: Path, lan: Lan, node_id: str, scheduler_url: str, port: int = 0) -> NodeProcess:
    """A node of the cluster on its host: its own address, state and slot pool, the cluster's key, the repository
    all nodes share (a directory here; a shared filesystem or S3 bucket across hosts)."""
    state = tmp / node_id
    (state / "secrets").mkdir(parents=True, exist_ok=True)
    key_file = state / "secrets" / "api-key"
    key_file.write_text(KEY)
    key_file.chmod(0o600)
    port = port or free_port()
    host = lan.address(node_id)
    return start_node(state, port=port, host=host, prefix=tuple(in_namespace(lan.namespace(node_id))),
                      AENV_NODE_NODE_ID=node_id, AENV_CLUSTER_SCHEDULER_URL=scheduler_url,
                      AENV_CLUSTER_ADVERTISE_URL=f"http://{host}:{port}",
                      AENV_CLUSTER_HEARTBEAT_INTERVAL_S="0.5",
                      # running sandboxes are checkpointed to the repository (a node that dies loses at most this)
                      AENV_SNAPSHOT_PERIODIC_INTERVAL_S=str(CHECKPOINT_S),
                      AENV_STORAGE_REPOSITORY_PATH=str(tmp / "repository"))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("cluster")
    lan = make_lan()
    redis = start_redis(tmp / "redis")
    nodes: dict[str, NodeProcess] = {}
    gateways: list[GatewayProcess] = []
    sched: SchedulerProcess | None = None
    try:
        # the scheduler listens on the LAN, where the nodes' heartbeats come from
        sched = start_scheduler(tmp / "sched", redis.url, KEY, *SCHEDULER_FLAGS, host=lan.own_address)
        for node_id in NODES:
            lan.add_host(node_id)
            nodes[node_id] = _start_cluster_node(tmp, lan, node_id, sched.url)
        gateways = [start_gateway(tmp / f"gw{i}", sched.url, KEY) for i in (1, 2)]
        cluster = Cluster(tmp, lan, redis, sched, gateways, nodes)
        yield cluster
        sched = cluster.scheduler  # a test may have restarted it
    finally:
        for gw in gateways:
            gw.stop()
        for n in nodes.values():
            kill_running(n)  # what a failed test left: the node removes its network slots
            stop_node(n.proc)
        if sched is not None:
            sched.stop()
        redis.stop()
        lan.remove()
        assert not lan.leftovers(), lan.leftovers()


@pytest.fixture
def via_gateway(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> GatewayProcess:
    for k, v in cluster.gateways[0].sdk_env().items():
        monkeypatch.setenv(k, v)
    return cluster.gateways[0]


def test_creates_spread_and_traffic_reaches_each_guest(cluster: Cluster, via_gateway: GatewayProcess) -> None:
    boxes = [Sandbox.create(metadata={"suite": "gateway"}) for _ in range(6)]
    try:
        placed = {sb.sandbox_id: cluster.node_of(sb.sandbox_id) for sb in boxes}
        # least loaded of the candidates: every node gets some (a placement's reservation and the heartbeat that
        # counts it overlap for a beat, so the split need not be even)
        assert set(placed.values()) == set(NODES), placed
        for sb in boxes:  # each command reaches its own guest through the gateway and its node's proxy
            sb.files.write("/tmp/who", sb.sandbox_id)
            out = sb.commands.run("cat /tmp/who")
            assert out.stdout == sb.sandbox_id, out
        # the node itself knows only its own
        for sid, node_id in placed.items():
            with cluster.nodes[node_id].api() as c:
                assert c.get(f"/sandboxes/{sid}").status_code == 200
            for other in cluster.others(node_id):
                with cluster.nodes[other].api() as c:
                    assert c.get(f"/sandboxes/{sid}").status_code == 404

        # listings merged, and paged across the nodes through either gateway
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


def _published_paused(cluster: Cluster, sandbox_id: str) -> dict[str, object]:
    """The sandbox's record in the shared repository, once a pause published it."""
    record = cluster.tmp / "repository" / "manifests" / f"sandbox-{sandbox_id}.json"
    deadline = time.monotonic() + 120  # the pause's publish to the shared repository completes
    while not (record.exists() and json.loads(record.read_text())["state"] == "paused"):
        assert time.monotonic() < deadline, f"{sandbox_id} not published"
        time.sleep(0.2)
    return dict(json.loads(record.read_text()))


def test_a_snapshot_taken_on_one_node_starts_sandboxes_on_every_node(cluster: Cluster,
                                                                     via_gateway: GatewayProcess) -> None:
    sb = Sandbox.create()
    home = cluster.node_of(sb.sandbox_id)
    other = cluster.others(home)[0]
    children: list[Sandbox] = []
    try:
        sb.files.write("/root/made", f"on {home}")
        snapshot_id = sb.create_snapshot().snapshot_id  # E2B: a template sandboxes are created from
        record = cluster.tmp / "repository" / "manifests" / f"template-{snapshot_id}.json"
        deadline = time.monotonic() + 120  # published in the background after the call
        while not record.exists():
            assert time.monotonic() < deadline, f"not published: {cluster.nodes[home].log()[-3000:]}"
            time.sleep(0.2)
        assert json.loads(record.read_text())["publisher"].startswith(f"{home}/")
        # the node that never saw it imports it from the repository on its first create
        node = cluster.nodes[other]
        with node.api() as c:
            assert snapshot_id not in {t["templateID"] for t in c.get("/templates").json()}
        child = Sandbox.create(snapshot_id, api_url=node.url, sandbox_url=node.url, api_key=KEY)
        children.append(child)
        assert child.files.read("/root/made") == f"on {home}"
        assert child.commands.run("echo ok").stdout.strip() == "ok"
        imported = node.sql(f"SELECT operation FROM events WHERE subject_id = '{snapshot_id}' "
                            "AND operation = 'template_import'")
        assert imported == [("template_import",)], imported
        # through the gateway too, wherever it is placed
        via = Sandbox.create(snapshot_id)
        children.append(via)
        assert via.files.read("/root/made") == f"on {home}"
        # deleted through the gateway: every node that has it deletes its copy, and its records go
        with via_gateway.client() as c:
            r = c.delete(f"/templates/{snapshot_id}")
            assert r.status_code == 204, r.text
            assert c.delete(f"/templates/{snapshot_id}").status_code == 404
        assert not record.exists()
        for n in cluster.nodes.values():  # no node starts a sandbox from it any more (nor imports it again)
            with n.api() as c:
                r = c.post("/sandboxes", json={"templateID": snapshot_id})
                assert r.status_code == 404 and snapshot_id in r.json()["message"], r.text
    finally:
        for child in children:
            child.kill()
        sb.kill()


def test_a_drained_node_pauses_its_sandboxes_and_they_resume_on_another(cluster: Cluster,
                                                                      via_gateway: GatewayProcess) -> None:
    sb = Sandbox.create()
    home = cluster.node_of(sb.sandbox_id)
    node = cluster.nodes[home]
    try:
        sb.files.write("/root/state", "moved with me")
        # the operator's (or Kubernetes preStop's) drain, through the real CLI against the running node
        drain = subprocess.run([sys.executable, "-m", "aenv_node.cli.node", "drain", "--state-dir",
                                str(node.state_dir), "--url", node.url], capture_output=True, text=True, timeout=600)
        assert drain.returncode == 0, drain.stdout + drain.stderr
        assert "drained: 1 paused, 0 still running, 0 not yet published" in drain.stdout, drain.stdout
        assert _published_paused(cluster, sb.sandbox_id)["owner"].startswith(f"{home}/")  # type: ignore[union-attr]
        with node.api() as c:
            assert c.get("/health").json()["status"] == "draining"
            r = c.post("/sandboxes", json={"templateID": "base"})  # it takes no new sandbox
            assert r.status_code == 503 and r.json()["code"] == 503, r.text
            assert c.get(f"/sandboxes/{sb.sandbox_id}").json()["state"] == "paused"  # reads go on
        deadline = time.monotonic() + 10  # its next heartbeat says it drains: nothing is placed there
        while cluster.alive(home):
            assert time.monotonic() < deadline, "the scheduler still counts the drained node in"
            time.sleep(0.2)
        moved = Sandbox.connect(sb.sandbox_id)  # through the gateway: resumed on another node
        other = cluster.node_of(sb.sandbox_id)
        assert other in cluster.others(home)
        assert moved.files.read("/root/state") == "moved with me"
        assert moved.commands.run("echo here").stdout.strip() == "here"
        record = cluster.tmp / "repository" / "manifests" / f"sandbox-{sb.sandbox_id}.json"
        assert json.loads(record.read_text())["owner"].startswith(f"{other}/")
        assert f"sandbox {sb.sandbox_id} moved from node {home} to node {other}" in via_gateway.log()
        # a second drain finds nothing left to do
        again = subprocess.run([sys.executable, "-m", "aenv_node.cli.node", "drain", "--state-dir",
                                str(node.state_dir), "--url", node.url], capture_output=True, text=True, timeout=120)
        assert again.returncode == 0 and "drained: 0 paused" in again.stdout, again.stdout + again.stderr
    finally:
        Sandbox.kill(sb.sandbox_id)
        stop_node(node.proc)  # a drain is undone by a restart
        cluster.restart(home)
    assert not cluster.bound(sb.sandbox_id)


def test_a_node_that_dies_leaves_its_running_sandbox_resumable_elsewhere_from_its_checkpoint(
        cluster: Cluster, via_gateway: GatewayProcess) -> None:
    sb = Sandbox.create()
    home = cluster.node_of(sb.sandbox_id)
    node = cluster.nodes[home]
    record = cluster.tmp / "repository" / "manifests" / f"sandbox-{sb.sandbox_id}.json"
    try:
        sb.files.write("/root/state", "checkpointed")
        written = time.time()
        deadline = time.monotonic() + 4 * CHECKPOINT_S + 120  # a periodic snapshot after the write, published
        while True:
            doc = json.loads(record.read_text()) if record.exists() else {}
            if doc.get("state") == "running" and doc.get("published_at", 0) > written:
                break
            assert time.monotonic() < deadline, f"no checkpoint published: {node.log()[-3000:]}"
            time.sleep(0.5)
        assert doc["owner"].startswith(f"{home}/") and doc["snapshot_id"]
        # the host dies: its node is SIGKILLed and its data plane with every VMM ends
        node.proc.send_signal(signal.SIGKILL)
        node.proc.wait(10)
        stop_node(node.proc)
        with via_gateway.client() as c:
            r = c.post(f"/sandboxes/{sb.sandbox_id}/connect", json={"timeout": 300})
        if r.status_code == 409:  # the scheduler still counts the node in: nobody may take the sandbox yet
            assert f"running on node {home}/" in r.json()["message"], r.text
        else:  # this run was slow: the node was already counted dead
            assert r.status_code in (200, 201) and not cluster.alive(home), r.text
        deadline = time.monotonic() + 60
        while cluster.alive(home):  # missed heartbeats for the scheduler's TTL: dead
            assert time.monotonic() < deadline, "the scheduler still counts the killed node alive"
            time.sleep(0.5)
        moved = Sandbox.connect(sb.sandbox_id)  # another node takes it over from the checkpoint
        other = cluster.node_of(sb.sandbox_id)
        assert other in cluster.others(home)
        assert moved.files.read("/root/state") == "checkpointed"
        assert moved.commands.run("echo alive").stdout.strip() == "alive"
        assert json.loads(record.read_text())["owner"].startswith(f"{other}/")
        taken = cluster.nodes[other].sql(
            "SELECT detail FROM events WHERE operation = 'ownership_claim' AND sandbox_id = "
            f"'{sb.sandbox_id}'")
        assert any(f'"taken_over_from": "{home}/' in str(d) for (d,) in taken), taken
        # the dead node comes back on its state: its copy ends there, and the record stays the other node's
        cluster.restart(home)
        states = cluster.nodes[home].sql(f"SELECT state FROM sandboxes WHERE id = '{sb.sandbox_id}'")
        assert states == [("killed",)], states
        assert json.loads(record.read_text())["owner"].startswith(f"{other}/")
        assert moved.commands.run("echo still").stdout.strip() == "still"
    finally:
        Sandbox.kill(sb.sandbox_id)
        if cluster.nodes[home].proc.poll() is not None:
            cluster.restart(home)
    assert not record.exists()


def test_a_create_on_a_dead_node_is_retried_and_a_restarted_scheduler_keeps_bindings(
        cluster: Cluster, via_gateway: GatewayProcess, tmp_path: Path) -> None:
    keep = Sandbox.create()
    try:
        home = cluster.node_of(keep.sandbox_id)
        # the scheduler restarts (same Redis): every binding is still there, traffic still flows
        port = int(cluster.scheduler.url.rsplit(":", 1)[1])
        assert cluster.scheduler.stop() == 0
        cluster.scheduler = start_scheduler(tmp_path / "sched2", cluster.redis.url, KEY, *SCHEDULER_FLAGS, port=port,
                                            host=cluster.lan.own_address)
        assert keep.commands.run("echo still").stdout.strip() == "still"
        assert cluster.node_of(keep.sandbox_id) == home

        # another node dies without a word: until its heartbeats are missed for the TTL the scheduler may
        # still place there; the gateway's create then fails there and is retried on a live one (the first of
        # the others: the least-loaded rule breaks ties by node id, so an empty node is tried first)
        dead = cluster.others(home)[0]
        live = set(NODES) - {dead}
        # a sandbox paused on the node about to die (least loaded: the next create lands there)
        stranded = Sandbox.create()
        made_before = [stranded]
        while cluster.node_of(stranded.sandbox_id) != dead:
            assert len(made_before) < 4, "no create was placed on the other node"
            stranded = Sandbox.create()
            made_before.append(stranded)
        for extra in made_before[:-1]:
            extra.kill()
        stranded.files.write("/root/state", "outlived my node")
        stranded.pause()
        _published_paused(cluster, stranded.sandbox_id)
        victim = cluster.nodes[dead]
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait(10)
        made = [Sandbox.create() for _ in range(3)]
        try:
            assert {cluster.node_of(m.sandbox_id) for m in made} <= live
            for m in made:
                assert m.commands.run("echo ok").stdout.strip() == "ok"
        finally:
            for m in made:
                m.kill()
        # the dead node held fewer sandboxes, so the least-loaded rule placed the first create there
        assert f"create on node {dead} failed" in via_gateway.log(), via_gateway.log()[-3000:]
        # its paused sandbox resumes on a live node, from the repository they share
        back = Sandbox.connect(stranded.sandbox_id)
        assert cluster.node_of(stranded.sandbox_id) in live
        assert back.files.read("/root/state") == "outlived my node"
        back.kill()
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
