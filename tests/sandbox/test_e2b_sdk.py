"""The unmodified E2B Python SDK against a real node: sandboxes are real QEMU VMs."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from e2b import CommandExitException, FileType, NotFoundException, Sandbox, SandboxQuery

pytestmark = pytest.mark.vm


@pytest.fixture
def sandbox(sdk_env):
    sb = Sandbox.create(metadata={"test": "e2b-sdk"}, envs={"GREETING": "bonjour"})
    try:
        yield sb
    finally:
        sb.kill()


def test_quickstart(sdk_env) -> None:
    """The README quickstart, unmodified."""
    sandbox = Sandbox.create()
    try:
        result = sandbox.commands.run("echo hi")
        assert result.stdout == "hi\n" and result.exit_code == 0
        sandbox.files.write("/home/user/hello.txt", "hello from the host")
        assert sandbox.files.read("/home/user/hello.txt") == "hello from the host"
        ids = [s.sandbox_id for s in Sandbox.list().next_items()]
        assert sandbox.sandbox_id in ids
    finally:
        assert sandbox.kill() is True
    assert sandbox.sandbox_id not in [s.sandbox_id for s in Sandbox.list().next_items()]


def test_commands_foreground_env_user_and_exit_codes(sandbox) -> None:
    r = sandbox.commands.run("echo $GREETING $EXTRA; whoami; pwd", envs={"EXTRA": "monde"})
    assert r.stdout.split("\n")[:3] == ["bonjour monde", "user", "/home/user"]
    assert sandbox.commands.run("whoami", user="root").stdout.strip() == "root"
    with pytest.raises(CommandExitException) as info:
        sandbox.commands.run("echo oops >&2; exit 7")
    assert info.value.exit_code == 7 and "oops" in info.value.stderr
    big = sandbox.commands.run("head -c 300000 /dev/zero | tr '\\0' x")
    assert big.stdout == "x" * 300000


def test_background_stdin_list_and_kill(sandbox) -> None:
    h = sandbox.commands.run("cat", background=True, stdin=True)
    sandbox.commands.send_stdin(h.pid, "through stdin\n")
    assert h.pid in [p.pid for p in sandbox.commands.list()]
    sandbox.commands.close_stdin(h.pid)
    assert h.wait().stdout == "through stdin\n"
    sleeper = sandbox.commands.run("sleep 600", background=True)
    assert sleeper.pid in [p.pid for p in sandbox.commands.list()]
    assert sandbox.commands.kill(sleeper.pid) is True
    with pytest.raises(CommandExitException) as info:
        sleeper.wait()
    assert info.value.exit_code == -1 and "killed" in (info.value.error or "")
    assert sandbox.commands.kill(sleeper.pid) is False
    assert sleeper.pid not in [p.pid for p in sandbox.commands.list()]
    counter = sandbox.commands.run("for i in $(seq 1 3); do echo tick $i; sleep 0.2; done", background=True)
    out = counter.wait()
    assert out.stdout.splitlines() == ["tick 1", "tick 2", "tick 3"]


def test_files_write_read_list_watch(sandbox) -> None:
    sandbox.files.make_dir("/home/user/proj/sub")
    sandbox.files.write("/home/user/proj/a.bin", bytes(range(256)) * 400)
    assert sandbox.files.read("/home/user/proj/a.bin", format="bytes") == bytes(range(256)) * 400
    names = sorted(e.name for e in sandbox.files.list("/home/user/proj"))
    assert names == ["a.bin", "sub"]
    info = sandbox.files.get_info("/home/user/proj/sub")
    assert info.type == FileType.DIR
    sandbox.files.rename("/home/user/proj/a.bin", "/home/user/proj/b.bin")
    assert sandbox.files.exists("/home/user/proj/b.bin")
    assert not sandbox.files.exists("/home/user/proj/a.bin")
    events = []
    handle = sandbox.files.watch_dir("/home/user/proj")
    try:
        sandbox.files.write("/home/user/proj/new.txt", "x")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not any(e.name == "new.txt" for e in events):
            events += handle.get_new_events()
            time.sleep(0.2)
    finally:
        handle.stop()
    assert any(e.name == "new.txt" for e in events)
    sandbox.files.remove("/home/user/proj")
    with pytest.raises(NotFoundException):
        sandbox.files.read("/home/user/proj/b.bin")


def test_list_metadata_info_and_timeout(sdk_env) -> None:
    tag = uuid.uuid4().hex
    a = Sandbox.create(metadata={"run": tag, "who": "a"})
    b = Sandbox.create(metadata={"run": tag, "who": "b"})
    try:
        found = Sandbox.list(query=SandboxQuery(metadata={"run": tag})).next_items()
        assert sorted(s.sandbox_id for s in found) == sorted([a.sandbox_id, b.sandbox_id])
        only_b = Sandbox.list(query=SandboxQuery(metadata={"run": tag, "who": "b"})).next_items()
        assert [s.sandbox_id for s in only_b] == [b.sandbox_id]
        info = a.get_info()
        assert info.metadata == {"run": tag, "who": "a"} and info.template_id == "base"
        a.set_timeout(1234)
        left = (a.get_info().end_at - a.get_info().started_at).total_seconds()
        assert left > 1000
        assert a.is_running()
    finally:
        a.kill()
        b.kill()
    assert Sandbox.kill(a.sandbox_id) is False


def test_connect_to_running_sandbox_and_errors(sandbox, sdk_env) -> None:
    same = Sandbox.connect(sandbox.sandbox_id)
    assert same.commands.run("echo again").stdout == "again\n"
    with pytest.raises(Exception) as info:
        Sandbox.connect("inotthere")
    assert "not found" in str(info.value).lower()


def _wait_state(node, sid: str, state: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if node.sql(f"SELECT state FROM sandboxes WHERE id = '{sid}'") == [(state,)]:
            return
        time.sleep(0.3)
    raise AssertionError(f"{sid} not {state}: {node.sql(f'SELECT state FROM sandboxes WHERE id = {sid!r}')}")


def test_ttl_kills_when_on_timeout_is_kill(sdk_env) -> None:
    sb = Sandbox.create(timeout=3, lifecycle={"on_timeout": "kill"})
    _wait_state(sdk_env, sb.sandbox_id, "killed")
    assert not sb.is_running()
    ops = [r[0] for r in sdk_env.sql(
        f"SELECT operation FROM events WHERE sandbox_id = '{sb.sandbox_id}' ORDER BY id")]
    assert "timeout" in ops


def test_concurrent_creates(sdk_env) -> None:
    made: list[Sandbox] = []
    errors: list[BaseException] = []

    def one() -> None:
        try:
            s = Sandbox.create()
            made.append(s)
            assert s.commands.run("echo ok").stdout == "ok\n"
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=one) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for s in made:
        s.kill()
    assert not errors and len(made) == 3
    assert len({s.sandbox_id for s in made}) == 3


def test_metrics_and_network_policy_update(sandbox, sdk_env) -> None:
    metrics = sandbox.get_metrics()
    assert metrics and metrics[-1].mem_total > 256 * 2**20 and metrics[-1].cpu_count >= 1
    assert 0 < metrics[-1].disk_used < metrics[-1].disk_total
    with sdk_env.api() as api:
        r = api.put(f"/sandboxes/{sandbox.sandbox_id}/network",
                    json={"allowOut": ["198.18.0.0/24"], "denyOut": ["0.0.0.0/0"]})
        assert r.status_code == 204, r.text
        assert api.get(f"/sandboxes/{sandbox.sandbox_id}").json()["network"] == \
            {"allowOut": ["198.18.0.0/24"], "denyOut": ["0.0.0.0/0"]}
        r = api.put(f"/sandboxes/{sandbox.sandbox_id}/network", json={"denyOut": ["not-an-address!"]})
        assert r.status_code == 400 and r.json()["code"] == 400
        r = api.put("/sandboxes/inope/network", json={"denyOut": ["0.0.0.0/0"]})
        assert r.status_code == 404
    # the sandbox still works after a policy change
    assert sandbox.commands.run("echo ok").stdout == "ok\n"
