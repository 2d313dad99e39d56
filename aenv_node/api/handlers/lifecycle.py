"""E2B sandbox lifecycle routes served by the sandbox manager: create, kill, connect, metrics."""

from __future__ import annotations

from typing import Any

import httpx
from quart import jsonify, request

from ...runtime import Node
from ...runtime.manager import CreateRequest, SandboxManager
from ...state import SandboxState
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
        auto_pause=body.get("autoPause", False),
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


async def connect_sandbox_v2(node: Node, sandboxID: str) -> Any:
    body = await json_body({"timeout": field(int, minimum=0)})
    sb = await node.db.run(lambda s: get_sandbox(s, sandboxID))
    if sb.state != SandboxState.RUNNING.value:
        raise ApiError(404, f"Paused sandbox {sandboxID} not found" if sb.state == "paused"
                       else f"sandbox {sandboxID} is {sb.state}")
    if "timeout" in body:
        from .sandboxes import extend_timeout

        await extend_timeout(node, sandboxID, body["timeout"])
        sb = await node.db.run(lambda s: get_sandbox(s, sandboxID))
    return jsonify(sandbox_json(node, sb)), 200


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
    "get_sandbox_metrics": get_sandbox_metrics,
}
