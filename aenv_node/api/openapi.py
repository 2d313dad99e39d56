"""The OpenAPI 3.1 document, generated from the route table and the models.

Component schemas are the JSON Schemas (2020-12, hence OpenAPI 3.1) pydantic
generates from the very models that validate requests and serialize responses
(``models.py``, ``template_models.py``), by their wire (alias) names; query
parameters come from the routes' query models (``query.py``) the same way, so
the document cannot drift from what the server accepts and sends. Limits that
are the node's configuration (the longest timeout, the largest fork) are
written into the schemas of the node that serves the document.

Each operation lists the statuses it can answer: its own conditions (the
route table's ``error_statuses``) and those of its kind (``_kind_statuses``).
Creating operations link their answer to the operations on what they made.
``x-implemented`` on an operation says whether this node serves it or answers
501.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Optional

from pydantic import BaseModel
from pydantic.json_schema import GenerateJsonSchema, JsonSchemaMode, models_json_schema
from pydantic_core import CoreSchema

from .. import __version__
from ..config import Config
from .body import needs_body
from .models import REFRESH_MAX_S, Error, RequestModel
from .query import QueryModel, array_parameters
from .routes import PATH_PATTERNS, RESERVED_IDS, ROUTES, Route

__all__ = ["REF_TEMPLATE", "component_schemas", "build_openapi", "kind_statuses"]

REF_TEMPLATE = "#/components/schemas/{model}"

_REASONS = {
    400: "Bad request", 401: "Authentication error", 403: "Forbidden", 404: "Not found", 409: "Conflict",
    413: "Request body too large", 422: "Unprocessable request", 429: "Too many requests", 500: "Server error",
    501: "Not implemented on this node", 502: "Sandbox or repository failed", 503: "Unavailable",
    507: "The node's state disk is full",
}

#: limits that are the node's configuration: (schema, property) -> the maximum on this node
_CONFIG_MAXIMA: Mapping[tuple[str, str], Callable[[Config], int]] = {
    ("NewSandbox", "timeout"): lambda c: c.sandbox.max_timeout_s,
    ("Timeout", "timeout"): lambda c: c.sandbox.max_timeout_s,
    ("ResumeSandbox", "timeout"): lambda c: c.sandbox.max_timeout_s,
    ("ConnectSandbox", "timeout"): lambda c: c.sandbox.max_timeout_s,
    ("ForkSandbox", "timeout"): lambda c: c.sandbox.max_timeout_s,
    ("ForkSandbox", "count"): lambda c: c.sandbox.fork_max_count,
    ("Refresh", "duration"): lambda c: min(REFRESH_MAX_S, c.sandbox.max_timeout_s),
}


class _Generator(GenerateJsonSchema):
    """Pydantic's generator without a ``title`` per property (it only repeats the property's name)."""

    def field_title_should_be_set(self, schema: CoreSchema) -> bool:
        return False


def _route_models(routes: Iterable[Route]) -> list[type[BaseModel]]:
    models: list[type[BaseModel]] = [Error]
    for route in routes:
        for model in (route.request, route.response):
            if model is not None and model not in models:
                models.append(model)
    return models


def component_schemas(models: Iterable[type[BaseModel]]) -> tuple[dict[type[BaseModel], dict[str, Any]],
                                                                    dict[str, Any]]:
    """(model -> its ``$ref``, the components' schemas) for ``models`` and every model they nest."""
    wanted: list[tuple[type[BaseModel], JsonSchemaMode]] = [(m, "validation") for m in models]
    refs, top = models_json_schema(wanted, ref_template=REF_TEMPLATE, by_alias=True,
                                   schema_generator=_Generator)
    return {model: dict(refs[(model, mode)]) for model, mode in wanted}, dict(top.get("$defs", {}))


def _set_maximum(schema: dict[str, Any], maximum: int) -> None:
    """``maximum`` on the integer branch(es) of a property's schema (``Optional[int]`` is an ``anyOf``)."""
    if schema.get("type") == "integer":
        schema["maximum"] = min(maximum, schema.get("maximum", maximum))
    for branch in schema.get("anyOf", ()):
        _set_maximum(branch, maximum)


def _accepts_null(schema: dict[str, Any]) -> bool:
    return schema.get("type") == "null" or any(_accepts_null(b) for b in schema.get("anyOf", ()))


def _subclasses(cls: type[BaseModel]) -> Iterable[type[BaseModel]]:
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def _null_is_absent(schemas: dict[str, Any]) -> None:
    """A request's optional fields take ``null`` for "absent" (``RequestModel``: E2B's clients send it)."""
    for model in _subclasses(RequestModel):
        schema = schemas.get(model.__name__)
        if schema is None or schema.get("title") != model.__name__:
            continue
        required = set(schema.get("required", ()))
        for name, prop in schema.get("properties", {}).items():
            if name in required or _accepts_null(prop):
                continue
            meta = {k: prop[k] for k in ("description", "default") if k in prop}
            inner = {k: v for k, v in prop.items() if k not in meta}
            schema["properties"][name] = {"anyOf": [inner, {"type": "null"}], **meta}


def _apply_config(schemas: dict[str, Any], cfg: Config) -> None:
    for (name, prop), limit in _CONFIG_MAXIMA.items():
        _set_maximum(schemas[name]["properties"][prop], limit(cfg))


def _without_null(schema: dict[str, Any]) -> dict[str, Any]:
    """A query parameter's schema without pydantic's ``null`` branch of an optional field (a query string has
    no null: the parameter is absent)."""
    if schema.get("default", 0) is None:
        schema = {k: v for k, v in schema.items() if k != "default"}
    branches = [b for b in schema.get("anyOf", ()) if b.get("type") != "null"]
    if not branches or len(branches) == len(schema.get("anyOf", ())):
        return schema
    rest = {k: v for k, v in schema.items() if k != "anyOf"}
    return {**branches[0], **rest} if len(branches) == 1 else {**rest, "anyOf": branches}


def _query_parameters(model: type[QueryModel]) -> list[dict[str, Any]]:
    doc = model.model_json_schema(by_alias=True, ref_template=REF_TEMPLATE, schema_generator=_Generator)
    required = set(doc.get("required", ()))
    arrays = array_parameters(model)
    params = []
    for name, prop in doc.get("properties", {}).items():
        schema = _without_null(dict(prop))
        param: dict[str, Any] = {"name": name, "in": "query", "required": name in required}
        if "description" in schema:
            param["description"] = schema.pop("description")
        param["schema"] = schema
        if name in arrays:
            param.update(style="form", explode=False)
        params.append(param)
    return params


def _path_names(route: Route) -> list[str]:
    return re.findall(r"\{(\w+)\}", route.path)


def kind_statuses(route: Route) -> set[int]:
    """The statuses every route of this kind can answer, besides its own: 401 without a valid API key; 400 for a
    query parameter, path parameter or header of the wrong format; 400/413/422 for a bad JSON body; 503 while the
    node drains or its database is held busy (routes that use the node's state); 500, unexpected."""
    statuses = {500}
    if route.auth:
        statuses.add(401)
    if route.query is not None or route.headers or any(p in PATH_PATTERNS for p in _path_names(route)):
        statuses.add(400)
    if route.request is not None:
        statuses |= {400, 413, 422}
    if route.stateful:
        statuses.add(503)
    return statuses


def _links(route: Route) -> dict[str, Any]:
    """Links from a creating route's answer to every operation on what it made (all of whose path parameters
    the answer gives)."""
    if not route.provides:
        return {}
    links: dict[str, Any] = {}
    for other in ROUTES:
        names = _path_names(other)
        if other is route or not names or not set(names) <= set(route.provides):
            continue
        links[other.operation_id] = {
            "operationId": other.operation_id,
            "parameters": {n: f"$response.body#{route.provides[n]}" for n in names},
        }
    return links


def _operation(route: Route, implemented: bool, refs: dict[type[BaseModel], dict[str, Any]]) -> dict[str, Any]:
    op: dict[str, Any] = {
        "operationId": route.operation_id,
        "summary": route.summary,
        "tags": [route.tag],
        "x-implemented": implemented,
    }
    params: list[dict[str, Any]] = []
    for name in _path_names(route):
        schema: dict[str, Any] = {"type": "string", "minLength": 1}
        if name in PATH_PATTERNS:
            schema = {"type": "string", "pattern": PATH_PATTERNS[name]}
        if name in RESERVED_IDS and route.path.endswith("{" + name + "}"):
            schema["not"] = {"enum": list(RESERVED_IDS[name])}
        params.append({"name": name, "in": "path", "required": True, "schema": schema})
    if route.query is not None:
        params += _query_parameters(route.query)
    params += [{"name": h.name, "in": "header", "required": False, "description": h.description,
                "schema": {"type": "string", "pattern": h.pattern}} for h in route.headers]
    if params:
        op["parameters"] = params
    if route.request is not None:
        op["requestBody"] = {
            # an empty body stands for {} when the model requires nothing
            "required": needs_body(route.request),
            "content": {"application/json": {"schema": refs[route.request]}},
        }
    elif route.upload is not None:
        op["requestBody"] = {"required": True,
                             "content": {route.upload: {"schema": {"type": "string", "format": "binary"}}}}
    if route.response is None and route.success != 200:  # 202, 204: no body
        success: dict[str, Any] = {"description": "Success"}
    else:
        schema = {"type": "string", "format": "binary"} if route.content_type == "application/octet-stream" else {}
        if route.response is not None:
            schema = refs[route.response]
            if route.response_is_list:
                schema = {"type": "array", "items": schema}
        success = {"description": "Success", "content": {route.content_type: {"schema": schema}}}
    if route.response_headers:
        success["headers"] = {name: {"description": text, "required": False, "schema": {"type": "string"}}
                              for name, text in route.response_headers.items()}
    links = _links(route)
    if links:
        success["links"] = links
    responses: dict[str, Any] = {str(route.success): success}
    if route.also_success is not None:
        responses[str(route.also_success)] = success
    statuses = set(route.error_statuses) | kind_statuses(route) | ({501} if not implemented else set())
    for status in sorted(statuses):
        responses[str(status)] = {
            "description": _REASONS.get(status, "Error"),
            "content": {"application/json": {"schema": refs[Error]}},
        }
    op["responses"] = responses
    if not route.auth:
        op["security"] = []
    return op


def build_openapi(implemented: set[str], cfg: Optional[Config] = None) -> dict[str, Any]:
    """The document of a node serving the operations ``implemented``; with ``cfg``, its configured limits."""
    refs, schemas = component_schemas(_route_models(ROUTES))
    _null_is_absent(schemas)
    if cfg is not None:
        _apply_config(schemas, cfg)
    paths: dict[str, dict[str, Any]] = {}
    for route in ROUTES:
        paths.setdefault(route.path, {})[route.method.lower()] = _operation(
            route, route.operation_id in implemented, refs
        )
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "aenv-node",
            "version": __version__,
            "description": "E2B-compatible control plane of one aenv node, plus its native "
            "extensions. Sandbox traffic (requests carrying E2b-Sandbox-Id) is proxied to the "
            "sandbox and is not described here.",
        },
        "components": {
            "schemas": schemas,
            "securitySchemes": {"ApiKeyAuth": {"type": "apiKey", "in": "header", "name": "X-API-KEY"}},
        },
        "security": [{"ApiKeyAuth": []}],
        "paths": paths,
    }
