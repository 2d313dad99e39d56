"""What a request for a sandbox is: its routing (``E2b-Sandbox-Id``/``-Port`` headers or a
``{port}-{id}.{domain}`` Host), its resolution to a running sandbox, the traffic token check, and the error
answers the E2B SDK understands. Shared by the HTTP proxy (``proxy.py``) and the WebSocket relay
(``proxy_ws.py``), which both import it, so neither imports the other."""

from __future__ import annotations

import hmac
import json
import logging
import re
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import trio

# The runtime's class (one per condition): resolvers raise it; re-exported for resolvers written
# against the proxy alone (tests, benchmarks).
from ..runtime.errors import SandboxNotRunning
from ..snapshot.envd import ENVD_PORT
from ..state.errors import NotFound
from .errors import mapped_status, status_for

__all__ = [
    "TRAFFIC_TOKEN_HEADER",
    "PORT_NOT_OPEN_MESSAGE",
    "Resolution",
    "Resolver",
    "ProxyReject",
    "SandboxNotRunning",
    "Target",
    "Scope",
    "Message",
    "Receive",
    "Send",
    "ASGIApp",
    "check_traffic_token",
    "connect_backoff",
    "error_body",
    "forwardable",
    "header",
    "not_found_message",
    "resolve",
    "route",
]

log = logging.getLogger(__name__)

TRAFFIC_TOKEN_HEADER = "e2b-traffic-access-token"

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


@dataclass(frozen=True)
class Resolution:
    """Where the traffic of one running sandbox goes, and what it requires."""

    host: str                                   # address the node connects to (the slot address)
    port_map: Callable[[int], int] | None = None  # guest port -> port to dial; None = identity
    access_token: str | None = None          # envd's token; envd enforces it, the proxy forwards it
    traffic_token: str | None = None         # required for non-envd ports when set
    # Tries for a refused connection, 100 ms, 200 ms... apart: >1 just after a
    # resume, while the guest's network comes back (E2B retries then too).
    connect_attempts: int = 1

    def upstream_port(self, port: int) -> int:
        return self.port_map(port) if self.port_map is not None else port


async def connect_backoff(attempt: int) -> None:
    """Pause before retry number ``attempt`` (1-based) of a refused connection."""
    await trio.sleep(0.1 * attempt)


Resolver = Callable[[str, int], Awaitable[Resolution]]

# Headers that describe one hop, never forwarded (RFC 9110 7.6.1), plus
# `expect` (Hypercorn answers 100-continue itself) and framing, which is redone.
_HOP_BY_HOP = frozenset({
    b"connection", b"keep-alive", b"proxy-connection", b"proxy-authenticate",
    b"proxy-authorization", b"te", b"trailer", b"transfer-encoding", b"upgrade", b"expect",
})
# Header routing accepts dashes; Host routing cannot (`{port}-{id}[-client]`).
_SANDBOX_ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_HOST_ID_RE = re.compile(r"^[A-Za-z0-9_]{1,64}$")


class ProxyReject(Exception):
    """A request that is sandbox traffic but cannot be forwarded: answered as E2B JSON."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def error_body(status: int, message: str) -> bytes:
    return json.dumps({"code": status, "message": message}).encode()


def not_found_message(sandbox_id: str) -> str:
    return f"The sandbox {sandbox_id} was not found"


PORT_NOT_OPEN_MESSAGE = "The sandbox is running but port is not open"


def header(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> str | None:
    for k, v in headers:
        if k.lower() == name:
            return v.decode("latin-1").strip()
    return None


def _connection_tokens(headers: Iterable[tuple[bytes, bytes]]) -> set[bytes]:
    tokens: set[bytes] = set()
    for k, v in headers:
        if k.lower() == b"connection":
            tokens.update(t.strip().lower() for t in v.split(b",") if t.strip())
    return tokens


def forwardable(headers: Iterable[tuple[bytes, bytes]], *, drop: frozenset[bytes] = frozenset()) -> list[tuple[bytes, bytes]]:
    """Headers minus hop-by-hop ones (and those the Connection header names)."""
    headers = list(headers)
    named = _connection_tokens(headers)
    return [(k, v) for k, v in headers
            if (lk := k.lower()) not in _HOP_BY_HOP and lk not in named and lk not in drop]


@dataclass(frozen=True)
class Target:
    sandbox_id: str
    port: int


def _parse_port(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or not 0 < int(text) < 65536:
        raise ProxyReject(400, f"invalid sandbox port {text!r}: expected a number from 1 to 65535")
    return int(text)


def route(headers: Iterable[tuple[bytes, bytes]], domain: str) -> Target | None:
    """Decide whether a request is sandbox traffic, and for which sandbox port.

    Headers win (what the SDKs send); then, when a domain is configured, a Host
    of the form ``{port}-{sandboxID}[-anything].{domain}``. Raises ProxyReject
    for malformed sandbox traffic; returns None for everything else.
    """
    headers = list(headers)
    sandbox_id = header(headers, b"e2b-sandbox-id")
    port_text = header(headers, b"e2b-sandbox-port")
    if sandbox_id or port_text:
        if not sandbox_id:
            raise ProxyReject(400, "missing header E2b-Sandbox-Id (E2b-Sandbox-Port was given)")
        if not port_text:
            raise ProxyReject(400, "missing header E2b-Sandbox-Port (E2b-Sandbox-Id was given)")
        if not _SANDBOX_ID_RE.match(sandbox_id):
            raise ProxyReject(400, f"invalid sandbox id {sandbox_id!r}")
        return Target(sandbox_id, _parse_port(port_text))
    if not domain:
        return None
    host = header(headers, b"host")
    if not host:
        return None
    hostname = host.lower()
    if hostname.startswith("["):  # IPv6 literal: never a sandbox host
        return None
    hostname = hostname.rsplit(":", 1)[0] if ":" in hostname else hostname
    hostname = hostname.rstrip(".")
    suffix = "." + domain.lower().strip(".")
    if not hostname.endswith(suffix):
        return None
    label = hostname[: -len(suffix)]
    if "." in label:  # only the left-most label names a sandbox port
        return None
    parts = label.split("-")
    if len(parts) < 2 or not (parts[0].isascii() and parts[0].isdigit()) or not _HOST_ID_RE.match(parts[1]):
        return None
    return Target(parts[1], _parse_port(parts[0]))


def check_traffic_token(resolution: Resolution, target: Target, headers: Iterable[tuple[bytes, bytes]]) -> None:
    """E2B's rule: envd checks its own token; other ports of a secured sandbox need the traffic token."""
    if resolution.traffic_token is None or target.port == ENVD_PORT:
        return
    given = header(headers, TRAFFIC_TOKEN_HEADER.encode())
    if not given:
        raise ProxyReject(403, "Sandbox is secured with traffic access token. "
                               f"Token header '{TRAFFIC_TOKEN_HEADER}' is missing")
    if not hmac.compare_digest(given.encode(), resolution.traffic_token.encode()):
        raise ProxyReject(403, "Sandbox is secured with traffic access token. "
                               f"Provided token in header '{TRAFFIC_TOKEN_HEADER}' is invalid")


async def resolve(resolver: Resolver, target: Target) -> Resolution:
    """Await the resolver (which may resume a paused sandbox) and map its errors."""
    try:
        return await resolver(target.sandbox_id, target.port)
    except (SandboxNotRunning, NotFound) as exc:
        log.debug("sandbox %s not running: %s", target.sandbox_id, exc)
        raise ProxyReject(502, not_found_message(target.sandbox_id)) from exc
    except ProxyReject:
        raise
    except Exception as exc:
        if mapped_status(exc) is not None:  # a known condition (e.g. draining): the API's status
            raise ProxyReject(*status_for(exc)) from exc
        log.exception("resolving sandbox %s failed", target.sandbox_id)
        raise ProxyReject(500, f"failed to route the request to sandbox {target.sandbox_id}: "
                               "see the node's log") from exc
