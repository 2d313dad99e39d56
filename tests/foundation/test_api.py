"""The API skeleton: auth, E2B error shapes, health/metrics/openapi, listing."""

from __future__ import annotations

import datetime as dt
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
