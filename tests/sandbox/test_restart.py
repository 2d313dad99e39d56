"""Paused sandboxes survive a node restart, kill -9 included; running ones are reconciled."""

from __future__ import annotations

import os
import random
import shutil
import signal
import time
from pathlib import Path

import pytest
from e2b import Sandbox

from ..conftest import free_pool_cidr, free_port
from .conftest import NodeProcess, start_node, stop_node

pytestmark = pytest.mark.vm


def _start(state: Path, port: int, pool: str, **extra_env: str) -> NodeProcess:
    return start_node(state, port=port, pool=pool, AENV_NET_WARM_SLOTS="1", **extra_env)


def test_paused_sandbox_survives_kill_9_and_resumes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = Path("/var/tmp") / f"aenv-restart-{os.getpid()}-{random.randrange(10**6)}"
    pool = free_pool_cidr()
    port = free_port()
    node = _start(state, port, pool)
    try:
        for k, v in node.sdk_env().items():
            monkeypatch.setenv(k, v)
        paused = Sandbox.create()
        paused.files.write("/home/user/durable.txt", "survives kill -9")
        paused.pause()
        running = Sandbox.create()
        running_pid = node.sql(f"SELECT vmm_pid FROM sandboxes WHERE id = '{running.sandbox_id}'")[0][0]
        builds = node.sql("SELECT count(*) FROM template_builds")[0][0]

        node.proc.send_signal(signal.SIGKILL)
        node.proc.wait()
        node = _start(state, port, pool)

        # the template was not rebuilt; the running sandbox's orphaned VMM was reconciled away
        assert node.sql("SELECT count(*) FROM template_builds")[0][0] == builds
        assert node.sql(f"SELECT state FROM sandboxes WHERE id = '{running.sandbox_id}'") == [("killed",)]
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{running_pid}") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not os.path.exists(f"/proc/{running_pid}") or \
            running.sandbox_id.encode() not in Path(f"/proc/{running_pid}/cmdline").read_bytes()
        assert not (state / "sandboxes" / running.sandbox_id).exists()  # its upper went with it

        back = Sandbox.connect(paused.sandbox_id)
        assert back.files.read("/home/user/durable.txt") == "survives kill -9"
        assert back.commands.run("echo alive").stdout == "alive\n"
        back.kill()
    finally:
        stop_node(node.proc)
        shutil.rmtree(state, ignore_errors=True)


def test_periodic_snapshot_turns_a_crash_into_a_pause(monkeypatch: pytest.MonkeyPatch) -> None:
    state = Path("/var/tmp") / f"aenv-periodic-{os.getpid()}-{random.randrange(10**6)}"
    pool = free_pool_cidr()
    port = free_port()
    node = _start(state, port, pool, AENV_SNAPSHOT_PERIODIC_INTERVAL_S="2")
    try:
        for k, v in node.sdk_env().items():
            monkeypatch.setenv(k, v)
        sb = Sandbox.create()
        sb.files.write("/home/user/progress.txt", "step 41")
        deadline = time.monotonic() + 60
        count = lambda: node.sql(  # noqa: E731
            f"SELECT count(*) FROM snapshots WHERE source_sandbox_id = '{sb.sandbox_id}' "
            "AND kind = 'periodic' AND status = 'committed'")[0][0]
        first = node.sql(f"SELECT count(*) FROM events WHERE sandbox_id = '{sb.sandbox_id}' "
                         "AND operation = 'snapshot_commit'")[0][0]
        while time.monotonic() < deadline:
            done = node.sql(f"SELECT count(*) FROM events WHERE sandbox_id = '{sb.sandbox_id}' "
                            "AND operation = 'snapshot_commit'")[0][0]
            if done >= first + 2:  # a periodic snapshot taken after the write above
                break
            time.sleep(0.5)
        assert count() == 1  # older periodic snapshots are retired
        assert sb.commands.run("echo still running").stdout == "still running\n"

        node.proc.send_signal(signal.SIGKILL)
        node.proc.wait()
        node = _start(state, port, pool)
        assert node.sql(f"SELECT state FROM sandboxes WHERE id = '{sb.sandbox_id}'") == [("paused",)]
        back = Sandbox.connect(sb.sandbox_id)
        assert back.files.read("/home/user/progress.txt") == "step 41"
        back.kill()
    finally:
        stop_node(node.proc)
        shutil.rmtree(state, ignore_errors=True)


def test_second_node_resumes_a_sandbox_paused_on_the_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two node processes with their own state directories share a posix_fs repository: a sandbox paused
    on the first resumes on the second (cold local cache, layers fetched on demand)."""

    tag = f"{os.getpid()}-{random.randrange(10**6)}"
    repo = Path("/var/tmp") / f"aenv-shared-repo-{tag}"
    states = [Path("/var/tmp") / f"aenv-node{i}-{tag}" for i in (1, 2)]
    pools = [free_pool_cidr()]
    while len(pools) < 2:
        cand = free_pool_cidr()
        if cand not in pools:
            pools.append(cand)
    nodes = []
    try:
        first = _start(states[0], free_port(), pools[0], AENV_STORAGE_REPOSITORY_PATH=str(repo))
        nodes.append(first)
        for k, v in first.sdk_env().items():
            monkeypatch.setenv(k, v)
        sb = Sandbox.create(metadata={"origin": "node1"})
        sb.files.write("/home/user/travels.txt", "paused on node 1")
        sb.pause()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not first.sql(
                f"SELECT 1 FROM events WHERE sandbox_id = '{sb.sandbox_id}' AND operation = 'snapshot_publish'"):
            time.sleep(0.5)
        assert first.sql(f"SELECT count(*) FROM events WHERE sandbox_id = '{sb.sandbox_id}' "
                         "AND operation = 'snapshot_publish'")[0][0] == 1, first.log()[-2000:]
        stop_node(first.proc)

        second = _start(states[1], free_port(), pools[1], AENV_STORAGE_REPOSITORY_PATH=str(repo))
        nodes.append(second)
        for k, v in second.sdk_env().items():
            monkeypatch.setenv(k, v)
        assert second.sql(f"SELECT count(*) FROM sandboxes WHERE id = '{sb.sandbox_id}'") == [(0,)]
        back = Sandbox.connect(sb.sandbox_id)
        assert back.files.read("/home/user/travels.txt") == "paused on node 1"
        assert back.commands.run("echo on node 2").stdout == "on node 2\n"
        assert back.get_info().metadata == {"origin": "node1"}
        back.kill()
        stop_node(second.proc)  # the cache's counters are flushed on close (else every 5 s)
        fetched, misses = second.sql("SELECT sum(fetched_bytes), sum(misses) FROM cache_entries")[0]
        assert misses and misses > 0 and fetched > 0  # layers came through the cache, on demand
    finally:
        for n in nodes:
            stop_node(n.proc)
        for d in [repo, *states]:
            shutil.rmtree(d, ignore_errors=True)
