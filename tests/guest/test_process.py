"""process.Process over raw HTTP: every RPC, its errors, and the process semantics."""

from __future__ import annotations

import base64
import hashlib
import os
import threading
import time

import pytest

from .conftest import (
    EnvdProcess, GuestUser, basic_auth, envelope, iter_envelopes, parse_envelopes, rpc, run_process, stream_rpc,
)

START = "process.Process/Start"


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def test_start_streams_start_data_end(envd: EnvdProcess) -> None:
    with envd.client() as c:
        out, err, end, messages = run_process(c, "echo out; echo err >&2; exit 3")
    assert "start" in messages[0]["event"] and messages[0]["event"]["start"]["pid"] > 0
    assert out == b"out\n" and err == b"err\n"
    assert end == {"exitCode": 3, "exited": True, "status": "exit status 3", "error": "exit status 3"}


def test_success_has_no_error_field(envd: EnvdProcess) -> None:
    with envd.client() as c:
        _, _, end, _ = run_process(c, "true")
    assert end == {"exitCode": 0, "exited": True, "status": "exit status 0"}


def test_runs_as_default_user_in_home_with_env(envd: EnvdProcess, test_user: GuestUser) -> None:
    with envd.client() as c:
        out, _, end, _ = run_process(c, 'id -un; pwd; echo "$HOME|$USER|$LOGNAME|$FOO"; test -n "$PATH" && echo path',
                                     process={"envs": {"FOO": "bar"}})
    assert end["exitCode"] == 0
    assert out.decode().splitlines() == [test_user.name, test_user.home,
                                         f"{test_user.home}|{test_user.name}|{test_user.name}|bar", "path"]


def test_basic_auth_selects_user(envd: EnvdProcess) -> None:
    with envd.client() as c:
        out, _, _, _ = run_process(c, "id -u; pwd", headers={"authorization": basic_auth("root")})
    assert out.decode().split() == ["0", "/root"]


def test_unknown_user_is_unauthenticated(envd: EnvdProcess) -> None:
    with envd.client() as c:
        messages = stream_rpc(c, START, {"process": {"cmd": "/bin/true"}}, authorization=basic_auth("nobody-here"))
    assert messages == [(2, {"error": {"code": "unauthenticated", "message": "invalid username: 'nobody-here'"}})]


def test_cwd_relative_to_home_and_missing_cwd(envd: EnvdProcess, workdir: str) -> None:
    name = os.path.basename(workdir)
    with envd.client() as c:
        out, _, _, _ = run_process(c, "pwd", process={"cwd": name})
        assert out.decode().strip() == workdir
        messages = stream_rpc(c, START, {"process": {"cmd": "/bin/pwd", "cwd": "/does/not/exist"}})
    assert messages[-1][1]["error"]["code"] == "invalid_argument"
    assert "cwd '/does/not/exist' does not exist" in messages[-1][1]["error"]["message"]


def test_missing_executable_is_invalid_argument(envd: EnvdProcess) -> None:
    with envd.client() as c:
        messages = stream_rpc(c, START, {"process": {"cmd": "/no/such/binary"}})
    assert len(messages) == 1
    assert messages[0][1]["error"]["code"] == "invalid_argument"


def test_binary_and_large_output_in_bounded_chunks(envd: EnvdProcess) -> None:
    size = 3 * 1024 * 1024 + 17
    with envd.client() as c:
        out, _, end, messages = run_process(c, f"head -c {size} /dev/urandom | tee /tmp/envd-big-$$ | cat; "
                                               f"sha256sum < /tmp/envd-big-$$ >&2; rm /tmp/envd-big-$$")
    assert end["exitCode"] == 0
    assert len(out) == size
    messages = [m for m in messages if "event" in m]
    chunks = [base64.b64decode(m["event"]["data"]["stdout"]) for m in messages
              if "data" in m["event"] and "stdout" in m["event"]["data"]]
    assert max(len(ch) for ch in chunks) <= 32 * 1024
    stderr = b"".join(base64.b64decode(m["event"]["data"]["stderr"]) for m in messages
                      if "data" in m["event"] and "stderr" in m["event"]["data"])
    assert stderr.split()[0].decode() == hashlib.sha256(out).hexdigest()


def test_stdin_send_input_and_close(envd: EnvdProcess) -> None:
    with envd.client() as c, c.stream("POST", f"/{START}", content=envelope(
            {"process": {"cmd": "/bin/bash", "args": ["-c", "cat; sleep 0.5"]}, "stdin": True}),
            headers={"content-type": "application/connect+json"}) as response:
        events = iter_envelopes(response)
        pid = next(events)[1]["event"]["start"]["pid"]
        with envd.client() as c2:
            assert rpc(c2, "process.Process/SendInput", {"process": {"pid": pid}, "input": {"stdin": b64(b"\x00\xffhello")}}).status_code == 200
            assert rpc(c2, "process.Process/CloseStdin", {"process": {"pid": pid}}).status_code == 200
            r = rpc(c2, "process.Process/SendInput", {"process": {"pid": pid}, "input": {"stdin": b64(b"x")}})
            assert r.status_code == 500 and r.json()["code"] == "internal"
        out = b""
        end = None
        for flags, msg in events:
            if flags & 2:
                break
            ev = msg["event"]
            if "data" in ev:
                out += base64.b64decode(ev["data"]["stdout"])
            if "end" in ev:
                end = ev["end"]
    assert out == b"\x00\xffhello"
    assert end is not None and end["exitCode"] == 0


def test_stdin_false_gives_dev_null(envd: EnvdProcess) -> None:
    with envd.client() as c:
        out, _, end, _ = run_process(c, "cat; echo done", stdin=False)
    assert out == b"done\n" and end["exitCode"] == 0


def test_stream_input(envd: EnvdProcess) -> None:
    with envd.client() as c, c.stream("POST", f"/{START}", content=envelope({"process": {"cmd": "/bin/cat"}}),
                                      headers={"content-type": "application/connect+json"}) as response:
        events = iter_envelopes(response)
        pid = next(events)[1]["event"]["start"]["pid"]

        def body():
            yield envelope({"start": {"process": {"pid": pid}}})
            yield envelope({"keepalive": {}})
            for i in range(3):
                yield envelope({"data": {"input": {"stdin": b64(f"line{i}\n".encode())}}})

        with envd.client() as c2:
            r = c2.post("/process.Process/StreamInput", content=body(),
                        headers={"content-type": "application/connect+json"})
            assert r.status_code == 200
            assert parse_envelopes(r.content) == [(0, {}), (2, {})]
            rpc(c2, "process.Process/CloseStdin", {"process": {"pid": pid}})
        out = b""
        for flags, msg in events:
            if flags & 2:
                break
            if "data" in msg["event"]:
                out += base64.b64decode(msg["event"]["data"]["stdout"])
    assert out == b"line0\nline1\nline2\n"


def test_list_connect_and_sigkill(envd: EnvdProcess) -> None:
    with envd.client() as c, c.stream("POST", f"/{START}", content=envelope(
            {"process": {"cmd": "/bin/bash", "args": ["-c", "echo ready; sleep 60"], "envs": {"A": "1"}}, "tag": "t1"}),
            headers={"content-type": "application/connect+json"}) as response:
        events = iter_envelopes(response)
        pid = next(events)[1]["event"]["start"]["pid"]
        with envd.client() as c2:
            listed = rpc(c2, "process.Process/List", {}).json()["processes"]
            mine = [p for p in listed if p["pid"] == pid]
            assert mine == [{"config": {"cmd": "/bin/bash", "args": ["-c", "echo ready; sleep 60"], "envs": {"A": "1"}},
                             "pid": pid, "tag": "t1"}]
            with c2.stream("POST", "/process.Process/Connect", content=envelope({"process": {"tag": "t1"}}),
                           headers={"content-type": "application/connect+json"}) as conn:
                conn_events = iter_envelopes(conn)
                assert next(conn_events)[1] == {"event": {"start": {"pid": pid}}}
                with envd.client() as c3:
                    r = rpc(c3, "process.Process/SendSignal", {"process": {"pid": pid}, "signal": "SIGNAL_SIGKILL"})
                    assert r.status_code == 200, r.text
                ends = [m["event"]["end"] for f, m in conn_events if not f & 2 and "end" in m["event"]]
        ends.append([m["event"]["end"] for f, m in events if not f & 2 and "end" in m["event"]][0])
    for end in ends:
        assert end == {"exitCode": -1, "exited": False, "status": "signal: killed", "error": "signal: killed"}
    with envd.client() as c:
        assert pid not in [p["pid"] for p in rpc(c, "process.Process/List", {}).json()["processes"]]


def test_sigterm(envd: EnvdProcess) -> None:
    with envd.client() as c, c.stream("POST", f"/{START}", content=envelope({"process": {"cmd": "/bin/sleep", "args": ["60"]}}),
                                      headers={"content-type": "application/connect+json"}) as response:
        events = iter_envelopes(response)
        pid = next(events)[1]["event"]["start"]["pid"]
        with envd.client() as c2:
            assert rpc(c2, "process.Process/SendSignal", {"process": {"pid": pid}, "signal": "SIGNAL_SIGTERM"}).status_code == 200
        end = [m["event"]["end"] for f, m in events if not f & 2 and "end" in m["event"]][0]
    assert end["status"] == "signal: terminated" and end["exitCode"] == -1


@pytest.mark.parametrize("method,body,code,status", [
    ("process.Process/SendSignal", {"process": {"pid": 999999}, "signal": "SIGNAL_SIGKILL"}, "not_found", 404),
    ("process.Process/SendInput", {"process": {"pid": 999999}, "input": {"stdin": "eA=="}}, "not_found", 404),
    ("process.Process/CloseStdin", {"process": {"tag": "nope"}}, "not_found", 404),
    ("process.Process/Update", {"process": {"pid": 999999}}, "not_found", 404),
    ("process.Process/SendSignal", {"process": {}}, "unimplemented", 501),
])
def test_unary_errors(envd: EnvdProcess, method: str, body: dict, code: str, status: int) -> None:
    with envd.client() as c:
        r = rpc(c, method, body)
    assert r.status_code == status
    assert r.headers["content-type"] == "application/json"
    assert r.json()["code"] == code and r.json()["message"]


def test_connect_unknown_pid_is_not_found(envd: EnvdProcess) -> None:
    with envd.client() as c:
        messages = stream_rpc(c, "process.Process/Connect", {"process": {"pid": 999999}})
    assert messages == [(2, {"error": {"code": "not_found", "message": "process with pid 999999 not found"}})]


def test_protocol_errors(envd: EnvdProcess) -> None:
    with envd.client() as c:
        assert c.post("/process.Process/List", content=b"{", headers={"content-type": "application/json"}).json()["code"] == "invalid_argument"
        assert c.post("/process.Process/List", content=b"{}", headers={"content-type": "application/proto"}).status_code == 415
        assert c.get("/process.Process/List").status_code == 405
        r = c.post("/process.Process/Nope", json={})
        assert r.status_code == 404 and r.json()["code"] == "unimplemented"


def test_process_survives_disconnect_and_can_be_reconnected(envd: EnvdProcess, workdir: str) -> None:
    marker = os.path.join(workdir, "done")
    with envd.client() as c, c.stream("POST", f"/{START}", content=envelope(
            {"process": {"cmd": "/bin/bash", "args": ["-c", f"sleep 1; echo late; touch {marker}"]}}),
            headers={"content-type": "application/connect+json"}) as response:
        pid = next(iter_envelopes(response))[1]["event"]["start"]["pid"]
    # The client is gone; the process must go on.
    with envd.client() as c:
        assert pid in [p["pid"] for p in rpc(c, "process.Process/List", {}).json()["processes"]]
        messages = stream_rpc(c, "process.Process/Connect", {"process": {"pid": pid}})
    data = [m["event"]["data"] for f, m in messages if not f & 2 and "data" in m["event"]]
    assert data == [{"stdout": base64.b64encode(b"late\n").decode()}]
    assert messages[-2][1]["event"]["end"]["exitCode"] == 0
    assert os.path.exists(marker)


def test_timeout_kills_process(envd: EnvdProcess, workdir: str) -> None:
    marker = os.path.join(workdir, "should-not-exist")
    with envd.client() as c:
        t0 = time.monotonic()
        messages = stream_rpc(c, START, {"process": {"cmd": "/bin/bash", "args": ["-c", f"sleep 3; touch {marker}"]}},
                              **{"connect-timeout-ms": "500"})
        elapsed = time.monotonic() - t0
    assert messages[-1][1]["error"]["code"] == "deadline_exceeded"
    assert elapsed < 2.5
    pid = messages[0][1]["event"]["start"]["pid"]
    time.sleep(3)
    assert not os.path.exists(marker)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_timeout_applies_after_disconnect(envd: EnvdProcess) -> None:
    with envd.client() as c, c.stream("POST", f"/{START}", content=envelope(
            {"process": {"cmd": "/bin/sleep", "args": ["30"]}}),
            headers={"content-type": "application/connect+json", "connect-timeout-ms": "700"}) as response:
        pid = next(iter_envelopes(response))[1]["event"]["start"]["pid"]
    deadline = time.monotonic() + 5
    with envd.client() as c:
        while pid in [p["pid"] for p in rpc(c, "process.Process/List", {}).json()["processes"]]:
            assert time.monotonic() < deadline, "process outlived its timeout"
            time.sleep(0.1)


def test_keepalive_events(envd: EnvdProcess) -> None:
    with envd.client() as c:
        messages = stream_rpc(c, START, {"process": {"cmd": "/bin/sleep", "args": ["1.6"]}},
                              **{"keepalive-ping-interval": "0.5"})
    keepalives = [m for f, m in messages if not f & 2 and "keepalive" in m["event"]]
    assert len(keepalives) >= 2
    assert messages[-2][1]["event"]["end"]["exitCode"] == 0


def test_concurrent_streams(envd: EnvdProcess) -> None:
    results: dict[int, bytes] = {}

    def one(i: int) -> None:
        with envd.client() as c:
            out, _, end, _ = run_process(c, f"for j in $(seq 200); do echo {i}-$j; done")
            assert end["exitCode"] == 0
            results[i] = out

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == list(range(8))
    for i, out in results.items():
        assert out.decode().split() == [f"{i}-{j}" for j in range(1, 201)]


def test_pty_start_input_resize(envd: EnvdProcess) -> None:
    body = {"process": {"cmd": "/bin/bash", "args": ["-c", "stty size; tty -s && echo istty; read line; stty size; echo got:$line"]},
            "pty": {"size": {"cols": 91, "rows": 27}}}
    with envd.client() as c, c.stream("POST", f"/{START}", content=envelope(body),
                                      headers={"content-type": "application/connect+json"}) as response:
        events = iter_envelopes(response)
        pid = next(events)[1]["event"]["start"]["pid"]
        out = b""
        for _flags, msg in events:
            out += base64.b64decode(msg["event"].get("data", {}).get("pty", ""))
            if b"istty" in out:
                break
        assert b"27 91" in out
        with envd.client() as c2:
            assert rpc(c2, "process.Process/Update", {"process": {"pid": pid}, "pty": {"size": {"cols": 100, "rows": 40}}}).status_code == 200
            r = rpc(c2, "process.Process/SendInput", {"process": {"pid": pid}, "input": {"stdin": b64(b"x")}})
            assert r.status_code == 500
            assert rpc(c2, "process.Process/SendInput", {"process": {"pid": pid}, "input": {"pty": b64(b"hello\n")}}).status_code == 200
        end = None
        for flags, msg in events:
            if flags & 2:
                break
            out += base64.b64decode(msg["event"].get("data", {}).get("pty", ""))
            end = msg["event"].get("end", end)
    assert b"40 100" in out and b"got:hello" in out
    assert end is not None and end["exitCode"] == 0


def test_stopping_envd_kills_its_processes(fresh_envd: EnvdProcess) -> None:
    with fresh_envd.client() as c, c.stream("POST", f"/{START}", content=envelope({"process": {"cmd": "/bin/sleep", "args": ["60"]}}),
                                            headers={"content-type": "application/connect+json"}) as response:
        events = iter_envelopes(response)
        pid = next(events)[1]["event"]["start"]["pid"]
        fresh_envd.proc.terminate()
        assert fresh_envd.proc.wait(timeout=10) == 0
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_malformed_messages_get_connect_errors(envd: EnvdProcess) -> None:
    with envd.client() as c:
        r = rpc(c, "process.Process/SendInput", {"process": {"pid": "abc"}, "input": {"stdin": "eA=="}})
        assert r.status_code == 400 and r.json()["code"] == "invalid_argument"
        r = rpc(c, "process.Process/Update", {"process": {"pid": 1}, "pty": {"size": {"cols": -1}}})
        assert r.json()["code"] in ("not_found", "invalid_argument")
        messages = stream_rpc(c, START, {"process": {"cmd": "/bin/true", "envs": ["not", "a", "map"]}})
        assert messages[-1][1]["error"]["code"] == "invalid_argument"
        messages = stream_rpc(c, START, {"process": {"cmd": ""}})
        assert messages[-1][1]["error"]["code"] == "invalid_argument"
