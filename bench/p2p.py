"""P2P layer ranges: how many bytes the shared repository serves when N nodes read the same new layer, with and
without P2P (``p2p.enabled``), and how long each node's read takes.

Each node is a real LayerCache (with the real HTTP peer client) behind the node's API app serving the P2P route
on 127.0.0.1, with the real heartbeat sender and layer announcer, all in this process (no VMs); a real
redis-server and a real ``aenv-node scheduler`` process hold the holder index.  The repository is a posix_fs
directory wrapped to count the layer bytes read from it.  Each run puts a new layer of random bytes and reads it
whole, 1 MiB at a time, on N = 1, 2, 4, 8 nodes:

* ``staggered``: one node after the other (a template rolled out to nodes as sandboxes land on them);
* ``burst``: all N at once (with P2P only: without it every node reads the repository either way).  Nodes
  that read the same range at the same moment all miss it at peers (nobody holds it yet), so a burst saves
  less than a staggered rollout; there is no coordination of in-flight fetches across nodes.

    .venv/bin/python bench/p2p.py [SIZE_MIB]     # layer size (default 256)
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _stats import utc_now  # noqa: E402

from aenv_node.api.app import create_app  # noqa: E402
from aenv_node.api.handlers.peers import layer_range_handler  # noqa: E402
from aenv_node.cluster import HeartbeatSender  # noqa: E402
from aenv_node.config import load_config  # noqa: E402
from aenv_node.runtime import Node  # noqa: E402
from aenv_node.runtime.peers import LayerAnnouncer, peer_options  # noqa: E402
from aenv_node.state import Database  # noqa: E402
from aenv_node.storage.cache import LayerCache  # noqa: E402
from aenv_node.storage.repository import PosixFsRepository  # noqa: E402
from _results import result_path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SIZE_MIB = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 256
KEY = "bench-key"
MiB = 1 << 20
STEP = MiB


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class CountingRepository(PosixFsRepository):
    def __init__(self, root: Path) -> None:
        super().__init__(root, durable=False)
        self.bytes_read = 0
        self._count = threading.Lock()

    def read_range(self, digest: str, offset: int, length: int) -> bytes:
        data = super().read_range(digest, offset, length)
        with self._count:
            self.bytes_read += len(data)
        return data


async def start_node(nursery: trio.Nursery, tmp: Path, node_id: str, repo: CountingRepository, sched: str,
                     p2p: bool) -> LayerCache:
    cfg = load_config(environ={}, overrides={
        "node": {"state_dir": str(tmp / node_id), "node_id": node_id, "data_plane": False},
        "api": {"listen": f"127.0.0.1:{free_port()}", "api_key": KEY}, "net": {"egress": False},
        "cluster": {"scheduler_url": sched, "heartbeat_interval_s": 0.1},
        "p2p": {"enabled": p2p, "holders_ttl_s": 0.05}})
    cfg.state_dir.mkdir(parents=True)
    db = Database(cfg.database_path)
    await trio.to_thread.run_sync(db.upgrade)
    node = Node(cfg, db, KEY)
    options = peer_options(cfg, node_id, lambda: KEY)
    cache = LayerCache(cfg.cache_dir, repo, capacity_bytes=8 << 30, durable=False, peers=options)
    app: Any = create_app(node, extra_handlers={"get_layer_range": layer_range_handler(lambda api: cache)})
    hc = HypercornConfig()
    hc.bind = [cfg.api.listen]
    hc.accesslog = None
    hc.errorlog = logging.getLogger("hypercorn.error")

    async def run(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            async with trio.open_nursery() as inner:
                await inner.start(lambda task_status: serve(app, hc, shutdown_trigger=trio.sleep_forever,
                                                            task_status=task_status))
                await inner.start(HeartbeatSender(node, slot_capacity=1).run)
                if options is not None:
                    await inner.start(LayerAnnouncer(node, cache.cached_layers).run)
                task_status.started()
        finally:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(cache.close)
                if options is not None:
                    options.source.close()
                db.close()

    await nursery.start(run)
    return cache


def read_layer(cache: LayerCache, digest: str, size: int) -> float:
    t0 = time.perf_counter()
    for off in range(0, size, STEP):
        cache.read(digest, off, STEP)
    return time.perf_counter() - t0


async def one_run(tmp: Path, sched: str, n: int, p2p: bool, burst: bool) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(dir=tmp))
    repo = CountingRepository(work / "repo")
    size = SIZE_MIB * MiB
    src = work / "layer"
    h = hashlib.sha256()
    with open(src, "wb") as f:
        for _ in range(SIZE_MIB):
            b = os.urandom(MiB)
            h.update(b)
            f.write(b)
    digest = "sha256:" + h.hexdigest()
    repo.put_layer(digest, src)
    src.unlink()
    times: list[float] = []
    async with trio.open_nursery() as nursery:
        caches = [await start_node(nursery, work, f"n{i}", repo, sched, p2p) for i in range(n)]
        t0 = time.perf_counter()
        if burst:
            async with trio.open_nursery() as readers:
                for c in caches:
                    async def go(c: LayerCache = c) -> None:
                        times.append(await trio.to_thread.run_sync(read_layer, c, digest, size))
                    readers.start_soon(go)
        else:
            for c in caches:
                times.append(await trio.to_thread.run_sync(read_layer, c, digest, size))
                await trio.sleep(0.3)  # its announcement lands (every 0.1 s)
        wall = time.perf_counter() - t0
        stats = [c.stats() for c in caches]
        nursery.cancel_scope.cancel()
    shutil.rmtree(work, ignore_errors=True)
    failures: dict[str, int] = {}
    for st in stats:
        for k, v in st.peer_failures.items():
            failures[k] = failures.get(k, 0) + v
    return {"nodes": n, "p2p": p2p, "mode": "burst" if burst else "staggered", "layer_mib": SIZE_MIB,
            "repository_mib": round(repo.bytes_read / MiB, 1),
            "repository_x_layer": round(repo.bytes_read / size, 2),
            "peer_mib": round(sum(st.peer_bytes for st in stats) / MiB, 1),
            "peer_failures": {k: v for k, v in failures.items() if v},
            "read_s_max": round(max(times), 2), "read_s_mean": round(sum(times) / len(times), 2),
            "wall_s": round(wall, 2)}


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    tmp = Path(tempfile.mkdtemp(prefix="aenv-bench-p2p-"))
    sock = tmp / "redis.sock"
    rproc = subprocess.Popen([shutil.which("redis-server") or "redis-server", "--port", "0", "--unixsocket",
                              str(sock), "--save", "", "--appendonly", "no", "--dir", str(tmp)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while not sock.exists():
        time.sleep(0.02)
    (tmp / "key").write_text(KEY)
    port = free_port()
    sproc = subprocess.Popen([sys.executable, "-m", "aenv_node.cli.node", "scheduler", "--listen",
                              f"127.0.0.1:{port}", "--redis", f"unix://{sock}", "--api-key-file", str(tmp / "key"),
                              "--log-level", "warning"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             env={k: v for k, v in os.environ.items() if not k.startswith("AENV_")})
    sched = f"http://127.0.0.1:{port}"
    results: dict[str, Any] = {"bench": "p2p", "at": utc_now(), "layer_mib": SIZE_MIB, "cpus": os.cpu_count(),
                               "runs": []}
    try:
        while True:
            try:
                if httpx.get(f"{sched}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.05)
        for n in (1, 2, 4, 8):
            for p2p, burst in ((False, False), (True, False), (True, True)):
                run = trio.run(one_run, tmp, sched, n, p2p, burst)
                results["runs"].append(run)
                print(f"{n} nodes, {run['mode']:9s} P2P {'on ' if p2p else 'off'}: repository "
                      f"{run['repository_mib']:8.1f} MiB ({run['repository_x_layer']}x the layer), peers "
                      f"{run['peer_mib']:8.1f} MiB, read max {run['read_s_max']} s, failures {run['peer_failures']}",
                      flush=True)
    finally:
        sproc.terminate()
        sproc.wait(15)
        rproc.terminate()
        rproc.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)
    out = result_path("p2p")
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
