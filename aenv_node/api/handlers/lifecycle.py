"""E2B sandbox lifecycle routes served by the sandbox manager: create, kill, connect, metrics."""

from __future__ import annotations

from typing import Any

import httpx
from quart import jsonify

from ...runtime import Node
from ...runtime.manager import CreateRequest, SandboxManager
from ...state import SandboxState
from ...state.errors import NotFound
from ...state.repository import get_sandbox
from ..body import field, json_body
from ..errors import ApiError
from ..serialize import rfc3339


def manager_of(node: Node) -> SandboxManager:
    for service in node.services:
        if isinstance(service, SandboxManager):
            return service
    raise ApiError(501, "sandbox lifecycle is not implemented on this node: it runs no sandbox manager")


def sandbox_json(node: Node, sb: Any) -> dict[str, Any]:
    return {
        "templateID": sb.template_id,
        "sandboxID": sb.id,
        "alias": sb.alias,
        "clientID": sb.client_id or node.node_id,
        "envdVersion": sb.envd_version,
        "envdAccessToken": sb.envd_access_token,
        "trafficAccessToken": sb.traffic_access_token,
        "domain": node.cfg.api.domain or None,
    }


_NEW_SANDBOX = {
    "templateID": field(str),
    "timeout": field(int, minimum=0),
    "metadata": field(dict),
    "envVars": field(dict),
    "autoPause": field(bool),
    "autoResume": field(dict),
    "secure": field(bool),
    "allow_internet_access": field(bool),
    "network": field(dict),
}


def _str_map(body: dict[str, Any], name: str) -> dict[str, str]:
    value = body.get(name) or {}
    bad = [k for k, v in value.items() if not isinstance(v, str)]
    if bad:
        raise ApiError(422, f"field {name!r}: values must be strings (see {bad[0]!r})")
    return dict(value)


async def create_sandbox_v2(node: Node) -> Any:
    body = await json_body(_NEW_SANDBOX)
    mgr = manager_of(node)
    cfg = node.cfg.sandbox
    timeout = body.get("timeout", cfg.default_timeout_s)
    if timeout > cfg.max_timeout_s:
        raise ApiError(400, f"timeout {timeout}s exceeds this node's maximum of {cfg.max_timeout_s}s")
    network = body.get("network") or {}
    for key in ("allowOut", "denyOut"):
        if key in network and not (isinstance(network[key], list)
                                   and all(isinstance(x, str) for x in network[key])):
            raise ApiError(422, f"field 'network.{key}' must be an array of strings")
    req = CreateRequest(
        template=body.get("templateID") or cfg.default_template,
        timeout_s=timeout,
        metadata=_str_map(body, "metadata"),
        env_vars=_str_map(body, "envVars"),
        auto_pause=body.get("autoPause", True),
        auto_resume=bool((body.get("autoResume") or {}).get("enabled", False)),
        secure=body.get("secure", True),
        allow_internet_access=body.get("allow_internet_access", True),
        allow_out=network.get("allowOut"),
        deny_out=network.get("denyOut"),
    )
    sb = await mgr.create(req)
    return jsonify(sandbox_json(node, sb)), 201


async def kill_sandbox(node: Node, sandboxID: str) -> Any:
    if not await manager_of(node).kill(sandboxID):
        raise ApiError(404, f"sandbox {sandboxID} not found")
    return "", 204


def _check_timeout(node: Node, timeout: int | None) -> None:
    if timeout is not None and timeout > node.cfg.sandbox.max_timeout_s:
        raise ApiError(400, f"timeout {timeout}s exceeds this node's maximum of "
                            f"{node.cfg.sandbox.max_timeout_s}s")


async def connect_sandbox_v2(node: Node, sandboxID: str) -> Any:
    """200 with the sandbox when it runs; 201 when it was paused and has been resumed."""
    body = await json_body({"timeout": field(int, minimum=0)})
    _check_timeout(node, body.get("timeout"))
    try:
        sb, resumed = await manager_of(node).resume(sandboxID, timeout_s=body.get("timeout"))
    except NotFound:
        raise ApiError(404, f"Paused sandbox {sandboxID} not found") from None
    return jsonify(sandbox_json(node, sb)), 201 if resumed else 200


async def resume_sandbox(node: Node, sandboxID: str) -> Any:
    body = await json_body({"timeout": field(int, minimum=0), "autoPause": field(bool)})
    _check_timeout(node, body.get("timeout"))
    sb = await node.db.run(lambda s: get_sandbox(s, sandboxID))
    if sb.state != SandboxState.PAUSED.value:
        raise ApiError(409, f"sandbox {sandboxID} is {sb.state}, not paused")
    sb, _ = await manager_of(node).resume(sandboxID, timeout_s=body.get("timeout"))
    return jsonify(sandbox_json(node, sb)), 201


async def pause_sandbox(node: Node, sandboxID: str) -> Any:
    await json_body({"memory": field(bool), "requireHealthyGuest": field(bool)})
    await manager_of(node).pause(sandboxID)
    return "", 204


async def create_snapshot(node: Node, sandboxID: str) -> Any:
    body = await json_body({"name": field(str), "memory": field(bool)})
    await node.db.run(lambda s: get_sandbox(s, sandboxID))  # 404 for an unknown sandbox
    snapshot_id = await manager_of(node).snapshot(sandboxID, name=body.get("name"))
    return jsonify({"snapshotID": snapshot_id,
                    "names": [body["name"]] if body.get("name") else []}), 201


async def delete_template(node: Node, templateID: str) -> Any:
    if not await manager_of(node).delete_snapshot(templateID):
        raise ApiError(404, f"snapshot {templateID} not found (only snapshots can be deleted here)")
    return "", 204


async def fork_sandbox(node: Node, sandboxID: str) -> Any:
    body = await json_body({"count": field(int, minimum=1), "timeout": field(int, minimum=0)})
    _check_timeout(node, body.get("timeout"))
    await node.db.run(lambda s: get_sandbox(s, sandboxID))
    results = await manager_of(node).fork(sandboxID, count=body.get("count", 1),
                                          timeout_s=body.get("timeout"))
    out = []
    for r in results:
        if "sandbox" in r:
            out.append({"sandbox": sandbox_json(node, r["sandbox"])})
        else:
            out.append({"error": r["error"]})
    return jsonify(out), 201


async def update_sandbox_network(node: Node, sandboxID: str) -> Any:
    body = await json_body({"allowOut": field(list), "denyOut": field(list)})
    for key in ("allowOut", "denyOut"):
        if key in body and not all(isinstance(x, str) for x in body[key]):
            raise ApiError(422, f"field {key!r} must be an array of strings")
    await manager_of(node).update_network(sandboxID, allow_out=body.get("allowOut"),
                                          deny_out=body.get("denyOut"))
    return "", 204


async def get_sandbox_metrics(node: Node, sandboxID: str) -> Any:
    sb = await node.db.run(lambda s: get_sandbox(s, sandboxID))
    mgr = manager_of(node)
    if sandboxID not in mgr.live:
        return jsonify([])
    handle = mgr.live[sandboxID]
    async with httpx.AsyncClient(timeout=10) as client:
        try:
            r = await client.get(f"http://{handle.address}:49983/metrics",
                                 headers={"X-Access-Token": handle.access_token or ""})
            m = r.json()
        except (httpx.HTTPError, ValueError) as exc:
            raise ApiError(502, f"envd of sandbox {sandboxID} did not answer: {exc}") from None
    import datetime as dt

    ts = m.get("ts") or int(dt.datetime.now(dt.timezone.utc).timestamp())
    return jsonify([{
        "timestamp": rfc3339(dt.datetime.fromtimestamp(ts, dt.timezone.utc)),
        "timestampUnix": ts,
        "cpuCount": m.get("cpu_count", sb.cpu_count),
        "cpuUsedPct": m.get("cpu_used_pct", 0.0),
        "memUsed": m.get("mem_used", 0),
        "memTotal": m.get("mem_total", 0),
        "memCache": m.get("mem_cache", 0),
        "diskUsed": m.get("disk_used", 0),
        "diskTotal": m.get("disk_total", 0),
    }])


HANDLERS = {
    "create_sandbox_v2": create_sandbox_v2,
    "create_sandbox": create_sandbox_v2,
    "kill_sandbox": kill_sandbox,
    "connect_sandbox_v2": connect_sandbox_v2,
    "connect_sandbox": connect_sandbox_v2,
    "resume_sandbox": resume_sandbox,
    "pause_sandbox": pause_sandbox,
    "create_snapshot": create_snapshot,
    "delete_template": delete_template,
    "fork_sandbox": fork_sandbox,
    "update_sandbox_network": update_sandbox_network,
    "get_sandbox_metrics": get_sandbox_metrics,
}
