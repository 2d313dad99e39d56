"""The unmodified E2B Python SDK (sync and async) driving a bare envd.

The SDK is pointed at envd without any control plane: a ``Sandbox`` object is
built with the constructor ``Sandbox.connect`` itself uses, its sandbox URL
set to envd's loopback address.
"""

from __future__ import annotations

import os
import time

import pytest
from e2b import (
    AsyncSandbox, CommandExitException, ConnectionConfig, FileType, InvalidArgumentException, NotFoundException,
    Sandbox, TimeoutException,
)
from e2b.exceptions import AuthenticationException
from e2b.sandbox.commands.command_handle import PtySize
from e2b.sandbox.filesystem.watch_handle import FilesystemEventType
from packaging.version import Version

from aenv_node.guest import __envd_version__

from .conftest import EnvdProcess, GuestUser, start_envd, stop_envd


def make_sandbox(envd: EnvdProcess, token: str | None = None, cls: type = Sandbox):
    headers = {"E2b-Sandbox-Id": "sbx-test", "E2b-Sandbox-Port": "49983"}
    if token is not None:
        headers["X-Access-Token"] = token
    config = ConnectionConfig(sandbox_url=envd.url, api_key="unused", extra_sandbox_headers=headers)
    return cls(
        sandbox_id="sbx-test", sandbox_domain=None, envd_version=Version(__envd_version__),
        envd_access_token=token, connection_config=config,
    )


@pytest.fixture(scope="module")
def sandbox(envd: EnvdProcess) -> Sandbox:
    return make_sandbox(envd)


def test_commands_run(sandbox: Sandbox, test_user: GuestUser) -> None:
    result = sandbox.commands.run("echo hello; echo oops >&2; whoami; pwd")
    assert result.exit_code == 0
    assert result.stdout == f"hello\n{test_user.name}\n{test_user.home}\n"
    assert result.stderr == "oops\n"


def test_commands_run_as_root_with_env_and_cwd(sandbox: Sandbox) -> None:
    result = sandbox.commands.run('echo "$(id -u) $X $PWD"', user="root", envs={"X": "y"}, cwd="/tmp")
    assert result.stdout == "0 y /tmp\n"


def test_commands_nonzero_exit(sandbox: Sandbox) -> None:
    with pytest.raises(CommandExitException) as info:
        sandbox.commands.run("echo bad >&2; exit 7")
    assert info.value.exit_code == 7
    assert info.value.stderr == "bad\n"


def test_commands_missing_cwd(sandbox: Sandbox) -> None:
    with pytest.raises(InvalidArgumentException):
        sandbox.commands.run("true", cwd="/nonexistent/dir")


def test_commands_timeout(sandbox: Sandbox) -> None:
    t0 = time.monotonic()
    with pytest.raises(TimeoutException):
        sandbox.commands.run("sleep 10", timeout=1)
    assert time.monotonic() - t0 < 5


def test_background_list_kill_connect(sandbox: Sandbox) -> None:
    handle = sandbox.commands.run("echo started; sleep 30", background=True)
    assert handle.pid in [p.pid for p in sandbox.commands.list()]
    again = sandbox.commands.connect(handle.pid)
    assert sandbox.commands.kill(handle.pid) is True
    with pytest.raises(CommandExitException) as info:
        again.wait()
    assert info.value.exit_code == -1
    assert sandbox.commands.kill(handle.pid) is False


def test_stdin(sandbox: Sandbox) -> None:
    handle = sandbox.commands.run("cat", background=True, stdin=True)
    handle.send_stdin("abc\n")
    sandbox.commands.send_stdin(handle.pid, "def\n")
    handle.close_stdin()
    result = handle.wait()
    assert result.stdout == "abc\ndef\n"


def test_pty(sandbox: Sandbox) -> None:
    output = bytearray()
    handle = sandbox.pty.create(PtySize(rows=24, cols=80))
    sandbox.pty.resize(handle.pid, PtySize(rows=30, cols=120))
    sandbox.pty.send_stdin(handle.pid, b"stty size; echo marker-$((6*7)); exit 3\n")
    with pytest.raises(CommandExitException) as info:
        handle.wait(on_pty=lambda data: output.extend(data))
    assert info.value.exit_code == 3
    assert b"30 120" in output and b"marker-42" in output


def test_files_write_read_list(sandbox: Sandbox, workdir: str, test_user: GuestUser) -> None:
    path = os.path.join(workdir, "sub", "a.txt")
    info = sandbox.files.write(path, "hello world")
    assert info.path == path and info.name == "a.txt"
    assert sandbox.files.read(path) == "hello world"
    assert bytes(sandbox.files.read(path, format="bytes")) == b"hello world"
    st = os.stat(os.path.dirname(path))
    assert (st.st_uid, st.st_gid) == (test_user.uid, test_user.gid)
    binary = bytes(range(256)) * 4096
    sandbox.files.write(os.path.join(workdir, "bin.dat"), binary)
    assert bytes(sandbox.files.read(os.path.join(workdir, "bin.dat"), format="bytes")) == binary
    entries = sandbox.files.list(workdir)
    assert [(e.name, e.type) for e in entries] == [("sub", FileType.DIR), ("bin.dat", FileType.FILE)]
    assert [e.name for e in sandbox.files.list(workdir, depth=2)] == ["sub", "a.txt", "bin.dat"]
    assert sandbox.files.exists(path) and not sandbox.files.exists(path + ".nope")
    got = sandbox.files.get_info(path)
    assert got.size == 11 and got.type == FileType.FILE and got.permissions == "-rw-r--r--"
    assert got.owner == test_user.name


def test_files_write_files_gzip_stream_metadata(sandbox: Sandbox, workdir: str) -> None:
    import io

    written = sandbox.files.write_files([
        {"path": os.path.join(workdir, "m1.txt"), "data": "one"},
        {"path": os.path.join(workdir, "m2.txt"), "data": b"two"},
    ])
    assert sorted(w.name for w in written) == ["m1.txt", "m2.txt"]
    big = os.urandom(3 * 1024 * 1024)
    sandbox.files.write(os.path.join(workdir, "gz.bin"), big, gzip=True)
    assert bytes(sandbox.files.read(os.path.join(workdir, "gz.bin"), format="bytes", gzip=True)) == big
    sandbox.files.write(os.path.join(workdir, "io.bin"), io.BytesIO(b"streamed"))
    assert sandbox.files.read(os.path.join(workdir, "io.bin")) == "streamed"
    info = sandbox.files.write(os.path.join(workdir, "meta.txt"), "x", metadata={"Owner": "alice", "k": "v"})
    assert info.metadata == {"owner": "alice", "k": "v"}
    assert sandbox.files.get_info(os.path.join(workdir, "meta.txt")).metadata == {"owner": "alice", "k": "v"}


def test_files_errors(sandbox: Sandbox, workdir: str) -> None:
    from e2b import FileNotFoundException

    with pytest.raises(FileNotFoundException):
        sandbox.files.read(os.path.join(workdir, "missing"))
    with pytest.raises(InvalidArgumentException):
        sandbox.files.read(workdir)
    with pytest.raises(NotFoundException):
        sandbox.files.list(os.path.join(workdir, "missing"))


def test_files_dirs_rename_remove(sandbox: Sandbox, workdir: str) -> None:
    d = os.path.join(workdir, "x", "y")
    assert sandbox.files.make_dir(d) is True
    assert sandbox.files.make_dir(d) is False
    sandbox.files.write(os.path.join(d, "f"), "data")
    moved = sandbox.files.rename(os.path.join(d, "f"), os.path.join(workdir, "z", "g"))
    assert moved.path == os.path.join(workdir, "z", "g")
    assert sandbox.files.read(moved.path) == "data"
    sandbox.files.remove(os.path.join(workdir, "x"))
    assert not os.path.exists(os.path.join(workdir, "x"))


def test_watch_dir_sync(sandbox: Sandbox, workdir: str) -> None:
    handle = sandbox.files.watch_dir(workdir, recursive=True)
    try:
        os.mkdir(os.path.join(workdir, "d"))
        time.sleep(0.2)  # the watch on a new sub-directory is added when its event is read
        with open(os.path.join(workdir, "d", "f.txt"), "w") as f:
            f.write("x")
        os.remove(os.path.join(workdir, "d", "f.txt"))
        time.sleep(0.2)
        events = handle.get_new_events()
    finally:
        handle.stop()
    seen = {(e.name, e.type) for e in events}
    assert ("d", FilesystemEventType.CREATE) in seen
    assert ("d/f.txt", FilesystemEventType.CREATE) in seen
    assert ("d/f.txt", FilesystemEventType.WRITE) in seen
    assert ("d/f.txt", FilesystemEventType.REMOVE) in seen


def test_signed_urls(envd: EnvdProcess, workdir: str) -> None:
    """Signed URLs need a token: a private envd with /init'ed token."""
    import httpx

    server = start_envd("root")
    try:
        with server.client() as c:
            assert c.post("/init", json={"accessToken": "tok-1"}).status_code == 204
        sbx = make_sandbox(server, token="tok-1")
        path = os.path.join(workdir, "signed.txt")
        up = sbx.upload_url(path, user="root", use_signature_expiration=60)
        r = httpx.post(up, files={"file": ("signed.txt", b"via url")})
        assert r.status_code == 200, r.text
        down = sbx.download_url(path, user="root")
        assert httpx.get(down).content == b"via url"
        assert httpx.get(down.replace("signature=v1_", "signature=v1_x")).status_code == 401
        bad = make_sandbox(server, token="wrong")
        with pytest.raises(AuthenticationException):
            bad.commands.run("true")
        assert sbx.commands.run("echo ok").stdout == "ok\n"
    finally:
        stop_envd(server)


def test_is_running(sandbox: Sandbox) -> None:
    assert sandbox.is_running() is True


def test_async_sdk_commands_and_watch(envd: EnvdProcess, workdir: str) -> None:
    """The async SDK (asyncio-only) uses the WatchDir stream instead of polled watchers."""
    import asyncio

    async def scenario() -> list:
        sandbox = make_sandbox(envd, cls=AsyncSandbox)
        result = await sandbox.commands.run("echo async")
        assert result.stdout == "async\n"
        events: list = []
        handle = await sandbox.files.watch_dir(workdir, on_event=events.append, include_entry=True)
        try:
            await sandbox.files.write(os.path.join(workdir, "w.txt"), "data")
            async with asyncio.timeout(5):
                while not any(e.name == "w.txt" for e in events):
                    await asyncio.sleep(0.05)
        finally:
            await handle.stop()
        return events

    events = asyncio.run(scenario())
    created = [e for e in events if e.name == "w.txt" and e.type == FilesystemEventType.CREATE]
    assert created and created[0].entry is not None and created[0].entry.path == os.path.join(workdir, "w.txt")


def test_unicode_and_spaces_in_paths(sandbox: Sandbox, workdir: str) -> None:
    path = os.path.join(workdir, "dir with space", "žluťoučký kůň.txt")
    sandbox.files.write(path, "ü")
    assert sandbox.files.read(path) == "ü"
    assert [e.name for e in sandbox.files.list(os.path.dirname(path))] == ["žluťoučký kůň.txt"]
    written = sandbox.files.write_files([{"path": os.path.join(workdir, "ünï", "ß.txt"), "data": "x"}])
    assert written[0].path == os.path.join(workdir, "ünï", "ß.txt")
    result = sandbox.commands.run(f"cat '{path}'")
    assert result.stdout == "ü"
