"""Firecracker's REST API over its unix socket, on Trio.

httpx is used as is: `httpx.AsyncHTTPTransport(uds=...)` runs on httpcore, which picks its Trio backend
under Trio (via sniffio/anyio), so no hand-written HTTP client is needed. Firecracker answers errors with
`{"fault_message": ...}`; those become `VmmApiError` carrying the status and the message.

Two costs avoided on the boot/restore path: an SSL context made per client (plain HTTP over a unix socket
never uses it, but httpx builds one for every transport: ~60 ms with the default CA bundle, still 0.5 ms of
CPU per VM start with `verify=False`; one context made at import serves them all) and importing httpcore here,
at import time, not at the first VM start (~250 ms).
"""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

import httpcore  # noqa: F401  (imported lazily by httpx otherwise: see above)
import httpx

from ..errors import VmmApiError, VmmExited

#: never used: the API is plain HTTP over a unix socket (see the module docstring)
_UNUSED_TLS = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)


class FirecrackerApi:
    def __init__(self, socket_path: Path, *, timeout_s: float = 60.0) -> None:
        self.socket_path = socket_path
        self._client = httpx.AsyncClient(
            transport=httpx.AsyncHTTPTransport(uds=str(socket_path), verify=_UNUSED_TLS),
            base_url="http://localhost",
            timeout=timeout_s,
        )

    async def aclose(self) -> None:
        await self._client.aclose()

    async def request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        try:
            r = await self._client.request(method, path, json=body)
        except httpx.TransportError as e:
            raise VmmExited(f"Firecracker API {method} {path}: {e!r}") from e
        if r.status_code >= 300:
            try:
                detail = r.json().get("fault_message", r.text)
            except ValueError:
                detail = r.text
            raise VmmApiError(f"Firecracker {method} {path} failed", status=r.status_code, detail=detail)
        if r.status_code == 204 or not r.content:
            return None
        return r.json()

    async def get(self, path: str) -> Any:
        return await self.request("GET", path)

    async def put(self, path: str, body: dict[str, Any]) -> Any:
        return await self.request("PUT", path, body)

    async def patch(self, path: str, body: dict[str, Any]) -> Any:
        return await self.request("PATCH", path, body)
