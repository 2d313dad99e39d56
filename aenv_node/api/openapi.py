"""The OpenAPI 3 document, generated from the route table.

The component schemas follow the E2B models the SDK parses
(reference/e2b-protocol.md section 3); ``x-implemented`` on an operation says
whether this node serves it yet or answers 501.
"""

from __future__ import annotations

from typing import Any, Iterable

from .. import __version__
from .routes import ROUTES, Route

__all__ = ["SCHEMAS", "build_openapi"]

_str = {"type": "string"}
_int = {"type": "integer"}
_bool = {"type": "boolean"}
_ts = {"type": "string", "format": "date-time"}
_strmap = {"type": "object", "additionalProperties": {"type": "string"}}


def _obj(props: dict[str, Any], required: Iterable[str] = ()) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "object", "properties": props}
    req = list(required)
    if req:
        out["required"] = req
    return out


_listed = {
    "templateID": _str, "alias": _str, "sandboxID": _str, "clientID": _str,
    "startedAt": _ts, "endAt": _ts, "cpuCount": _int, "memoryMB": _int, "diskSizeMB": _int,
    "metadata": _strmap, "state": {"type": "string", "enum": ["running", "paused"]},
    "envdVersion": _str,
}
_listed_req = ["templateID", "sandboxID", "clientID", "startedAt", "endAt", "cpuCount",
               "memoryMB", "diskSizeMB", "state", "envdVersion"]

SCHEMAS: dict[str, dict[str, Any]] = {
    "Error": _obj({"code": _int, "message": _str}, ["code", "message"]),
    "Health": _obj({"status": _str, "version": _str}, ["status"]),
    "NodeInfo": _obj({"nodeID": _str, "version": _str, "listen": _str, "stateDir": _str,
                      "startedAt": _ts, "sandboxes": _strmap}),
    "Event": _obj({"id": _int, "ts": _ts, "sandboxID": _str, "subject": _str, "operation": _str,
                   "fromState": _str, "toState": _str, "durationMs": {"type": "number"},
                   "error": _str}),
    "NewSandbox": _obj({
        "templateID": _str, "timeout": _int, "metadata": _strmap, "envVars": _strmap,
        "autoPause": _bool, "autoResume": _obj({"enabled": _bool}), "secure": _bool,
        "allow_internet_access": _bool, "network": {"type": "object"},
    }, ["templateID"]),
    "Sandbox": _obj({"templateID": _str, "sandboxID": _str, "clientID": _str, "envdVersion": _str,
                     "alias": _str, "envdAccessToken": _str, "trafficAccessToken": _str,
                     "domain": _str}, ["templateID", "sandboxID", "clientID", "envdVersion"]),
    "ListedSandbox": _obj(_listed, _listed_req),
    "SandboxDetail": _obj({**_listed, "envdAccessToken": _str, "allowInternetAccess": _bool,
                           "domain": _str, "network": {"type": "object"},
                           "lifecycle": _obj({"autoResume": _bool, "onTimeout": _str})},
                          _listed_req),
    "Timeout": _obj({"timeout": _int}, ["timeout"]),
    "Refresh": _obj({"duration": _int}),
    "ResumeSandbox": _obj({"timeout": _int, "autoPause": _bool}),
    "ConnectSandbox": _obj({"timeout": _int}),
    "ForkSandbox": _obj({"count": _int, "timeout": _int}),
    "ForkResult": _obj({"sandbox": {"$ref": "#/components/schemas/Sandbox"},
                        "error": {"$ref": "#/components/schemas/Error"}}),
    "NewSnapshot": _obj({"name": _str}),
    "SnapshotInfo": _obj({"snapshotID": _str, "names": {"type": "array", "items": _str}},
                         ["snapshotID", "names"]),
    "SnapshotDetail": _obj({"snapshotID": _str, "parentID": _str, "sourceSandboxID": _str,
                            "kind": _str, "createdAt": _ts}),
    "NetworkUpdate": _obj({"allowOut": {"type": "array", "items": _str},
                           "denyOut": {"type": "array", "items": _str}}),
    "SandboxMetric": _obj({
        "timestamp": _ts, "timestampUnix": _int, "cpuCount": _int, "cpuUsedPct": {"type": "number"},
        "memUsed": _int, "memTotal": _int, "memCache": _int, "diskUsed": _int, "diskTotal": _int,
    }, ["timestamp", "timestampUnix", "cpuCount", "cpuUsedPct", "memUsed", "memTotal", "memCache",
        "diskUsed", "diskTotal"]),
    "Template": _obj({"templateID": _str, "aliases": {"type": "array", "items": _str},
                      "cpuCount": _int, "memoryMB": _int, "diskSizeMB": _int, "envdVersion": _str,
                      "createdAt": _ts, "updatedAt": _ts, "public": _bool, "buildStatus": _str}),
}

_REASONS = {
    400: "Bad request", 401: "Authentication error", 404: "Not found", 409: "Conflict",
    422: "Unprocessable request", 429: "Too many requests", 500: "Server error",
    501: "Not implemented on this node", 503: "Unavailable",
}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _operation(route: Route, implemented: bool) -> dict[str, Any]:
    op: dict[str, Any] = {
        "operationId": route.operation_id,
        "summary": route.summary,
        "tags": [route.tag],
        "x-implemented": implemented,
    }
    params = [
        {"name": name, "in": "path", "required": True, "schema": _str}
        for name in _path_params(route.path)
    ]
    params += [{"name": q, "in": "query", "required": False, "schema": _str} for q in route.query]
    if params:
        op["parameters"] = params
    if route.request:
        op["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": _ref(route.request)}},
        }
    if route.success == 204:
        success: dict[str, Any] = {"description": "Success"}
    else:
        schema: dict[str, Any] = {}
        if route.response:
            schema = _ref(route.response)
            if route.response_is_list:
                schema = {"type": "array", "items": schema}
        success = {"description": "Success", "content": {route.content_type: {"schema": schema}}}
    responses: dict[str, Any] = {str(route.success): success}
    for status in sorted(set(route.error_statuses) | {501} if not implemented else
                         set(route.error_statuses)):
        if status == 401 and not route.auth:
            continue
        responses[str(status)] = {
            "description": _REASONS.get(status, "Error"),
            "content": {"application/json": {"schema": _ref("Error")}},
        }
    op["responses"] = responses
    if not route.auth:
        op["security"] = []
    return op


def _path_params(path: str) -> list[str]:
    import re

    return re.findall(r"\{(\w+)\}", path)


def build_openapi(implemented: set[str]) -> dict[str, Any]:
    paths: dict[str, dict[str, Any]] = {}
    for route in ROUTES:
        paths.setdefault(route.path, {})[route.method.lower()] = _operation(
            route, route.operation_id in implemented
        )
    return {
        "openapi": "3.0.3",
        "info": {
            "title": "aenv-node",
            "version": __version__,
            "description": "E2B-compatible control plane of one aenv node, plus its native "
            "extensions. Sandbox traffic (requests carrying E2b-Sandbox-Id) is proxied to the "
            "sandbox and is not described here.",
        },
        "components": {
            "schemas": SCHEMAS,
            "securitySchemes": {"ApiKeyAuth": {"type": "apiKey", "in": "header", "name": "X-API-KEY"}},
        },
        "security": [{"ApiKeyAuth": []}],
        "paths": paths,
    }
