"""Typed errors of envd, each knowing how it goes on the wire.

Two families, because envd speaks two dialects:

- :class:`ConnectError` for the Connect-RPC services (``process.Process``,
  ``filesystem.Filesystem``): a Connect code name (``not_found``...) that maps to
  an HTTP status for unary calls and travels in the end-of-stream message of
  streaming calls.
- :class:`HttpError` for the plain HTTP routes (``/files``, ``/init``...): an HTTP
  status and a message, sent as JSON ``{"code": <status>, "message": ...}`` the
  way E2B's envd does (the SDK maps the status to its exceptions).
"""

from __future__ import annotations

# Connect protocol code -> HTTP status (connectrpc.com/docs/protocol#error-codes).
CONNECT_HTTP_STATUS: dict[str, int] = {
    "canceled": 499,
    "unknown": 500,
    "invalid_argument": 400,
    "deadline_exceeded": 504,
    "not_found": 404,
    "already_exists": 409,
    "permission_denied": 403,
    "resource_exhausted": 429,
    "failed_precondition": 400,
    "aborted": 409,
    "out_of_range": 400,
    "unimplemented": 501,
    "internal": 500,
    "unavailable": 503,
    "data_loss": 500,
    "unauthenticated": 401,
}


class EnvdError(Exception):
    """Base class of every error envd reports to a client."""


class ConnectError(EnvdError):
    """An RPC failure with a Connect error code and a human-readable message."""

    def __init__(self, code: str, message: str) -> None:
        if code not in CONNECT_HTTP_STATUS:
            raise ValueError(f"unknown Connect code {code!r}")
        super().__init__(message)
        self.code = code
        self.message = message

    @property
    def http_status(self) -> int:
        return CONNECT_HTTP_STATUS[self.code]

    def to_json(self) -> dict[str, str]:
        return {"code": self.code, "message": self.message}


class HttpError(EnvdError):
    """A plain-HTTP route failure: status code plus message, sent as JSON."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message

    def to_json(self) -> dict[str, object]:
        return {"code": self.status, "message": self.message}
