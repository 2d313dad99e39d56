"""Fixtures shared by every test folder: a state directory, a config, a live node."""

from __future__ import annotations

import ipaddress
import json
import os
import random
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator

import httpx
import pytest
import trio

from aenv_node.config import Config, load_config


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_pool_cidr() -> str:
    """A /24 for a test node's network slots that nothing on this host routes yet.

    From ``10.11.<first>-<last>.0`` where ``AENV_TEST_POOL_OCTETS`` is ``first-last`` (default 64-249). A whole
    run's two pytest processes get disjoint ranges (scripts/dev): a pool that one process's test holds while its
    node is stopped (the crash matrix restarts a node on its pool) is not routed then, and the other process
    took it once, so that the restarted node found its pool routed by another node."""
    first, last = (int(x) for x in os.environ.get("AENV_TEST_POOL_OCTETS", "64-249").split("-"))
    routes = json.loads(subprocess.run(["ip", "-j", "-4", "route", "show"], capture_output=True,
                                       text=True, check=True).stdout or "[]")
    used = [ipaddress.ip_network(r["dst"], strict=False) for r in routes
            if r.get("dst") not in (None, "", "default")]
    for _ in range(200):
        cand = ipaddress.ip_network(f"10.11.{random.randrange(first, last + 1)}.0/24")
        if not any(cand.overlaps(u) for u in used):
            return str(cand)
    raise RuntimeError(f"no free /24 in 10.11.{first}.0-10.11.{last}.255 for a test node")


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    d = tmp_path / "state"
    d.mkdir()
    return d


@pytest.fixture
def node_config(state_dir: Path) -> Config:
    return load_config(
        environ={},
        overrides={
            # in-process nodes run their disks and VMMs in the test's process (the data plane: test_data_plane)
            "node": {"state_dir": str(state_dir), "shutdown_grace_s": 5, "data_plane": False},
            "api": {"listen": f"127.0.0.1:{free_port()}"},
            "net": {"egress": False},
        },
    )


@dataclass
class LiveNode:
    url: str
    api_key: str
    node: object  # aenv_node.runtime.Node
    cancel: trio.CancelScope

    def client(self, *, key: str | None = None) -> httpx.AsyncClient:
        headers = {"X-API-KEY": self.api_key if key is None else key}
        return httpx.AsyncClient(base_url=self.url, headers=headers, timeout=30)


@pytest.fixture
async def live_node(node_config: Config) -> AsyncIterator[LiveNode]:
    """A node (supervisor + API server) running in this test's Trio run."""
    from aenv_node.api.server import ApiServer
    from aenv_node.runtime import Node, ensure_api_key, run_node
    from aenv_node.state import Database

    key, path = ensure_api_key(node_config)
    node = Node(node_config, Database(node_config.database_path), key, path)
    node.services.append(ApiServer(node))
    async with trio.open_nursery() as nursery:
        await nursery.start(lambda task_status: run_node(node, handle_signals=False, task_status=task_status))
        yield LiveNode(f"http://{node_config.api.listen}", key, node, nursery.cancel_scope)
        node.request_shutdown()
