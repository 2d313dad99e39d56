"""API errors: every failure leaves the API as E2B's JSON error shape, mapped by ONE table.

The E2B SDKs parse ``{"code": <int>, "message": "<str>"}`` for every error
status and crash on anything else (reference/e2b-protocol.md, "Errors"), so
404/405/422/500 included, no route answers with HTML or an empty body.

Domain errors are typed exceptions of the layers below (one class per
condition, no HTTP knowledge); ``ERROR_STATUS`` is the only place that gives
them an HTTP status. It serves the handlers' errors, each child of a fork
(``{"error": {code, message}}``) and the traffic proxy's resolver errors, so
one condition answers the same status wherever it surfaces.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Optional

from quart import Quart, Response, jsonify
from werkzeug.exceptions import HTTPException

from ..config import ConfigError
from ..net.errors import EgressPolicyError, PoolExhausted
from ..runtime.errors import (
    ForkLimit,
    StateDiskFull,
    NodeDraining,
    NodeNotReady,
    SandboxConflict,
    SandboxNotRunning,
    SnapshotNotFound,
    TemplateBuildFailed,
    TemplateNotFound,
    TemplateNotReady,
    TemplateBusy,
    TemplateProtected,
    TemplateRequestError,
)
from ..snapshot.envd import EnvdUnavailable
from ..state.errors import DatabaseBusy, IdempotencyMismatch, IllegalTransition, NotFound
from ..templates.errors import GuestNotReady, KernelRefused
from ..storage.errors import LayerCorrupt
from ..storage.repository.errors import (
    OwnershipConflict,
    OwnershipLost,
    OwnershipUnsupported,
    RepositoryError,
    RepositoryUnavailable,
)
from ..vmm.errors import VmmExited

__all__ = ["ApiError", "ERROR_CODE", "ERROR_STATUS", "mapped_status", "status_for", "error_response", "install_error_handlers"]

log = logging.getLogger(__name__)


class ApiError(Exception):
    """An error the API itself decides (bad input, a 501): its status and the user's message."""

    def __init__(self, status: int, message: str, *, headers: Optional[dict[str, str]] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}


#: Exception class -> HTTP status. The most specific class of an exception's MRO wins. Anything not
#: here is a bug or an unexpected failure: 500 with the details in the node's log, not the answer.
#: (PoolInUse is absent on purpose: it stops the node at start-up, no request can meet it.)
ERROR_STATUS: Mapping[type[BaseException], int] = {
    # state
    NotFound: 404,
    IllegalTransition: 409,
    IdempotencyMismatch: 409,
    DatabaseBusy: 503,
    # bad configuration or policy given by the user
    ConfigError: 400,
    EgressPolicyError: 400,
    ForkLimit: 400,
    # runtime
    TemplateNotFound: 404,
    TemplateRequestError: 400,
    TemplateProtected: 403,
    TemplateBusy: 409,
    TemplateBuildFailed: 409,
    SnapshotNotFound: 404,
    SandboxNotRunning: 404,
    SandboxConflict: 409,
    TemplateNotReady: 503,
    NodeNotReady: 503,
    NodeDraining: 503,
    PoolExhausted: 503,
    StateDiskFull: 507,
    # the guest's agent did not answer, or the sandbox's VMM died under the operation
    EnvdUnavailable: 502,
    GuestNotReady: 502,
    # a VM's kernel the node cannot boot (an import without envd)
    KernelRefused: 400,
    VmmExited: 502,
    # the shared snapshot repository: unreachable (or refusing: 5xx after the retries), or giving bad data
    RepositoryUnavailable: 503,
    RepositoryError: 502,
    LayerCorrupt: 502,
    # the shared repository's ownership record (single writer across nodes)
    OwnershipConflict: 409,
    OwnershipLost: 404,
    OwnershipUnsupported: 501,
}

#: E2B's machine-readable ``error_code`` (its Error model), sent beside code and message where one applies.
ERROR_CODE: Mapping[type[BaseException], str] = {
    IdempotencyMismatch: "idempotency_request_mismatch",
}

#: Message prefixes where the exception's own text needs context for an API user.
_PREFIX: Mapping[type[BaseException], str] = {
    PoolExhausted: "this node has no free capacity: ",
    RepositoryUnavailable: "the snapshot repository is unavailable: ",
}


def mapped_status(exc: BaseException) -> Optional[int]:
    """The table's status for ``exc`` (ApiError: its own), None when it is not a known condition."""
    if isinstance(exc, ApiError):
        return exc.status
    for cls in type(exc).__mro__:
        status = ERROR_STATUS.get(cls)
        if status is not None:
            return status
    return None


def status_for(exc: BaseException) -> tuple[int, str]:
    """(status, message) for the user; an unknown exception is a 500 that hides its details."""
    if isinstance(exc, ApiError):
        return exc.status, exc.message
    status = mapped_status(exc)
    if status is None:
        return 500, "internal error: see the node's log"
    prefix = next((p for cls, p in _PREFIX.items() if isinstance(exc, cls)), "")
    return status, prefix + str(exc)


def error_response(status: int, message: str, headers: Optional[Mapping[str, str]] = None,
                   error_code: Optional[str] = None) -> Response:
    resp = jsonify({"code": status, "message": message, **({"error_code": error_code} if error_code else {})})
    resp.status_code = status
    for k, v in (headers or {}).items():
        resp.headers[k] = v
    return resp


_HTTP_MESSAGES = {
    404: "route not found",
    405: "method not allowed on this route",
    413: "request body too large",
}


def install_error_handlers(app: Quart) -> None:
    @app.errorhandler(HTTPException)
    async def _http(exc: HTTPException) -> Response:
        status = exc.code or 500
        # werkzeug's own headers of the answer, e.g. the Allow of a 405 (RFC 9110 requires it)
        headers = {k: v for k, v in exc.get_headers() if k.lower() != "content-type"}
        return error_response(status, _HTTP_MESSAGES.get(status, exc.description or exc.name), headers)

    @app.errorhandler(Exception)
    async def _any(exc: Exception) -> Response:
        status, message = status_for(exc)
        if status >= 500 and not isinstance(exc, ApiError):  # an ApiError is an answer, not a failure
            log.exception("error in API handler")
        headers = exc.headers if isinstance(exc, ApiError) else None
        code = next((c for cls, c in ERROR_CODE.items() if isinstance(exc, cls)), None)
        return error_response(status, message, headers, code)
