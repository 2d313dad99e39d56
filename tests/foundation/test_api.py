"""The API skeleton: auth, E2B error shapes, health/metrics/openapi, listing."""

from __future__ import annotations

import datetime as dt
import time
from typing import Any

import httpx
import trio

from aenv_node.api.app import create_app
from aenv_node.api.routes import ROUTES, quart_path
from aenv_node.state import Sandbox, SandboxState, utcnow
from aenv_node.state import repository as repo


def assert_e2b_error(resp: httpx.Response, status: int, contains: str = "") -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    body = resp.json()
    assert set(body) == {"code", "message"}
    assert body["code"] == status and isinstance(body["message"], str) and body["message"]
    assert contains in body["message"]
    return body


async def test_health_needs_no_key(live_node) -> None:
    async with httpx.AsyncClient(base_url=live_node.url) as c:
        r = await c.get("/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"


async def test_missing_and_wrong_key_are_401_json(live_node) -> None:
    async with httpx.AsyncClient(base_url=live_node.url) as c:
        assert_e2b_error(await c.get("/v2/sandboxes"), 401, "missing X-API-KEY")
    async with live_node.client(key="wrong") as c:
        assert_e2b_error(await c.get("/v2/sandboxes"), 401, "invalid API key")
        assert_e2b_error(await c.delete("/sandboxes/abc"), 401)
    async with live_node.client() as c:
        assert (await c.get("/v2/sandboxes")).status_code == 200


async def test_error_shapes_404_405_422_501(live_node) -> None:
    async with live_node.client() as c:
        assert_e2b_error(await c.get("/no/such/route"), 404, "route not found")
        assert_e2b_error(await c.get("/sandboxes/nope"), 404, "sandbox nope not found")
        assert_e2b_error(await c.patch("/v2/sandboxes"), 405)
        assert_e2b_error(await c.post("/sandboxes/x/timeout", content=b"{not json"), 400, "not valid JSON")
        assert_e2b_error(await c.post("/sandboxes/x/timeout", json={"timeout": "soon"}), 422, "'timeout'")
        assert_e2b_error(await c.post("/sandboxes/x/timeout", json={}), 422, "required")
        assert_e2b_error(await c.get("/v2/sandboxes", params={"limit": "many"}), 400, "limit")
        assert_e2b_error(await c.post("/v2/sandboxes", json={"templateID": "base"}), 501,
                         "not implemented")


async def test_500_is_json_and_hides_details(node_config) -> None:
    from aenv_node.runtime import Node
    from aenv_node.state import Database

    db = Database(node_config.database_path)
    db.upgrade()
    node = Node(node_config, db, "k")

    async def boom(node: Any) -> Any:
        raise RuntimeError("secret internal detail")

    app = create_app(node, extra_handlers={"node_info": boom})
    client = app.test_client()
    resp = await client.get("/node", headers={"X-API-KEY": "k"})
    assert resp.status_code == 500
    body = await resp.get_json()
    assert body["code"] == 500 and "secret" not in body["message"]


async def test_metrics_is_prometheus_text(live_node) -> None:
    async with live_node.client() as c:
        await c.get("/health")
        r = await c.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert 'aenv_api_requests_total{endpoint="health",method="GET",status="200"}' in r.text
    assert "aenv_sandboxes" in r.text


async def test_openapi_describes_every_route_of_the_server(live_node) -> None:
    async with httpx.AsyncClient(base_url=live_node.url) as c:
        doc = (await c.get("/openapi.json")).json()
    assert doc["openapi"].startswith("3.")
    documented = {(m.upper(), p) for p, ops in doc["paths"].items() for m in ops}
    declared = {(r.method, r.path) for r in ROUTES}
    assert documented == declared
    # the live app serves exactly the documented routes, nothing undocumented
    from aenv_node.api.server import ApiServer

    app = next(s for s in live_node.node.services if isinstance(s, ApiServer)).app
    served = {
        (m, rule.rule)
        for rule in app.url_map.iter_rules()
        for m in rule.methods - {"HEAD", "OPTIONS"}
        if rule.endpoint != "static"
    }
    assert served == {(m, quart_path(p)) for m, p in documented}
    # every operation that is not implemented says so, and answers 501
    async with live_node.client() as c:
        for path, ops in doc["paths"].items():
            for method, op in ops.items():
                assert "200" in op["responses"] or "201" in op["responses"] or \
                    "202" in op["responses"] or "204" in op["responses"]
                if not op["x-implemented"]:
                    url = path.replace("{sandboxID}", "x").replace("{templateID}", "t") \
                        .replace("{buildID}", "b").replace("{alias}", "a").replace("{snapshotID}", "s")
                    r = await c.request(method.upper(), url, json={})
                    assert_e2b_error(r, 501)


def _insert(live_node, sid: str, state: SandboxState, metadata: dict[str, str], started: dt.datetime) -> None:
    with live_node.node.db.session() as s:
        repo.insert_sandbox(s, Sandbox(id=sid, template_id="base", metadata_=metadata,
                                       started_at=started, end_at=started + dt.timedelta(minutes=5),
                                       envd_version="0.6.4"))
    if state != SandboxState.CREATING:
        with live_node.node.db.session() as s:
            repo.transition(s, sid, SandboxState.RUNNING, operation="create")
        if state == SandboxState.PAUSED:
            with live_node.node.db.session() as s:
                repo.transition(s, sid, SandboxState.PAUSING, operation="pause")
                repo.transition(s, sid, SandboxState.PAUSED, operation="pause")
        if state == SandboxState.KILLED:
            with live_node.node.db.session() as s:
                repo.transition(s, sid, SandboxState.KILLING, operation="kill")
                repo.transition(s, sid, SandboxState.KILLED, operation="kill")


async def test_e2b_sdk_lists_with_metadata_state_and_pages(live_node) -> None:
    """The real E2B SDK's Sandbox.list against the node (double-encoded metadata, x-next-token)."""
    from e2b import Sandbox as E2BSandbox
    from e2b import SandboxQuery, SandboxState as E2BState

    t0 = utcnow() - dt.timedelta(minutes=1)
    md = {"user id": "a&b=c", "run": "7"}
    _insert(live_node, "sbA", SandboxState.RUNNING, md, t0)
    _insert(live_node, "sbB", SandboxState.PAUSED, md, t0 + dt.timedelta(seconds=1))
    _insert(live_node, "sbC", SandboxState.RUNNING, {"run": "8"}, t0 + dt.timedelta(seconds=2))
    _insert(live_node, "sbD", SandboxState.KILLED, md, t0 + dt.timedelta(seconds=3))

    def sdk_pages(query, limit=None) -> list[list[str]]:
        pager = E2BSandbox.list(query=query, limit=limit, api_key=live_node.api_key,
                                api_url=live_node.url)
        pages = []
        while pager.has_next:
            pages.append([s.sandbox_id for s in pager.next_items()])
        return pages

    pages = await trio.to_thread.run_sync(sdk_pages, SandboxQuery(metadata=md))
    assert sorted(sum(pages, [])) == ["sbA", "sbB"]
    pages = await trio.to_thread.run_sync(
        sdk_pages, SandboxQuery(metadata=md, state=[E2BState.PAUSED]))
    assert sum(pages, []) == ["sbB"]
    pages = await trio.to_thread.run_sync(sdk_pages, None, 1)
    assert pages == [["sbA"], ["sbB"], ["sbC"]]


async def test_get_sandbox_detail_and_timeout(live_node) -> None:
    _insert(live_node, "sbT", SandboxState.RUNNING, {}, utcnow())
    async with live_node.client() as c:
        r = await c.get("/sandboxes/sbT")
        assert r.status_code == 200
        body = r.json()
        assert body["sandboxID"] == "sbT" and body["state"] == "running"
        assert body["lifecycle"] == {"autoResume": False, "onTimeout": "pause"}
        r = await c.post("/sandboxes/sbT/timeout", json={"timeout": 3600})
        assert r.status_code == 204
        end = dt.datetime.fromisoformat((await c.get("/sandboxes/sbT")).json()["endAt"].replace("Z", "+00:00"))
        assert 3590 < (end - utcnow()).total_seconds() <= 3600
        assert_e2b_error(await c.post("/sandboxes/sbT/timeout", json={"timeout": 10**9}), 400, "maximum")
        assert_e2b_error(await c.post("/sandboxes/nope/timeout", json={"timeout": 5}), 404)


async def test_a_database_held_busy_answers_503_and_keeps_nothing(live_node) -> None:
    """Another connection holding SQLite's write lock (a person's open ``BEGIN IMMEDIATE``): a write waits for
    it; past the busy timeout it answers E2B's 503 and its transaction is rolled back whole; once the lock
    goes, the same request succeeds."""
    import sqlite3

    from aenv_node.state.db import BUSY_TIMEOUT_MS

    _insert(live_node, "sbL", SandboxState.RUNNING, {}, utcnow())
    path = live_node.node.cfg.database_path
    events = lambda: sqlite3.connect(path).execute(  # noqa: E731
        "SELECT count(*) FROM events").fetchone()[0]

    def hold(seconds: float) -> None:
        con = sqlite3.connect(path, isolation_level=None)
        con.execute("BEGIN IMMEDIATE")
        time.sleep(seconds)
        con.execute("ROLLBACK")
        con.close()

    async with live_node.client() as c, trio.open_nursery() as n:
        end0 = (await c.get("/sandboxes/sbL")).json()["endAt"]
        # held for less than the busy timeout: the write waits, then succeeds
        n.start_soon(trio.to_thread.run_sync, hold, 1.5)
        await trio.sleep(0.3)
        t0 = time.monotonic()
        r = await c.post("/sandboxes/sbL/timeout", json={"timeout": 1800})
        assert r.status_code == 204 and time.monotonic() - t0 > 1.0
        await trio.sleep(1.5)
        end1 = (await c.get("/sandboxes/sbL")).json()["endAt"]
        assert end1 != end0
        before = events()
        # held past it: 503, and nothing of the request is kept
        n.start_soon(trio.to_thread.run_sync, hold, BUSY_TIMEOUT_MS / 1000 + 3)
        await trio.sleep(0.3)
        assert_e2b_error(await c.post("/sandboxes/sbL/timeout", json={"timeout": 3600}), 503, "database is busy")
        assert (await c.get("/sandboxes/sbL")).json()["endAt"] == end1
        assert events() == before
    async with live_node.client() as c:
        assert (await c.post("/sandboxes/sbL/timeout", json={"timeout": 3600})).status_code == 204


# ----- one schema source: models validate, serialize and document -----------------------------------------


def _bare_node(node_config) -> Any:
    from aenv_node.runtime import Node
    from aenv_node.state import Database

    db = Database(node_config.database_path)
    db.upgrade()
    return Node(node_config, db, "k")


class _FakeSandboxes:
    """Stands in for the sandbox service: records calls, answers with rows (or per-child errors)."""

    def __init__(self, fork_children: list[Any] | None = None) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.fork_children = fork_children or []
        self.stopped_hooks: list[Any] = []
        self.live: dict[str, Any] = {}

    @staticmethod
    def row(sid: str = "sbF", template: str = "base") -> Sandbox:
        now = utcnow()
        return Sandbox(id=sid, template_id=template, node_id="n1", client_id="", state=SandboxState.RUNNING,
                       envd_version="0.6.4", envd_access_token="tok", traffic_access_token=None,
                       started_at=now, end_at=now, metadata_={}, env_vars={})

    async def create(self, req: Any) -> Sandbox:
        self.calls.append(("create", req))
        return self.row(template=req.template)

    async def set_timeout(self, sandbox_id: str, timeout_s: int) -> None:
        self.calls.append(("set_timeout", (sandbox_id, timeout_s)))

    async def resume(self, sandbox_id: str, *, timeout_s: int | None = None) -> tuple[Sandbox, bool]:
        self.calls.append(("resume", (sandbox_id, timeout_s)))
        return self.row(sandbox_id), sandbox_id == "paused1"

    async def fork(self, sandbox_id: str, *, count: int, timeout_s: int | None) -> list[Any]:
        self.calls.append(("fork", (sandbox_id, count, timeout_s)))
        return self.fork_children


async def test_openapi_new_sandbox_does_not_require_template_and_the_handler_defaults_it(node_config) -> None:
    from aenv_node.api.openapi import build_openapi

    doc = build_openapi(set())
    assert doc["openapi"] == "3.1.0"
    new_sandbox = doc["components"]["schemas"]["NewSandbox"]
    assert "templateID" not in new_sandbox.get("required", [])
    assert {"templateID", "timeout", "metadata", "envVars", "autoPause", "autoResume",
            "allow_internet_access", "network"} <= set(new_sandbox["properties"])

    fake = _FakeSandboxes()
    node = _bare_node(node_config)
    client = create_app(node, sandboxes=fake).test_client()  # type: ignore[arg-type]
    resp = await client.post("/v2/sandboxes", json={"mcp": {"x": 1}, "volumeMounts": [], "metadata": None},
                             headers={"X-API-KEY": "k"})
    assert resp.status_code == 201, await resp.get_data()
    (op, req), = fake.calls
    assert op == "create" and req.template == node_config.sandbox.default_template
    assert req.timeout_s == node_config.sandbox.default_timeout_s and req.metadata == {}
    body = await resp.get_json()
    assert body == {"templateID": node_config.sandbox.default_template, "sandboxID": "sbF", "alias": None,
                    "clientID": node.node_id, "envdVersion": "0.6.4", "envdAccessToken": "tok",
                    "trafficAccessToken": None, "domain": None}


async def test_request_models_reject_bad_bodies_with_422_naming_the_field(node_config) -> None:
    client = create_app(_bare_node(node_config), sandboxes=_FakeSandboxes()).test_client()  # type: ignore[arg-type]
    h = {"X-API-KEY": "k"}
    cases = [
        ({"metadata": {"k": 1}}, "'metadata.k' must be a string"),
        ({"timeout": -1}, "'timeout' must be >= 0"),
        ({"timeout": True}, "'timeout' must be an integer"),
        ({"timeout": "30"}, "'timeout' must be an integer"),
        ({"network": {"allowOut": ["10.0.0.0/8", 3]}}, "'network.allowOut[1]' must be a string"),
        ({"autoResume": "yes"}, "'autoResume' must be an object"),
    ]
    for body, message in cases:
        resp = await client.post("/v2/sandboxes", json=body, headers=h)
        assert resp.status_code == 422, body
        got = await resp.get_json()
        assert got["code"] == 422 and message in got["message"], (body, got)
    resp = await client.post("/sandboxes/x/fork", json={"count": 0}, headers=h)
    assert resp.status_code == 422 and "'count' must be >= 1" in (await resp.get_json())["message"]
    resp = await client.post("/v2/sandboxes", data="[1]", headers={**h, "Content-Type": "application/json"})
    assert resp.status_code == 422 and "JSON object" in (await resp.get_json())["message"]


async def test_every_routes_models_are_components_of_the_document() -> None:
    from aenv_node.api.openapi import build_openapi

    doc = build_openapi({r.operation_id for r in ROUTES})
    schemas = doc["components"]["schemas"]

    def refs(node: Any) -> list[str]:
        if isinstance(node, dict):
            found = [node["$ref"]] if "$ref" in node else []
            return found + [r for v in node.values() for r in refs(v)]
        if isinstance(node, list):
            return [r for v in node for r in refs(v)]
        return []

    for ref in refs(doc):
        assert ref.startswith("#/components/schemas/") and ref.rsplit("/", 1)[1] in schemas, ref
    for route in ROUTES:
        op = doc["paths"][route.path][route.method.lower()]
        if route.request is not None:
            ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
            assert schemas[ref.rsplit("/", 1)[1]]["title"] == route.request.__name__
        if route.response is not None:
            schema = op["responses"][str(route.success)]["content"][route.content_type]["schema"]
            schema = schema["items"] if route.response_is_list else schema
            assert schemas[schema["$ref"].rsplit("/", 1)[1]]["title"] == route.response.__name__
    # the SDK's field names, including E2B's snake_case one
    assert "allow_internet_access" in schemas["NewSandbox"]["properties"]
    assert set(schemas["Error"]["required"]) == {"code", "message"}


async def test_fork_children_errors_and_handler_errors_use_the_one_table(node_config) -> None:
    from aenv_node.net.errors import PoolExhausted
    from aenv_node.runtime.errors import NodeDraining

    node = _bare_node(node_config)
    with node.db.session() as s:
        repo.insert_sandbox(s, _FakeSandboxes.row("parent"))
    fake = _FakeSandboxes([_FakeSandboxes.row("child1"), PoolExhausted("all 4 slots in use"), NodeDraining()])

    async def draining(api: Any) -> Any:
        raise NodeDraining()

    app = create_app(node, sandboxes=fake, extra_handlers={"node_info": draining})  # type: ignore[arg-type]
    client = app.test_client()
    h = {"X-API-KEY": "k"}
    resp = await client.post("/sandboxes/parent/fork", json={"count": 3}, headers=h)
    assert resp.status_code == 201
    first, second, third = await resp.get_json()
    assert first["sandbox"]["sandboxID"] == "child1" and set(first) == {"sandbox"}
    assert second == {"error": {"code": 503, "message": "PoolExhausted: all 4 slots in use"}}
    assert third["error"]["code"] == 503 and third["error"]["message"].startswith("NodeDraining: ")
    resp = await client.get("/node", headers=h)
    assert resp.status_code == 503 and "shutting down" in (await resp.get_json())["message"]


async def test_timeout_and_connect_go_through_the_sandbox_service(node_config) -> None:
    fake = _FakeSandboxes()
    client = create_app(_bare_node(node_config), sandboxes=fake).test_client()  # type: ignore[arg-type]
    h = {"X-API-KEY": "k"}
    resp = await client.post("/sandboxes/sbX/timeout", json={"timeout": 60}, headers=h)
    assert resp.status_code == 204
    assert fake.calls == [("set_timeout", ("sbX", 60))]
    resp = await client.post("/v2/sandboxes/running1/connect", json={"timeout": 30}, headers=h)
    assert resp.status_code == 200 and (await resp.get_json())["sandboxID"] == "running1"
    resp = await client.post("/v2/sandboxes/paused1/connect", headers=h)  # an empty body is {}
    assert resp.status_code == 201
    assert fake.calls[1:] == [("resume", ("running1", 30)), ("resume", ("paused1", None))]


async def test_events_after_a_cursor_come_oldest_first_and_page(live_node) -> None:
    """GET /events?after=ID: what a follower polls with the last id it saw; nothing is skipped in a burst."""
    async with live_node.client() as c:
        newest = (await c.get("/events", params={"limit": 1})).json()
        start = newest[0]["id"] if newest else 0
        with live_node.node.db.session() as s:
            for i in range(7):
                repo.record_event(s, f"burst-{i}", sandbox_id="sbE")
        seen: list[str] = []
        last = start
        while True:
            page = (await c.get("/events", params={"after": last, "limit": 3, "sandboxID": "sbE"})).json()
            seen += [e["operation"] for e in page]
            if len(page) < 3:
                break
            last = page[-1]["id"]
        assert seen == [f"burst-{i}" for i in range(7)]
        newest_first = (await c.get("/events", params={"limit": 2, "sandboxID": "sbE"})).json()
        assert [e["operation"] for e in newest_first] == ["burst-6", "burst-5"]
        assert_e2b_error(await c.get("/events", params={"after": "x"}), 400, "after")
