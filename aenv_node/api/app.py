"""The Quart-trio application: routes from the table, auth, errors, metrics.

``create_app(node)`` builds the app for one ``Node``. Handlers live in
``handlers/`` keyed by operation id; a route of the table without a handler
answers 501 in the E2B error shape.
"""

from __future__ import annotations

import hmac
import time
from typing import Any, Awaitable, Callable

from quart import Quart, Response, g, request
from quart_trio import QuartTrio

from ..runtime import Node
from .errors import error_response, install_error_handlers
from .handlers import HANDLERS
from .metrics import ApiMetrics
from .openapi import build_openapi
from .routes import ROUTES, Route, quart_path

__all__ = ["create_app"]

Handler = Callable[..., Awaitable[Any]]


def _make_view(route: Route, handler: Handler | None, node: Node) -> Callable[..., Awaitable[Any]]:
    if handler is None:
        async def not_implemented(**_params: str) -> Response:
            return error_response(
                501, f"{route.method} {route.path} is not implemented on this node yet"
            )

        return not_implemented

    async def view(**params: str) -> Any:
        return await handler(node, **params)

    return view


def create_app(node: Node, *, extra_handlers: dict[str, Handler] | None = None) -> Quart:
    app = QuartTrio(__name__)
    app.config["MAX_CONTENT_LENGTH"] = 64 * 1024 * 1024
    app.config["PROVIDE_AUTOMATIC_OPTIONS"] = False
    handlers = {**HANDLERS, **(extra_handlers or {})}
    by_endpoint: dict[str, Route] = {}
    metrics = ApiMetrics(node)
    app.extensions["aenv_metrics"] = metrics
    app.extensions["aenv_node"] = node

    for route in ROUTES:
        endpoint = route.operation_id
        by_endpoint[endpoint] = route
        app.add_url_rule(
            quart_path(route.path),
            endpoint=endpoint,
            view_func=_make_view(route, handlers.get(route.operation_id), node),
            methods=[route.method],
            strict_slashes=False,
        )
    implemented = {r.operation_id for r in ROUTES if r.operation_id in handlers}
    document = build_openapi(implemented)
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
