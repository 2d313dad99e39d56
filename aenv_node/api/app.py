"""The Quart-trio application: routes from the table, auth, bodies, errors, metrics.

``create_app(node, sandboxes=...)`` builds the app for one ``Node`` and its
sandbox service (None: the node serves only what needs no sandbox service; the
lifecycle routes answer 501). Handlers live in ``handlers/`` keyed by
operation id; a route of the table without a handler answers 501 in the E2B
error shape.

The view around each handler does what the route table declares, so handlers
do not: it parses the route's request model from the body (400/422 before the
handler runs) and serializes what the handler returns with the route's
success status, checking that it is the declared response model (a handler
that returned something else would make the OpenAPI document lie).
"""

from __future__ import annotations

import hmac
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Optional

from quart import Quart, Response, g, jsonify, request
from quart_trio import QuartTrio

from ..runtime import Node
from .body import parse_body
from .context import ApiContext, Handler, HandlerResult, Reply, SandboxService
from .errors import ApiError, error_response, install_error_handlers
from .handlers import HANDLERS
from .metrics import ApiMetrics
from .models import ResponseModel
from .openapi import build_openapi
from .query import parse_query
from .routes import PATH_CONVERTERS, PATH_PATTERNS, ROUTES, Route, anchored, quart_path

__all__ = ["create_app", "API_CONTEXT"]

#: ``app.extensions`` key of the ``ApiContext`` (the node and its sandbox service).
API_CONTEXT = "aenv_api"


def _checked(route: Route, body: ResponseModel | Sequence[ResponseModel]) -> Any:
    """The JSON of ``body``, after checking it is what the route table declares."""
    items = list(body) if not isinstance(body, ResponseModel) else [body]
    if isinstance(body, ResponseModel) == route.response_is_list or route.response is None or \
            not all(isinstance(m, route.response) for m in items):
        raise TypeError(f"handler of {route.operation_id} returned {type(body).__name__}, "
                        f"not the declared {'list of ' if route.response_is_list else ''}"
                        f"{route.response.__name__ if route.response else 'no body'}")
    if isinstance(body, ResponseModel):
        return body.to_json()
    return [m.to_json() for m in items]


def _render(route: Route, result: HandlerResult) -> Response:
    if isinstance(result, Response):
        return result
    status, headers = route.success, {}
    body: ResponseModel | Sequence[ResponseModel] | None
    if isinstance(result, Reply):
        status = result.status or route.success
        headers = dict(result.headers)
        body = result.body
    else:
        body = result
    if body is None:
        resp = Response("", status=status)
        del resp.headers["Content-Type"]  # no body, no type (Quart's default would say text/html)
    else:
        resp = jsonify(_checked(route, body))
        resp.status_code = status
    for k, v in headers.items():
        resp.headers[k] = v
    return resp


def _make_view(route: Route, handler: Optional[Handler], api: ApiContext) -> Callable[..., Awaitable[Response]]:
    if handler is None:
        async def not_implemented(**_params: str) -> Response:
            return error_response(
                501, f"{route.method} {route.path} is not implemented on this node yet"
            )

        return not_implemented

    path_patterns = {name: anchored(PATH_PATTERNS[name]) for name in re.findall(r"\{(\w+)\}", route.path)
                     if name in PATH_PATTERNS}
    header_patterns = [(h, anchored(h.pattern)) for h in route.headers]

    async def view(**params: str) -> Response:
        for name, rx in path_patterns.items():
            if not rx.match(params[name]):
                raise ApiError(400, f"path parameter {name!r} must match {PATH_PATTERNS[name]}, got {params[name]!r}")
        for header, rx in header_patterns:
            value = request.headers.get(header.name)
            if value is not None and not rx.match(value):
                raise ApiError(400, f"header {header.name!r} must match {header.pattern}")
        kwargs: dict[str, Any] = dict(params)
        if route.query is not None:
            kwargs["query"] = parse_query(route.query, request.args)
        if route.request is not None:
            kwargs["body"] = await parse_body(route.request)
        return _render(route, await handler(api, **kwargs))

    return view


def create_app(node: Node, *, sandboxes: Optional[SandboxService] = None,
               extra_handlers: Optional[dict[str, Handler]] = None) -> Quart:
    app = QuartTrio(__name__)
    app.config["MAX_CONTENT_LENGTH"] = 64 * 1024 * 1024
    app.config["PROVIDE_AUTOMATIC_OPTIONS"] = False
    for converter_name, converter in PATH_CONVERTERS.values():
        app.url_map.converters[converter_name] = converter
    handlers = {**HANDLERS, **(extra_handlers or {})}
    by_endpoint: dict[str, Route] = {}
    metrics = ApiMetrics(node, cache=lambda: None if sandboxes is None else sandboxes.parts.cache,
                         dataplane_cache=lambda: None if sandboxes is None or sandboxes.parts.dataplane is None
                         else sandboxes.parts.dataplane.cache_stats_blocking())
    api = ApiContext(node, sandboxes)
    app.extensions["aenv_metrics"] = metrics
    app.extensions["aenv_node"] = node
    app.extensions[API_CONTEXT] = api

    for route in ROUTES:
        endpoint = route.operation_id
        by_endpoint[endpoint] = route
        app.add_url_rule(
            quart_path(route.path),
            endpoint=endpoint,
            view_func=_make_view(route, handlers.get(route.operation_id), api),
            methods=[route.method],
            strict_slashes=False,
        )
    implemented = {r.operation_id for r in ROUTES if r.operation_id in handlers}
    document = build_openapi(implemented, node.cfg)
    app.extensions["aenv_openapi"] = document
    install_error_handlers(app)

    @app.before_request
    async def _auth() -> Response | None:
        g.started = time.perf_counter()
        rule = request.url_rule
        route = by_endpoint.get(rule.endpoint) if rule is not None else None
        if route is None or not route.auth:
            return None
        given = request.headers.get("X-API-KEY", "")
        if not given:
            return error_response(401, "missing X-API-KEY header")
        if not hmac.compare_digest(given.encode(), node.api_key.encode()):
            return error_response(401, "invalid API key")
        return None

    @app.after_request
    async def _observe(response: Response) -> Response:
        rule = request.url_rule
        endpoint = rule.endpoint if rule is not None else "unmatched"
        started = getattr(g, "started", None)
        if started is not None:
            metrics.observe_request(endpoint, request.method, response.status_code,
                                    time.perf_counter() - started)
        return response

    return app
