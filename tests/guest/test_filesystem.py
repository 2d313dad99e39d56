"""filesystem.Filesystem over raw HTTP: entries, errors, watching."""

from __future__ import annotations

import os
import threading
import time

import pytest

from .conftest import EnvdProcess, GuestUser, basic_auth, envelope, iter_envelopes, rpc, stream_rpc

FS = "filesystem.Filesystem/"


def inotify_fds(envd: EnvdProcess) -> int:
    """How many inotify instances the envd process holds."""
    fd_dir = f"/proc/{envd.proc.pid}/fd"
    count = 0
    for fd in os.listdir(fd_dir):
        try:
            if os.readlink(os.path.join(fd_dir, fd)) == "anon_inode:inotify":
                count += 1
        except OSError:  # closed while we looked
            pass
    return count


def settled_inotify_fds(envd: EnvdProcess) -> int:
    """Wait for watches of earlier tests (closed asynchronously) to go; then count."""
    deadline = time.monotonic() + 5
    while (count := inotify_fds(envd)) and time.monotonic() < deadline:
        time.sleep(0.02)
    return count


def test_stat_file_dir_symlink(envd: EnvdProcess, workdir: str, test_user: GuestUser) -> None:
    f = os.path.join(workdir, "f.txt")
    with open(f, "wb") as fh:
        fh.write(b"12345")
    os.chmod(f, 0o640)
    os.symlink(f, os.path.join(workdir, "link"))
    os.symlink("/nonexistent", os.path.join(workdir, "dangling"))
    with envd.client() as c:
        e = rpc(c, FS + "Stat", {"path": f}).json()["entry"]
        assert e["name"] == "f.txt" and e["path"] == f and e["type"] == "FILE_TYPE_FILE"
        assert e["size"] == "5" and e["mode"] == 0o640 and e["permissions"] == "-rw-r-----"
        assert e["owner"] == "root" and e["group"] == "root"
        assert e["modifiedTime"].endswith("Z")
        d = rpc(c, FS + "Stat", {"path": workdir}).json()["entry"]
        assert d["type"] == "FILE_TYPE_DIRECTORY" and d["permissions"].startswith("d") and d["owner"] == test_user.name
        link = rpc(c, FS + "Stat", {"path": os.path.join(workdir, "link")}).json()["entry"]
        assert link["type"] == "FILE_TYPE_FILE" and link["symlinkTarget"] == f and link["isSymlink"] is True
        assert link["permissions"].startswith("L")
        dangling = rpc(c, FS + "Stat", {"path": os.path.join(workdir, "dangling")}).json()["entry"]
        assert dangling["type"] == "FILE_TYPE_UNSPECIFIED" and "symlinkTarget" not in dangling
        # relative to the user's home, and ~
        rel = os.path.relpath(f, test_user.home)
        assert rpc(c, FS + "Stat", {"path": rel}).json()["entry"]["path"] == f
        assert rpc(c, FS + "Stat", {"path": "~/" + rel}).json()["entry"]["path"] == f
        r = rpc(c, FS + "Stat", {"path": "~other/x"})
        assert r.status_code == 400 and r.json()["code"] == "invalid_argument"
        r = rpc(c, FS + "Stat", {"path": os.path.join(workdir, "missing")})
        assert r.status_code == 404 and r.json()["code"] == "not_found"
        r = rpc(c, FS + "Stat", {"path": "x"}, authorization=basic_auth("no-such-user-x"))
        assert r.status_code == 401 and r.json()["code"] == "unauthenticated"


def test_make_dir(envd: EnvdProcess, workdir: str, test_user: GuestUser) -> None:
    target = os.path.join(workdir, "a", "b", "c")
    with envd.client() as c:
        r = rpc(c, FS + "MakeDir", {"path": target})
        assert r.json() == {"entry": {"name": "c", "type": "FILE_TYPE_DIRECTORY", "path": target}}
        for p in (os.path.join(workdir, "a"), target):
            st = os.stat(p)
            assert (st.st_uid, st.st_gid) == (test_user.uid, test_user.gid)
        r = rpc(c, FS + "MakeDir", {"path": target})
        assert r.status_code == 409 and r.json()["code"] == "already_exists"
        open(os.path.join(workdir, "file"), "w").close()
        r = rpc(c, FS + "MakeDir", {"path": os.path.join(workdir, "file")})
        assert r.status_code == 400 and r.json()["code"] == "invalid_argument"
        r = rpc(c, FS + "MakeDir", {"path": "/tmp/x-as-root"}, authorization=basic_auth("root"))
        assert r.status_code == 200
    os.rmdir("/tmp/x-as-root")


def test_move_and_remove(envd: EnvdProcess, workdir: str) -> None:
    src = os.path.join(workdir, "src.txt")
    with open(src, "w") as fh:
        fh.write("x")
    dst = os.path.join(workdir, "new", "dst.txt")
    with envd.client() as c:
        e = rpc(c, FS + "Move", {"source": src, "destination": dst}).json()["entry"]
        assert e["path"] == dst and e["name"] == "dst.txt" and e["type"] == "FILE_TYPE_FILE"
        assert not os.path.exists(src) and open(dst).read() == "x"
        r = rpc(c, FS + "Move", {"source": src, "destination": dst})
        assert r.status_code == 404 and r.json()["code"] == "not_found"
        assert rpc(c, FS + "Remove", {"path": os.path.join(workdir, "new")}).json() == {}
        assert not os.path.exists(os.path.join(workdir, "new"))
        assert rpc(c, FS + "Remove", {"path": os.path.join(workdir, "gone")}).status_code == 200


def test_list_dir_depth_and_errors(envd: EnvdProcess, workdir: str) -> None:
    os.makedirs(os.path.join(workdir, "B", "inner", "deep"))
    open(os.path.join(workdir, "a.txt"), "w").close()
    open(os.path.join(workdir, "B", "inner", "x"), "w").close()
    os.symlink(os.path.join(workdir, "B"), os.path.join(workdir, "linkdir"))
    with envd.client() as c:
        names = [e["name"] for e in rpc(c, FS + "ListDir", {"path": workdir}).json()["entries"]]
        assert names == ["B", "linkdir", "a.txt"]  # directories first (linkdir points to one), then by name
        two = [e["path"] for e in rpc(c, FS + "ListDir", {"path": workdir, "depth": 2}).json()["entries"]]
        assert os.path.join(workdir, "B", "inner") in two and os.path.join(workdir, "B", "inner", "x") not in two
        three = [e["path"] for e in rpc(c, FS + "ListDir", {"path": workdir, "depth": 3}).json()["entries"]]
        assert os.path.join(workdir, "B", "inner", "x") in three
        via_link = rpc(c, FS + "ListDir", {"path": os.path.join(workdir, "linkdir")}).json()["entries"]
        assert [e["path"] for e in via_link] == [os.path.join(workdir, "linkdir", "inner")]
        r = rpc(c, FS + "ListDir", {"path": os.path.join(workdir, "a.txt")})
        assert r.status_code == 400 and r.json()["code"] == "invalid_argument"
        r = rpc(c, FS + "ListDir", {"path": os.path.join(workdir, "nope")})
        assert r.status_code == 404 and r.json()["code"] == "not_found"
        assert rpc(c, FS + "ListDir", {"path": os.path.join(workdir, "B", "inner", "deep")}).json() == {"entries": []}


def test_watch_dir_stream(envd: EnvdProcess, workdir: str) -> None:
    events: list[dict] = []
    ready = threading.Event()

    def watch() -> None:
        with envd.client() as c, c.stream("POST", "/" + FS + "WatchDir", content=envelope(
                {"path": workdir, "recursive": True, "includeEntry": True}),
                headers={"content-type": "application/connect+json", "keepalive-ping-interval": "0.3"}) as response:
            for _flags, msg in iter_envelopes(response):
                if "start" in msg:
                    ready.set()
                    continue
                events.append(msg)
                if msg.get("filesystem", {}).get("name") == "stop":
                    return

    t = threading.Thread(target=watch)
    t.start()
    assert ready.wait(10)
    os.mkdir(os.path.join(workdir, "sub"))
    time.sleep(0.2)
    with open(os.path.join(workdir, "sub", "f"), "w") as fh:
        fh.write("data")
    os.rename(os.path.join(workdir, "sub", "f"), os.path.join(workdir, "sub", "g"))
    os.chmod(os.path.join(workdir, "sub", "g"), 0o600)
    time.sleep(0.7)
    os.remove(os.path.join(workdir, "sub", "g"))
    open(os.path.join(workdir, "stop"), "w").close()
    t.join(10)
    assert not t.is_alive()
    fs = [(e["filesystem"]["name"], e["filesystem"]["type"]) for e in events if "filesystem" in e]
    for expected in [("sub", "EVENT_TYPE_CREATE"), ("sub/f", "EVENT_TYPE_CREATE"), ("sub/f", "EVENT_TYPE_WRITE"),
                     ("sub/f", "EVENT_TYPE_RENAME"), ("sub/g", "EVENT_TYPE_CREATE"), ("sub/g", "EVENT_TYPE_CHMOD"),
                     ("sub/g", "EVENT_TYPE_REMOVE")]:
        assert expected in fs, (expected, fs)
    assert any("keepalive" in e for e in events)
    created = [e["filesystem"] for e in events if e.get("filesystem", {}).get("name") == "sub/g"
               and e["filesystem"]["type"] == "EVENT_TYPE_CREATE"][0]
    assert created["entry"]["path"] == os.path.join(workdir, "sub", "g")


def test_watch_dir_non_recursive_ignores_subdirs(envd: EnvdProcess, workdir: str) -> None:
    os.mkdir(os.path.join(workdir, "sub"))
    before = settled_inotify_fds(envd)
    with envd.client() as c:
        wid = rpc(c, FS + "CreateWatcher", {"path": workdir}).json()["watcherId"]
        assert inotify_fds(envd) == before + 1
        open(os.path.join(workdir, "sub", "inner"), "w").close()
        open(os.path.join(workdir, "top"), "w").close()
        time.sleep(0.2)
        events = rpc(c, FS + "GetWatcherEvents", {"watcherId": wid}).json()["events"]
        assert ("top", "EVENT_TYPE_CREATE") in [(e["name"], e["type"]) for e in events]
        assert all(not e["name"].startswith("sub/") for e in events)
        assert rpc(c, FS + "GetWatcherEvents", {"watcherId": wid}).json() == {"events": []}
        assert rpc(c, FS + "RemoveWatcher", {"watcherId": wid}).json() == {}
        assert inotify_fds(envd) == before
        for method in ("GetWatcherEvents", "RemoveWatcher"):
            r = rpc(c, FS + method, {"watcherId": wid})
            assert r.status_code == 404 and r.json()["code"] == "not_found"


@pytest.mark.parametrize("method", ["CreateWatcher", "WatchDir"])
def test_watch_errors(envd: EnvdProcess, workdir: str, method: str) -> None:
    open(os.path.join(workdir, "file"), "w").close()
    cases = [(os.path.join(workdir, "missing"), "not_found"), (os.path.join(workdir, "file"), "invalid_argument")]
    with envd.client() as c:
        for path, code in cases:
            if method == "WatchDir":
                messages = stream_rpc(c, FS + method, {"path": path})
                assert len(messages) == 1 and messages[0][1]["error"]["code"] == code
            else:
                assert rpc(c, FS + method, {"path": path}).json()["code"] == code


def test_watch_stream_released_when_client_leaves(envd: EnvdProcess, workdir: str) -> None:
    """A vanished client must not leave its inotify instance (or socket) behind."""
    before = settled_inotify_fds(envd)
    with envd.client() as c, c.stream("POST", "/" + FS + "WatchDir", content=envelope({"path": workdir}),
                                      headers={"content-type": "application/connect+json"}) as response:
        events = iter_envelopes(response)  # kept referenced: dropping it closes the connection
        assert "start" in next(events)[1]
        assert inotify_fds(envd) == before + 1
    deadline = time.monotonic() + 5
    while inotify_fds(envd) != before:
        assert time.monotonic() < deadline, "inotify fd leaked after the client left"
        time.sleep(0.05)
