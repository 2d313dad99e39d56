"""The REST-only commands against a fake node (httpx MockTransport): what they send, print and exit with."""

from __future__ import annotations

import json

import httpx

NODE = ["--url", "http://node:8000", "--key", "k"]

SANDBOX = {"sandboxID": "sb1", "templateID": "base", "alias": "base", "clientID": "n", "startedAt":
           "2026-01-01T00:00:00Z", "endAt": "2026-01-01T00:05:00Z", "cpuCount": 2, "memoryMB": 512,
           "diskSizeMB": 4096, "metadata": {"team": "a"}, "state": "running", "envdVersion": "0.2.0"}


def _error(status: int, message: str) -> httpx.Response:
    return httpx.Response(status, json={"code": status, "message": message})


def test_ls_pages_and_prints_a_table(run_aenv, fake_node) -> None:
    def handler(req: httpx.Request) -> httpx.Response:
        if "nextToken" not in req.url.params:
            return httpx.Response(200, json=[SANDBOX], headers={"x-next-token": "t2"})
        return httpx.Response(200, json=[{**SANDBOX, "sandboxID": "sb2", "state": "paused"}])

    seen = fake_node(handler)
    r = run_aenv("ls", *NODE, "--metadata", "team=a")
    assert r.code == 0, r.err
    lines = r.out.splitlines()
    assert lines[0].split()[:3] == ["SANDBOX", "ID", "TEMPLATE"]
    assert [line.split()[0] for line in lines[1:]] == ["sb1", "sb2"]
    assert seen[0].headers["X-API-KEY"] == "k"
    assert seen[0].url.params["metadata"] == "team=a"
    r = run_aenv("ls", *NODE, "--json")
    assert [s["sandboxID"] for s in json.loads(r.out)] == ["sb1", "sb2"]


def test_unknown_id_is_the_nodes_message(run_aenv, fake_node) -> None:
    fake_node(lambda req: _error(404, "sandbox nope not found"))
    r = run_aenv("pause", "nope", *NODE)
    assert (r.code, r.err.strip()) == (1, "Error: 404: sandbox nope not found")


def test_start_detached_prints_the_id(run_aenv, fake_node) -> None:
    seen = fake_node(lambda req: httpx.Response(201, json={**SANDBOX, "sandboxID": "sb9"}))
    r = run_aenv("start", "base", "-d", "--timeout", "60", "--env", "A=1", "--metadata", "k=v", *NODE)
    assert (r.code, r.out) == (0, "sb9\n")
    assert json.loads(seen[0].content) == {"templateID": "base", "timeout": 60, "envVars": {"A": "1"},
                                           "metadata": {"k": "v"}}


def test_rm_tries_every_id(run_aenv, fake_node) -> None:
    fake_node(lambda req: httpx.Response(204) if req.url.path.endswith("/a") else _error(404, "sandbox b not found"))
    r = run_aenv("rm", "a", "b", *NODE)
    assert r.code == 1
    assert r.out == "a\n"
    assert r.err == "b: 404: sandbox b not found\n"


def test_fork_prints_children_and_errors(run_aenv, fake_node) -> None:
    body = [{"sandbox": {**SANDBOX, "sandboxID": "c1"}}, {"error": {"code": 503, "message": "no free slot"}},
            {"sandbox": {**SANDBOX, "sandboxID": "c3"}}]
    seen = fake_node(lambda req: httpx.Response(201, json=body))
    r = run_aenv("fork", "sb1", "--count", "3", "--timeout", "30", *NODE)
    assert json.loads(seen[0].content) == {"count": 3, "timeout": 30}
    assert (r.code, r.out, r.err) == (1, "c1\nc3\n", "child 2: 503: no free slot\n")


def test_fork_all_good_exits_zero(run_aenv, fake_node) -> None:
    fake_node(lambda req: httpx.Response(201, json=[{"sandbox": {**SANDBOX, "sandboxID": "c1"}}]))
    assert run_aenv("fork", "sb1", *NODE).code == 0


def test_snapshot_create_and_ls(run_aenv, fake_node) -> None:
    def handler(req: httpx.Request) -> httpx.Response:
        if req.method == "POST":
            return httpx.Response(201, json={"snapshotID": "snap1", "names": ["s"]})
        return httpx.Response(200, json=[{"snapshotID": "snap1", "names": ["s"], "parentID": None,
                                          "sourceSandboxID": "sb1", "kind": "user", "status": "ready",
                                          "createdAt": "2026-01-01T00:00:00Z"}])

    seen = fake_node(handler)
    r = run_aenv("snapshot", "create", "sb1", "--name", "s", *NODE)
    assert (r.code, r.out) == (0, "snap1\n")
    assert json.loads(seen[0].content) == {"name": "s"}
    r = run_aenv("snapshot", "ls", "--sandbox-id", "sb1", *NODE)
    assert r.code == 0 and "snap1" in r.out
    assert seen[1].url.params["sandboxID"] == "sb1"


def test_events_oldest_first(run_aenv, fake_node) -> None:
    events = [{"id": i, "ts": f"2026-01-01T00:00:0{i}Z", "sandboxID": "sb1", "subject": "sandbox", "subjectID": "sb1",
               "operation": op, "fromState": None, "toState": "running", "durationMs": 12.0, "error": None,
               "detail": None} for i, op in ((2, "resume"), (1, "create"))]
    fake_node(lambda req: httpx.Response(200, json=events))
    r = run_aenv("events", "--sandbox", "sb1", *NODE)
    ops = [line.split()[2] for line in r.out.splitlines()[1:]]
    assert ops == ["create", "resume"]


def test_logs_not_implemented_is_one_line(run_aenv, fake_node) -> None:
    fake_node(lambda req: _error(501, "sandbox logs are not implemented on this node"))
    r = run_aenv("logs", "sb1", *NODE)
    assert (r.code, r.err.strip()) == (1, "Error: 501: sandbox logs are not implemented on this node")


def test_template_watch_follows_the_log(run_aenv, fake_node) -> None:
    pages = {
        0: {"status": "building", "logEntries": [
            {"timestamp": "2026-01-01T00:00:00.000Z", "level": "info", "message": "pulling sha256:abc… (8.0 MiB)"},
            {"timestamp": "2026-01-01T00:00:01.000Z", "level": "info", "message": "step 1/1 RUN true"}]},
        2: {"status": "ready", "logEntries": [
            {"timestamp": "2026-01-01T00:00:02.000Z", "level": "info", "message": "template app ready in 2s"}]},
        3: {"status": "ready", "logEntries": []},
    }

    def handler(req: httpx.Request) -> httpx.Response:
        if req.url.path == "/templates":
            return httpx.Response(200, json=[{"templateID": "t1", "buildID": "b0"}])
        if req.url.path == "/templates/t1":
            return httpx.Response(200, json={"templateID": "t1", "builds": [{"buildID": "b1"}]})
        assert req.url.path == "/templates/t1/builds/b1/status"
        return httpx.Response(200, json=pages[int(req.url.params["logsOffset"])])

    fake_node(handler)
    r = run_aenv("template", "watch", "b1", *NODE)
    assert r.code == 0, r.err
    assert r.out == "build b1 ready\n"
    assert "pulling sha256:abc" in r.err and "template app ready" in r.err


def test_template_watch_failed_build(run_aenv, fake_node) -> None:
    fake_node(lambda req: httpx.Response(200, json={"status": "error", "logEntries": [], "reason": {
        "message": "step 2/4 RUN make failed:\nexit status 3", "step": "2"}}))
    r = run_aenv("template", "watch", "b1", "--template", "t1", *NODE)
    assert r.code == 1
    assert r.err.strip() == "Error: build b1 failed (step 2): step 2/4 RUN make failed: exit status 3"


def test_build_progress_rows() -> None:
    from aenv_node.cli.aenv.build_progress import BuildView

    view = BuildView(live=True)
    with view:
        for message in ["pulling sha256:aa… (8.0 MiB)", "pulling sha256:bb… (1.0 MiB)",
                        "pulled sha256:aa… (8.0 MiB) in 0.1s", "sha256:cc… already present (2.0 MiB)",
                        "layer 1/2 sha256:aa… (8.0 MiB): 8 entries applied in 0.3s -> block layer 8.2 MiB",
                        "step 1/3 RUN a: cached", "step 2/3 RUN b", "something else"]:
            view.entry({"timestamp": "2026-01-01T00:00:00.000Z", "level": "info", "message": message})
    tasks = {t.description: (t.completed, t.total) for t in view.progress.tasks}
    assert tasks["pulled sha256:aa… (8.0 MiB) in 0.1s"] == (1, 1)
    assert tasks["pull sha256:bb… (1.0 MiB)"] == (0, None)
    assert tasks["step 2/3 RUN b"] == (1, 3)
    assert any(d.startswith("layer 1/2") and v == (1, 2) for d, v in tasks.items())
