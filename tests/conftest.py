"""Fixtures shared by every test folder: a state directory, a config, a live node."""

from __future__ import annotations

import socket
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
    """A /24 for a test node's network slots that nothing on this host routes yet."""
    import ipaddress
    import json
    import random
    import subprocess

    routes = json.loads(subprocess.run(["ip", "-j", "-4", "route", "show"], capture_output=True,
                                       text=True, check=True).stdout or "[]")
    used = [ipaddress.ip_network(r["dst"], strict=False) for r in routes
            if r.get("dst") not in (None, "", "default")]
    for _ in range(200):
        cand = ipaddress.ip_network(f"10.11.{random.randrange(64, 250)}.0/24")
        if not any(cand.overlaps(u) for u in used):
            return str(cand)
    raise RuntimeError("no free /24 in 10.11.64.0-10.11.249.255 for a test node")


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
