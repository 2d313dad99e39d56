"""The OpenAPI 3.1 document, generated from the route table and the models.

Component schemas are the JSON Schemas (2020-12, hence OpenAPI 3.1) pydantic
generates from the very models that validate requests and serialize responses
(``models.py``), by their wire (alias) names: the document cannot drift from
what the server accepts and sends. ``x-implemented`` on an operation says
whether this node serves it yet or answers 501.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import GenerateJsonSchema, JsonSchemaMode, models_json_schema
from pydantic_core import CoreSchema

from .. import __version__
from .models import Error
from .routes import ROUTES, Route

__all__ = ["REF_TEMPLATE", "component_schemas", "build_openapi"]

REF_TEMPLATE = "#/components/schemas/{model}"

_str = {"type": "string"}

_REASONS = {
    400: "Bad request", 401: "Authentication error", 404: "Not found", 409: "Conflict",
    422: "Unprocessable request", 429: "Too many requests", 500: "Server error",
    501: "Not implemented on this node", 502: "Sandbox unreachable", 503: "Unavailable",
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


def _needs_body(model: type[BaseModel]) -> bool:
    return any(f.is_required() for f in model.model_fields.values())


def _operation(route: Route, implemented: bool, refs: dict[type[BaseModel], dict[str, Any]]) -> dict[str, Any]:
    op: dict[str, Any] = {
        "operationId": route.operation_id,
        "summary": route.summary,
        "tags": [route.tag],
        "x-implemented": implemented,
    }
    params = [
        {"name": name, "in": "path", "required": True, "schema": _str}
        for name in re.findall(r"\{(\w+)\}", route.path)
    ]
    params += [{"name": q, "in": "query", "required": False, "schema": _str} for q in route.query]
    if params:
        op["parameters"] = params
    if route.request is not None:
        op["requestBody"] = {
            # an empty body stands for {} when the model requires nothing
            "required": _needs_body(route.request),
            "content": {"application/json": {"schema": refs[route.request]}},
        }
    if route.success == 204:
        success: dict[str, Any] = {"description": "Success"}
    else:
        schema: dict[str, Any] = {}
        if route.response is not None:
            schema = refs[route.response]
            if route.response_is_list:
                schema = {"type": "array", "items": schema}
        success = {"description": "Success", "content": {route.content_type: {"schema": schema}}}
    responses: dict[str, Any] = {str(route.success): success}
    statuses = set(route.error_statuses) | ({501} if not implemented else set())
    for status in sorted(statuses):
        if status == 401 and not route.auth:
            continue
        responses[str(status)] = {
            "description": _REASONS.get(status, "Error"),
            "content": {"application/json": {"schema": refs[Error]}},
        }
    op["responses"] = responses
    if not route.auth:
        op["security"] = []
    return op


def build_openapi(implemented: set[str]) -> dict[str, Any]:
    refs, schemas = component_schemas(_route_models(ROUTES))
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
