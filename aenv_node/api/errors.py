"""API errors: every failure leaves the API as E2B's JSON error shape.

The E2B SDKs parse ``{"code": <int>, "message": "<str>"}`` for every error
status and crash on anything else (reference/e2b-protocol.md, "Errors"), so
404/405/422/500 included, no route answers with HTML or an empty body. Domain
errors are typed exceptions inside the node; they are mapped to HTTP here,
once.
"""

from __future__ import annotations

import logging
from typing import Any

from quart import Quart, Response, jsonify
from werkzeug.exceptions import HTTPException

from ..config import ConfigError
from ..net.errors import EgressPolicyError, PoolExhausted
from ..state.errors import IllegalTransition, NotFound

__all__ = ["ApiError", "error_response", "install_error_handlers"]

log = logging.getLogger(__name__)


class ApiError(Exception):
    """An error with an HTTP status and a message for the user."""

    def __init__(self, status: int, message: str, *, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    resp = jsonify({"code": status, "message": message})
    resp.status_code = status
    for k, v in (headers or {}).items():
        resp.headers[k] = v
    return resp


def _status_for(exc: BaseException) -> tuple[int, str]:
    """Map a domain exception to (status, message)."""
    if isinstance(exc, ApiError):
        return exc.status, exc.message
    if isinstance(exc, NotFound):
        return 404, str(exc)
    if isinstance(exc, IllegalTransition):
        return 409, str(exc)
    if isinstance(exc, (ConfigError, EgressPolicyError)):
        return 400, str(exc)
    if isinstance(exc, PoolExhausted):
        return 503, f"this node has no free capacity: {exc}"
    status = getattr(exc, "http_status", None)
    if isinstance(status, int):
        return status, str(exc)
    return 500, "internal error: see the node's log"


def install_error_handlers(app: Quart) -> None:
    @app.errorhandler(HTTPException)
    async def _http(exc: HTTPException) -> Any:
        status = exc.code or 500
        messages = {
            404: "route not found",
            405: "method not allowed on this route",
            413: "request body too large",
        }
        message = messages.get(status, exc.description or exc.name)
        return error_response(status, message)

    @app.errorhandler(Exception)
    async def _any(exc: Exception) -> Any:
        status, message = _status_for(exc)
        if status >= 500:
            log.exception("unhandled error in API handler")
        headers = exc.headers if isinstance(exc, ApiError) else None
        return error_response(status, message, headers)
