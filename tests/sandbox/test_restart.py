"""Paused sandboxes survive a node restart, kill -9 included; running ones are reconciled."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import time
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox

from ..conftest import free_pool_cidr, free_port
from .conftest import NodeProcess, start_node, stop_node

pytestmark = pytest.mark.vm


def _start(state: Path, port: int, pool: str, **extra_env: str) -> NodeProcess:
    # without a data plane: its running sandboxes die with the node (test_data_plane.py: with one, they do not)
    return start_node(state, port=port, pool=pool, AENV_NET_WARM_SLOTS="1", AENV_NODE_DATA_PLANE="false",
                      **extra_env)


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
        periodic = node.sql(f"SELECT snapshot_id FROM sandboxes WHERE id = '{sb.sandbox_id}'")[0][0]
        # published like a pause: the repository's record says paused at that snapshot (another node may
        # resume it), not running here
        record = state / "repository" / "manifests" / f"sandbox-{sb.sandbox_id}.json"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not record.exists():
            time.sleep(0.5)
        doc = json.loads(record.read_text())
        assert (doc["snapshot_id"], doc["state"]) == (periodic, "paused"), doc
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


def _pointer(repo: Path, sandbox_id: str) -> dict | None:
    """The sandbox's record in a posix_fs repository (pointer + ownership), or None."""
    import json

    p = repo / "manifests" / f"sandbox-{sandbox_id}.json"
    return json.loads(p.read_text()) if p.exists() else None


def _wait_publishes(node: NodeProcess, sandbox_id: str, count: int, timeout: float = 180) -> list[str]:
    """Wait for ``count`` snapshot_publish events of the sandbox on ``node``; their ``detail`` JSON."""
    deadline = time.monotonic() + timeout
    q = (f"SELECT detail FROM events WHERE sandbox_id = '{sandbox_id}' AND operation = 'snapshot_publish' "
         "ORDER BY id")
    while time.monotonic() < deadline and len(node.sql(q)) < count:
        time.sleep(0.5)
    rows = [r[0] for r in node.sql(q)]
    assert len(rows) >= count, node.log()[-3000:]
    return rows


def test_only_one_node_runs_a_sandbox_shared_through_the_repository(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two live nodes share a posix_fs repository. A pauses a sandbox, B resumes it; A is then refused
    (409 naming B) and starts nothing; B pauses it and A resumes B's newer copy; a kill on the owner removes
    the record, and a kill racing a publish leaves none."""
    import json

    from e2b.exceptions import SandboxException

    tag = f"{os.getpid()}-{random.randrange(10**6)}"
    repo = Path("/var/tmp") / f"aenv-owner-repo-{tag}"
    states = [Path("/var/tmp") / f"aenv-owner-{n}-{tag}" for n in ("a", "b")]
    pools = [free_pool_cidr()]
    while len(pools) < 2:
        cand = free_pool_cidr()
        if cand not in pools:
            pools.append(cand)
    nodes: list[NodeProcess] = []

    def use(n: NodeProcess) -> None:
        for k, v in n.sdk_env().items():
            monkeypatch.setenv(k, v)

    try:
        a = _start(states[0], free_port(), pools[0], AENV_STORAGE_REPOSITORY_PATH=str(repo),
                   AENV_NODE_NODE_ID="node-a")
        nodes.append(a)
        b = _start(states[1], free_port(), pools[1], AENV_STORAGE_REPOSITORY_PATH=str(repo),
                   AENV_NODE_NODE_ID="node-b")
        nodes.append(b)

        # A creates and pauses it: the record says paused, owned by A
        use(a)
        sb = Sandbox.create()
        sid = sb.sandbox_id
        sb.files.write("/home/user/log.txt", "v1 on A")
        sb.pause()
        _wait_publishes(a, sid, 1)
        rec = _pointer(repo, sid)
        assert rec is not None and rec["state"] == "paused" and rec["owner"].startswith("node-a/"), rec
        gen_paused_on_a = rec["generation"]

        # B resumes it (imports it): the record says running on B
        use(b)
        on_b = Sandbox.connect(sid)
        assert on_b.files.read("/home/user/log.txt") == "v1 on A"
        on_b.files.write("/home/user/log.txt", "v2 on B")
        rec = _pointer(repo, sid)
        assert rec["state"] == "running" and rec["owner"].startswith("node-b/") \
            and rec["generation"] == gen_paused_on_a + 1, rec

        # A may not resume it now: 409 naming B, and A starts no VM
        use(a)
        with a.api() as c:
            r = c.post(f"/v2/sandboxes/{sid}/connect", json={})
        assert r.status_code == 409, r.text
        assert f"sandbox {sid} is running on node node-b/" in r.json()["message"]
        with pytest.raises(SandboxException, match="409.*running on node node-b/"):
            Sandbox.connect(sid)
        assert a.sql(f"SELECT state, vmm_pid FROM sandboxes WHERE id = '{sid}'") == [("paused", None)]
        assert a.sql(f"SELECT count(*) FROM events WHERE sandbox_id = '{sid}' AND to_state = 'resuming'") \
            == [(0,)]
        assert _pointer(repo, sid)["owner"].startswith("node-b/")  # untouched by the refusals

        # B pauses it: paused at B's snapshot, owned by B
        use(b)
        on_b.pause()
        _wait_publishes(b, sid, 1)
        b_snap = b.sql(f"SELECT snapshot_id FROM sandboxes WHERE id = '{sid}'")[0][0]
        rec = _pointer(repo, sid)
        assert rec["state"] == "paused" and rec["owner"].startswith("node-b/") and rec["snapshot_id"] == b_snap

        # A resumes it again: its own copy is stale, so it imports B's snapshot and sees B's write
        use(a)
        a_old_snap = a.sql(f"SELECT snapshot_id FROM sandboxes WHERE id = '{sid}'")[0][0]
        back = Sandbox.connect(sid)
        assert back.files.read("/home/user/log.txt") == "v2 on B"
        assert a_old_snap != b_snap
        assert a.sql(f"SELECT count(*) FROM events WHERE sandbox_id = '{sid}' AND operation = 'import'") \
            == [(1,)]
        assert _pointer(repo, sid)["owner"].startswith("node-a/")
        back.files.write("/home/user/log.txt", "v3 on A")
        back.pause()
        _wait_publishes(a, sid, 2)

        # B resumes A's newer copy, then kills it: the owner's kill removes the record
        use(b)
        last = Sandbox.connect(sid)
        assert last.files.read("/home/user/log.txt") == "v3 on A"
        assert _pointer(repo, sid)["owner"].startswith("node-b/")
        last.kill()
        assert _pointer(repo, sid) is None
        # ... and A's stale copy (published, record gone) does not come back
        use(a)
        with a.api() as c:
            r = c.post(f"/v2/sandboxes/{sid}/connect", json={})
        assert r.status_code == 404 and "killed on another node" in r.json()["message"], r.text
        assert a.sql(f"SELECT count(*) FROM events WHERE sandbox_id = '{sid}' AND to_state = 'resuming'") \
            == [(1,)]  # only the resume of B's copy above

        # a kill right after a pause races the background publish: no record survives either way
        racer = Sandbox.create()
        racer.files.write("/home/user/big.bin", "x" * (8 << 20))  # a bigger upper: a slower publish
        racer.pause()
        Sandbox.kill(racer.sandbox_id)
        assert _pointer(repo, racer.sandbox_id) is None
        deadline = time.monotonic() + 180
        snap = a.sql(f"SELECT snapshot_id FROM sandboxes WHERE id = '{racer.sandbox_id}'")[0][0]
        # a publish whose files went with the kill says so, as information (not as a failure)
        cut = f"publishing snapshot {snap} stopped: sandbox {racer.sandbox_id} was killed meanwhile"
        while time.monotonic() < deadline and not a.sql(
                f"SELECT 1 FROM events WHERE sandbox_id = '{racer.sandbox_id}' AND operation = 'snapshot_publish'") \
                and cut not in a.log():
            time.sleep(0.5)
        detail = a.sql(f"SELECT detail FROM events WHERE sandbox_id = '{racer.sandbox_id}' "
                       "AND operation = 'snapshot_publish'")
        print("publish racing the kill:", detail or "stopped (its files went with the kill)")
        assert detail or cut in a.log()  # the publish did end
        assert f"publishing snapshot {snap} failed" not in a.log()
        assert _pointer(repo, racer.sandbox_id) is None
        if detail:
            assert json.loads(detail[0][0])["pointer"] in ("killed", "written")
    finally:
        for name, n in zip("ab", nodes):
            stop_node(n.proc)
            try:  # for post-mortems: the state directories go away
                shutil.copy(n.log_path, Path("/var/tmp") / f"aenv-owner-last-node-{name}.log")
            except OSError:
                pass
        for d in [repo, *states]:
            shutil.rmtree(d, ignore_errors=True)


def test_graceful_stop_pauses_running_sandboxes_and_refuses_new_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGTERM never kills a sandbox: each running one is paused (its files and processes kept) and its
    pause published, while new operations get E2B's 503; the next start resumes them where they were."""
    state = Path("/var/tmp") / f"aenv-stop-{os.getpid()}-{random.randrange(10**6)}"
    pool = free_pool_cidr()
    port = free_port()
    node = _start(state, port, pool)
    try:
        for k, v in node.sdk_env().items():
            monkeypatch.setenv(k, v)
        boxes = [Sandbox.create(timeout=600) for _ in range(2)]
        for sb in boxes:
            sb.files.write("/home/user/kept.txt", f"kept by {sb.sandbox_id}")
            sb.commands.run("sleep 3600", background=True)
            # dirty memory, so the pauses (and with them the drain) take a while
            sb.commands.run("head -c 64M /dev/urandom > /dev/shm/ballast")

        node.proc.send_signal(signal.SIGTERM)
        answers: list[object] = []
        with node.api() as c:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                time.sleep(0.1)
                try:
                    r = c.post("/sandboxes", json={"templateID": "base"})
                except httpx.TransportError:
                    break  # the API is down: the stop is past its drain
                answers.append((r.status_code, r.json()))
        node.proc.wait(timeout=120)
        assert answers, "no request was answered while the node drained"
        assert {a[0] for a in answers} == {503}, answers  # type: ignore[index]
        assert all(set(a[1]) >= {"code", "message"} for a in answers)  # type: ignore[index]
        for sb in boxes:
            rows = node.sql(f"SELECT operation, to_state FROM events WHERE sandbox_id = '{sb.sandbox_id}' "
                            "AND subject = 'sandbox' ORDER BY id")
            assert ("node_stop", "pausing") in rows and rows[-1][1] == "paused", rows
            assert "killing" not in {r[1] for r in rows}, rows
            record = json.loads((state / "repository" / "manifests" / f"sandbox-{sb.sandbox_id}.json").read_text())
            assert record["state"] == "paused", record

        node = _start(state, port, pool)
        for sb in boxes:
            back = Sandbox.connect(sb.sandbox_id)
            assert back.files.read("/home/user/kept.txt") == f"kept by {sb.sandbox_id}"
            assert back.commands.run("pgrep -x sleep").exit_code == 0  # its process lived through the stop
            back.kill()
    finally:
        stop_node(node.proc)
        shutil.rmtree(state, ignore_errors=True)
