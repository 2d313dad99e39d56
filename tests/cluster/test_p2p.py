"""P2P layer ranges across nodes, with the real pieces: a redis-server, a scheduler process, and nodes that are
each a LayerCache behind the node's API app (``p2p_nodes.py``: no VMs).  Node A reads a new layer from the
repository; B reads it from A (the repository is not read again); C reads it from A or B; a peer that dies
mid-way leaves the reader on the repository with the right bytes; with ``p2p.enabled = false`` no peer is
ever asked.  And the scheduler's holder index: announcements replace each other, dead nodes are left out."""

from __future__ import annotations

import random
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import trio

from prometheus_client import CollectorRegistry, generate_latest

from aenv_node.api.metrics import ApiMetrics, CacheCollector
from aenv_node.cluster.models import LayerAnnouncement, NodeCapacity, NodeLoad, NodeStatus
from aenv_node.storage import LayerRef
from aenv_node.storage.importer import import_raw

from .conftest import SchedulerProcess
from .p2p_nodes import CountingRepository, start_node

MiB = 1 << 20
D1 = "sha256:" + "1" * 64
D2 = "sha256:" + "2" * 64


def _put(repo: CountingRepository, tmp: Path, size: int, seed: int) -> tuple[str, bytes]:
    import hashlib

    data = random.Random(seed).randbytes(size)
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    src = tmp / f"layer-{seed}"
    src.write_bytes(data)
    repo.put_layer(digest, src)
    return digest, data


async def _holders(sched: SchedulerProcess, digest: str) -> list[str]:
    async with httpx.AsyncClient(headers={"X-API-KEY": sched.api_key}) as c:
        r = await c.get(f"{sched.url}/v1/layers/{digest}/holders")
    assert r.status_code == 200, r.text
    return sorted(h["node_id"] for h in r.json()["holders"])


async def _wait_holders(sched: SchedulerProcess, digest: str, want: set[str]) -> None:
    with trio.fail_after(10):
        while not want <= set(await _holders(sched, digest)):
            await trio.sleep(0.05)


def _metrics(text: bytes) -> dict[str, float]:
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.decode().splitlines() if line and not line.startswith("#")}


async def _read_all(node, digest: str, data: bytes, step: int = MiB) -> None:  # type: ignore[no-untyped-def]
    for off in range(0, len(data), step):
        assert await node.read(digest, off, step) == data[off:off + step]


async def test_nodes_read_a_new_layer_from_each_other_not_the_repository(
        tmp_path: Path, scheduler: SchedulerProcess) -> None:
    repo = CountingRepository(tmp_path / "repo")
    digest, data = _put(repo, tmp_path, 12 * MiB + 4096, seed=1)
    async with trio.open_nursery() as nursery:
        a = await start_node(nursery, tmp_path, "node-a", repo, scheduler.url)
        b = await start_node(nursery, tmp_path, "node-b", repo, scheduler.url)
        await _read_all(a, digest, data)
        assert repo.bytes_read == len(data)  # A: from the repository (no one held it)
        assert a.cache.stats().peer_bytes == 0
        await _wait_holders(scheduler, digest, {"node-a"})

        await _read_all(b, digest, data)
        assert repo.bytes_read == len(data)  # B: not one byte more from the repository
        sb = b.cache.stats()
        assert sb.peer_bytes == len(data) and sb.fetched_bytes == 0 and sum(sb.peer_failures.values()) == 0
        assert a.cache.stats().served_bytes == len(data)
        # the node's Prometheus text says so (the collector the node's /metrics registers)
        assert a.announcer is not None
        metrics_b = _metrics(ApiMetrics(a.announcer.node, cache=lambda: b.cache).render())
        assert metrics_b["aenv_cache_peer_bytes_total"] == len(data)
        assert metrics_b["aenv_cache_repository_bytes_total"] == 0
        assert metrics_b['aenv_cache_peer_failures_total{reason="checksum"}'] == 0
        metrics_a = _metrics(ApiMetrics(a.announcer.node, cache=lambda: a.cache).render())
        assert metrics_a["aenv_cache_served_bytes_total"] == len(data)
        await _wait_holders(scheduler, digest, {"node-a", "node-b"})

        c = await start_node(nursery, tmp_path, "node-c", repo, scheduler.url)
        await _read_all(c, digest, data, step=3 * MiB)
        assert repo.bytes_read == len(data)
        sc = c.cache.stats()
        assert sc.peer_bytes == len(data) and sc.fetched_bytes == 0
        served = a.cache.stats().served_bytes + b.cache.stats().served_bytes
        assert served == 2 * len(data)  # B's read and C's, from A or B (random among holders)
        # every node serves only what it caches: a range of a layer no node read is in nobody's cache
        other, other_data = _put(repo, tmp_path, MiB, seed=2)
        async with httpx.AsyncClient(headers={"X-API-KEY": "cluster-key"}) as client:
            url = a.announcer.node.cfg.api.listen if a.announcer else ""
            r = await client.get(f"http://{url}/node/layers/{other}", params={"offset": 0, "length": 4096})
            assert r.status_code == 404 and r.json()["code"] == 404
            r = await client.get(f"http://{url}/node/layers/{digest}", params={"offset": 0, "length": 4096})
            assert r.status_code == 200 and r.content == data[:4096]
            r = await client.get(f"http://{url}/node/layers/{digest}", params={"offset": 0, "length": 8 * MiB})
            assert r.status_code == 400  # over p2p.max_range_bytes
            r = await client.get(f"http://{url}/node/layers/{digest}", params={"offset": 0, "length": 1},
                                 headers={"X-API-KEY": "wrong"})
            assert r.status_code == 401
        assert repo.bytes_read == len(data) + 0 * len(other_data)
        nursery.cancel_scope.cancel()


async def test_a_peer_killed_midway_leaves_the_reader_on_the_repository(
        tmp_path: Path, scheduler: SchedulerProcess) -> None:
    repo = CountingRepository(tmp_path / "repo")
    digest, data = _put(repo, tmp_path, 8 * MiB, seed=3)
    half = len(data) // 2
    async with trio.open_nursery() as nursery:
        a = await start_node(nursery, tmp_path, "node-a", repo, scheduler.url)
        b = await start_node(nursery, tmp_path, "node-b", repo, scheduler.url)
        await _read_all(a, digest, data)
        await _wait_holders(scheduler, digest, {"node-a"})
        await _read_all(b, digest, data[:half])  # the first half from A (and a sequential read's readahead)
        got = b.cache.stats().peer_bytes
        assert repo.bytes_read == len(data) and half <= got < len(data)
        a.kill()  # A is gone (its port refuses); the scheduler still lists it until its heartbeat expires
        await trio.sleep(0.1)
        assert "node-a" in await _holders(scheduler, digest)
        for off in range(half, len(data), MiB):
            assert await b.read(digest, off, MiB) == data[off:off + MiB]
        sb = b.cache.stats()
        assert sb.peer_bytes == got and sb.fetched_bytes == len(data) - got
        assert repo.bytes_read == 2 * len(data) - got
        assert sb.peer_failures["unreachable"] >= 1  # tried once, then skipped for the holder TTL
        nursery.cancel_scope.cancel()


def _disk_bytes(uri: str, size: int, out: Path) -> bytes:
    """What a VMM's disk client reads of a whole disk: qemu-img (Debian's) reading the NBD export to a file."""
    subprocess.run(["qemu-img", "convert", "-f", "raw", "-O", "raw", uri, str(out)], check=True,
                   capture_output=True, timeout=120)
    return out.read_bytes()[:size]


async def test_a_data_plane_reads_a_sandbox_disk_from_peers_and_serves_what_it_cached(
        tmp_path: Path, scheduler: SchedulerProcess) -> None:
    """With ``node.data_plane`` (the default) a sandbox's disk is served by the data plane, through a cache of its
    own: its missing ranges come from peers too, and the node announces and serves what that cache holds."""
    repo = CountingRepository(tmp_path / "repo")
    raw = tmp_path / "disk.raw"
    content = random.Random(7).randbytes(6 * MiB)
    raw.write_bytes(content)
    (tmp_path / "layers").mkdir()
    info = import_raw(raw, tmp_path / "layers")  # a disk's layer, as a template's sealed layer is
    digest = f"sha256:{info.digest}"
    repo.put_layer(digest, info.path)
    layer = Path(info.path).read_bytes()
    async with trio.open_nursery() as nursery:
        a = await start_node(nursery, tmp_path, "node-a", repo, scheduler.url)
        b = await start_node(nursery, tmp_path, "node-b", repo, scheduler.url, data_plane=True)
        assert b.dataplane is not None and b.dataplane_cache is not None and b.run_dir is not None
        await _read_all(a, digest, layer)
        before = repo.bytes_read
        await _wait_holders(scheduler, digest, {"node-a"})

        # B's data plane opens a sandbox's disk over the layer (not on B) and a VMM's client reads all of it
        disk = await b.dataplane.open_disk("isbx", [LayerRef.remote(digest)], tmp_path / "upper",
                                           b.run_dir / "isbx")
        got = await trio.to_thread.run_sync(_disk_bytes, disk.source, len(content), tmp_path / "read.raw")
        assert got == content
        assert repo.bytes_read == before  # every range from A
        assert b.dataplane_cache.stats().peer_bytes > 0 and b.dataplane_cache.stats().fetched_bytes == 0
        # the node's /metrics shows the data plane's cache too (a scrape asks the data plane: from a thread)
        st = await trio.to_thread.run_sync(b.dataplane.cache_stats_blocking)
        assert st is not None and st.peer_bytes == b.dataplane_cache.stats().peer_bytes
        registry = CollectorRegistry()
        registry.register(CacheCollector(b.dataplane.cache_stats_blocking, "aenv_dataplane_cache"))
        scraped = _metrics(await trio.to_thread.run_sync(generate_latest, registry))
        assert scraped["aenv_dataplane_cache_peer_bytes_total"] == st.peer_bytes
        assert scraped["aenv_dataplane_cache_repository_bytes_total"] == 0
        await _wait_holders(scheduler, digest, {"node-a", "node-b"})  # B announces its data plane's layers

        # A goes; C reads the layer from B, whose route answers from its data plane's cache
        a.kill()
        c = await start_node(nursery, tmp_path, "node-c", repo, scheduler.url)
        for off in range(0, len(layer), MiB):
            assert await c.read(digest, off, MiB) == layer[off:off + MiB]
        sc = c.cache.stats()
        assert sc.peer_bytes > 0 and b.dataplane_cache.stats().served_bytes == sc.peer_bytes
        assert repo.bytes_read == before + sc.fetched_bytes  # what B did not hold came from the repository
        await b.dataplane.close_disk("isbx")
        nursery.cancel_scope.cancel()


async def test_with_p2p_off_no_peer_is_ever_asked(tmp_path: Path, scheduler: SchedulerProcess) -> None:
    repo = CountingRepository(tmp_path / "repo")
    digest, data = _put(repo, tmp_path, 4 * MiB, seed=4)
    async with trio.open_nursery() as nursery:
        a = await start_node(nursery, tmp_path, "node-a", repo, scheduler.url)
        await _read_all(a, digest, data)
        await _wait_holders(scheduler, digest, {"node-a"})
        off = await start_node(nursery, tmp_path, "node-off", repo, scheduler.url, p2p=False)
        await _read_all(off, digest, data)
        assert repo.bytes_read == 2 * len(data)
        st = off.cache.stats()
        assert not st.p2p and st.peer_bytes == 0 and st.fetched_bytes == len(data)
        assert a.cache.stats().served_ranges == 0 and a.cache.stats().served_absent == 0
        await trio.sleep(0.3)  # several beats: a node with P2P off announces nothing
        assert await _holders(scheduler, digest) == ["node-a"]
        nursery.cancel_scope.cancel()


def _beat(sched: SchedulerProcess, node_id: str) -> None:
    status = NodeStatus(node_id=node_id, url=f"http://127.0.0.1:1/{node_id}", software="t",
                        capacity=NodeCapacity(vcpus=4, memory_mb=4096, disk_free_mb=1, slots_free=1),
                        load=NodeLoad(running=0, paused=0, vcpus=0, memory_mb=0))
    with sched.client() as c:
        assert c.put(f"/v1/nodes/{node_id}", content=status.model_dump_json()).status_code == 204


def _announce(sched: SchedulerProcess, node_id: str, layers: list[str], *, as_node: str | None = None) -> int:
    body = LayerAnnouncement(node_id=node_id, layers=layers).model_dump_json()
    with sched.client() as c:
        return c.put(f"/v1/nodes/{as_node or node_id}/layers", content=body).status_code


async def test_the_holder_index_replaces_announcements_and_leaves_out_dead_nodes(
        tmp_path: Path, redis_server) -> None:  # type: ignore[no-untyped-def]
    from .conftest import start_scheduler

    sched = start_scheduler(tmp_path / "sched", redis_server.url, "cluster-key", "--node-ttl", "1")
    try:
        for n in ("a", "b"):
            _beat(sched, n)
        assert _announce(sched, "a", [D1, D2]) == 204
        assert _announce(sched, "b", [D1]) == 204
        assert await _holders(sched, D1) == ["a", "b"] and await _holders(sched, D2) == ["a"]
        assert _announce(sched, "a", [D2]) == 204  # a no longer caches D1
        assert await _holders(sched, D1) == ["b"] and await _holders(sched, D2) == ["a"]
        with sched.client() as c:
            got = c.get(f"/v1/layers/{D2}/holders").json()
            assert got == {"version": 1, "digest": D2, "holders": [{"node_id": "a", "url": "http://127.0.0.1:1/a"}]}
            assert c.get("/v1/layers/sha256:nothex/holders").status_code == 400
            assert c.put("/v1/nodes/a/layers", content=b'{"version": 2, "node_id": "a"}').status_code == 400
            too_many = {"node_id": "a", "layers": [D1] * 10_001}
            assert c.put("/v1/nodes/a/layers", json=too_many).status_code == 400
            assert c.delete("/v1/nodes/b").status_code == 204  # b left: its layers go with it
        assert _announce(sched, "a", [D1], as_node="b") == 400
        assert await _holders(sched, D1) == []
        # a node whose heartbeat expired is left out (the same TTL as placement), and back when it beats
        deadline = time.monotonic() + 5
        while await _holders(sched, D2) and time.monotonic() < deadline:
            await trio.sleep(0.1)
        assert await _holders(sched, D2) == []
        _beat(sched, "a")
        assert await _holders(sched, D2) == ["a"]
    finally:
        assert sched.stop() == 0, sched.log()[-3000:]


@pytest.mark.parametrize("enabled", [True])
def test_p2p_needs_a_scheduler(enabled: bool) -> None:
    from aenv_node.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="scheduler_url"):
        load_config(environ={"AENV_P2P_ENABLED": "true" if enabled else "false"})
    cfg = load_config(environ={"AENV_P2P_ENABLED": "1", "AENV_CLUSTER_SCHEDULER_URL": "http://127.0.0.1:9",
                               "AENV_P2P_TIMEOUT_S": "0.5", "AENV_P2P_MAX_ATTEMPTS": "3",
                               "AENV_P2P_MAX_RANGE_BYTES": "1048576", "AENV_P2P_MAX_CONCURRENT_SERVES": "4",
                               "AENV_P2P_HOLDERS_TTL_S": "1.5", "AENV_P2P_ANNOUNCE_MAX_LAYERS": "7"})
    p = cfg.p2p
    assert (p.enabled, p.timeout_s, p.max_attempts, p.max_range_bytes, p.max_concurrent_serves, p.holders_ttl_s,
            p.announce_max_layers) == (True, 0.5, 3, MiB, 4, 1.5, 7)
    for var, bad in (("AENV_P2P_MAX_RANGE_BYTES", "5000"), ("AENV_P2P_ANNOUNCE_MAX_LAYERS", "20000"),
                     ("AENV_P2P_TIMEOUT_S", "0")):
        with pytest.raises(ConfigError):
            load_config(environ={"AENV_CLUSTER_SCHEDULER_URL": "http://127.0.0.1:9", var: bad})
