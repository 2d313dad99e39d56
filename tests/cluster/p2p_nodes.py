"""Nodes for P2P tests and the P2P benchmark without VMs: each is a real LayerCache (with the real HTTP peer
client) behind the node's real API app on 127.0.0.1 serving the P2P route, the real heartbeat sender and the
real layer announcer, all in one Trio nursery (cancel its scope: the node is gone, its port refuses)."""

from __future__ import annotations

import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve

from aenv_node.api.app import create_app
from aenv_node.api.handlers.peers import layer_range_handler
from aenv_node.cluster import HeartbeatSender
from aenv_node.config import load_config
from aenv_node.dataplane import DataPlaneClient, serve_dataplane
from aenv_node.runtime import Node
from aenv_node.runtime.peers import LayerAnnouncer, held_layers, peer_options
from aenv_node.state import Database
from aenv_node.storage.cache import LayerCache
from aenv_node.storage.frontends import DiskFrontend, FrontendKind
from aenv_node.storage.repository import PosixFsRepository

from ..conftest import free_port

API_KEY = "cluster-key"


class CountingRepository(PosixFsRepository):
    """The real posix_fs repository, counting the layer bytes read from it (every node's cache shares one)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root, durable=False)
        self.bytes_read = 0
        self._count_lock = threading.Lock()

    def read_range(self, digest: str, offset: int, length: int) -> bytes:
        data = super().read_range(digest, offset, length)
        with self._count_lock:
            self.bytes_read += len(data)
        return data


@dataclass
class PeerNode:
    node_id: str
    cache: LayerCache
    scope: trio.CancelScope
    announcer: LayerAnnouncer | None
    #: with ``data_plane=True``: a real data plane serving in this test's run, with its own cache (the disks')
    dataplane: DataPlaneClient | None = None
    dataplane_cache: LayerCache | None = None
    run_dir: Path | None = None

    async def read(self, digest: str, offset: int, length: int) -> bytes:
        return await trio.to_thread.run_sync(self.cache.read, digest, offset, length)

    def kill(self) -> None:
        self.scope.cancel()


async def start_node(nursery: trio.Nursery, tmp: Path, node_id: str, repo: CountingRepository, scheduler_url: str,
                     *, p2p: bool = True, interval_s: float = 0.1, data_plane: bool = False,
                     **p2p_keys: Any) -> PeerNode:
    """A node (see the module docstring) started in ``nursery``; returns once it serves and has beaten once.
    ``data_plane``: also a data plane (``serve_dataplane``, with a cache of its own as ``aenv-node dataplane
    run`` makes it), which the node's route and announcements reach as a node's do (``node.data_plane``)."""
    port = free_port()
    cfg = load_config(environ={}, overrides={
        "node": {"state_dir": str(tmp / node_id), "node_id": node_id, "data_plane": False},
        "api": {"listen": f"127.0.0.1:{port}", "api_key": API_KEY},
        "net": {"egress": False},
        "cluster": {"scheduler_url": scheduler_url, "heartbeat_interval_s": interval_s},
        "p2p": {"enabled": p2p, "holders_ttl_s": 0.05, **p2p_keys},
    })
    cfg.state_dir.mkdir(parents=True)
    db = Database(cfg.database_path)
    await trio.to_thread.run_sync(db.upgrade)
    node = Node(cfg, db, API_KEY)
    options = peer_options(cfg, node_id, lambda: node.api_key)
    cache = await trio.to_thread.run_sync(lambda: LayerCache(
        cfg.cache_dir, repo, capacity_bytes=4 << 30, durable=False, peers=options))
    plane: DataPlaneClient | None = None
    plane_cache: LayerCache | None = None
    plane_options = None
    run_dir: Path | None = None
    if data_plane:
        run_dir = Path(tempfile.mkdtemp(prefix="aenv-p2p-dp-", dir="/tmp"))  # a unix socket's path is short
        plane_options = peer_options(cfg, node_id, lambda: node.api_key)
        plane_cache = await trio.to_thread.run_sync(lambda: LayerCache(
            cfg.cache_dir.with_name(cfg.cache_dir.name + "-dataplane"), repo, capacity_bytes=4 << 30,
            durable=False, peers=plane_options))
        plane = DataPlaneClient(run_dir, DiskFrontend(FrontendKind.NBD))
    app: Any = create_app(node, extra_handlers={
        "get_layer_range": layer_range_handler(lambda api: cache, lambda api: plane)})
    hc = HypercornConfig()
    hc.bind = [cfg.api.listen]
    hc.accesslog = None
    scope = trio.CancelScope()
    announcer = LayerAnnouncer(node, held_layers(lambda: cache, lambda: plane)) if options is not None else None

    async def run(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with scope:
            try:
                async with trio.open_nursery() as inner:
                    if run_dir is not None:
                        await inner.start(serve_dataplane, run_dir, plane_cache)
                    await inner.start(lambda task_status: serve(app, hc, shutdown_trigger=trio.sleep_forever,
                                                                task_status=task_status))
                    await inner.start(HeartbeatSender(node, slot_capacity=1).run)
                    if announcer is not None:
                        await inner.start(announcer.run)
                    task_status.started()
            finally:
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(cache.close)
                    if options is not None:
                        options.source.close()
                    if plane_cache is not None:
                        await trio.to_thread.run_sync(plane_cache.close)
                    if plane_options is not None:
                        plane_options.source.close()
                    if run_dir is not None:
                        shutil.rmtree(run_dir, ignore_errors=True)
                    db.close()

    await nursery.start(run)
    return PeerNode(node_id, cache, scope, announcer, plane, plane_cache, run_dir)
