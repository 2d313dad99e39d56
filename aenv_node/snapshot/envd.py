"""The node's side of envd: wait for it, and ``/init`` it after every boot or restore.

After a restore the guest wakes with the clock, env vars and access token of
its snapshot; ``/init`` gives it the sandbox's own (DESIGN.md "envd"). envd
lets a first ``/init`` set any token and requires the current token in
``X-Access-Token`` to rotate it (aenv_node/guest/control.py), so the node sends
the token the snapshot was taken with as the header.
"""

from __future__ import annotations

import datetime as dt
import logging
import ssl
import time
from typing import Mapping

import httpx
import trio

from ..images import ENVD_PORT  # the guest kit starts envd on that port: one definition

__all__ = ["ENVD_PORT", "EnvdUnavailable", "wait_envd", "init_envd", "envd_metrics", "quiesce_guest", "thaw_guest"]

log = logging.getLogger(__name__)

#: envd is plain HTTP on the slot's address, but an httpx client builds a TLS context when it is made, loading
#: the system's CA bundle: a quarter of the control plane's CPU per create (bench/sandbox_create.py --profile).
#: One (verifying, default) context, made once, serves every client here (none of them speaks TLS today).
_TLS_CONTEXT = ssl.create_default_context()

#: How long a capture waits for the guest to sync and freeze its filesystem before it captures anyway (a hung
#: guest must stay pausable; its memory and disk are still captured at one instant).
QUIESCE_TIMEOUT_S = 10.0


class EnvdUnavailable(Exception):
    """envd in the guest did not answer in time (the guest did not boot or restore)."""


def _url(host: str, path: str) -> str:
    return f"http://{host}:{ENVD_PORT}{path}"


async def wait_envd(host: str, *, timeout: float = 120.0, interval: float = 0.05) -> float:
    """Poll ``/health`` until envd answers; returns the seconds waited."""
    start = time.monotonic()
    last: str = "no answer"
    async with httpx.AsyncClient(verify=_TLS_CONTEXT, timeout=httpx.Timeout(2.0, connect=1.0)) as client:
        with trio.move_on_after(timeout):
            while True:
                try:
                    r = await client.get(_url(host, "/health"))
                    if r.status_code in (200, 204):
                        return time.monotonic() - start
                    last = f"HTTP {r.status_code}"
                except httpx.HTTPError as exc:
                    last = f"{type(exc).__name__}"
                await trio.sleep(interval)
    raise EnvdUnavailable(f"envd at {host}:{ENVD_PORT} not ready after {timeout:.0f}s ({last})")


async def init_envd(
    host: str,
    *,
    env_vars: Mapping[str, str],
    access_token: str | None,
    previous_token: str | None = None,
    default_user: str | None = None,
    default_workdir: str | None = None,
    timeout: float = 30.0,
    connect_grace_s: float = 10.0,
) -> None:
    body: dict[str, object] = {
        "envVars": dict(env_vars),
        "timestamp": dt.datetime.now(dt.timezone.utc).isoformat().replace("+00:00", "Z"),
    }
    if access_token is not None:
        body["accessToken"] = access_token
    if default_user:
        body["defaultUser"] = default_user
    if default_workdir:
        body["defaultWorkdir"] = default_workdir
    headers = {"X-Access-Token": previous_token} if previous_token else {}
    async with httpx.AsyncClient(verify=_TLS_CONTEXT, timeout=timeout) as client:
        # right after a restore the guest may need a moment to answer on its (re-attached) NIC
        delay = 0.05
        deadline = trio.current_time() + connect_grace_s
        while True:
            try:
                r = await client.post(_url(host, "/init"), json=body, headers=headers)
                break
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                if trio.current_time() + delay > deadline:
                    raise EnvdUnavailable(f"envd /init at {host} failed: {exc}") from exc
                await trio.sleep(delay)
                delay = min(delay * 2, 1.0)
            except httpx.HTTPError as exc:
                raise EnvdUnavailable(f"envd /init at {host} failed: {exc}") from exc
    if r.status_code >= 300:
        raise EnvdUnavailable(f"envd /init at {host} answered {r.status_code}: {r.text[:200]}")


async def envd_metrics(host: str, *, access_token: str | None, timeout: float = 10.0) -> dict[str, object]:
    """envd's ``/metrics`` document (CPU, memory and disk use of the guest)."""
    async with httpx.AsyncClient(verify=_TLS_CONTEXT, timeout=timeout) as client:
        try:
            r = await client.get(_url(host, "/metrics"), headers={"X-Access-Token": access_token or ""})
            doc = r.json()
        except (httpx.HTTPError, ValueError) as exc:
            raise EnvdUnavailable(f"envd at {host} did not answer /metrics: {exc}") from None
    if not isinstance(doc, dict):
        raise EnvdUnavailable(f"envd at {host} answered /metrics with {type(doc).__name__}, not an object")
    return doc


async def quiesce_guest(host: str, *, access_token: str | None, sandbox_id: str,
                        timeout: float = QUIESCE_TIMEOUT_S) -> bool:
    """Ask envd to sync and freeze the guest's root filesystem before a pause's capture (``guest/quiesce.py``); True
    if it froze. Never raises: a guest that cannot (an older envd, a filesystem that does not freeze, no answer
    in ``timeout``) is captured as it is, and the log says why."""
    async with httpx.AsyncClient(verify=_TLS_CONTEXT, timeout=timeout) as client:
        try:
            r = await client.post(_url(host, "/quiesce"), headers={"X-Access-Token": access_token or ""})
            doc = r.json() if r.status_code == 200 else {"reason": f"HTTP {r.status_code}"}
        except (httpx.HTTPError, ValueError) as exc:
            doc = {"reason": f"{type(exc).__name__}: {exc}"}
    frozen = bool(doc.get("frozen")) if isinstance(doc, dict) else False
    if not frozen:
        log.warning("sandbox %s: its filesystem was not frozen for the capture (%s)", sandbox_id,
                    doc.get("reason") if isinstance(doc, dict) else doc)
    return frozen


async def thaw_guest(host: str, *, access_token: str | None, sandbox_id: str, timeout: float = 10.0) -> None:
    """Thaw what :func:`quiesce_guest` froze, for a pause whose capture failed (its guest runs on). Never raises:
    envd thaws by itself a little later if this does not reach it."""
    async with httpx.AsyncClient(verify=_TLS_CONTEXT, timeout=timeout) as client:
        try:
            r = await client.post(_url(host, "/thaw"), headers={"X-Access-Token": access_token or ""})
            if r.status_code != 200:
                log.warning("sandbox %s: thaw answered %d", sandbox_id, r.status_code)
        except httpx.HTTPError as exc:
            log.warning("sandbox %s: thaw failed (%s); envd thaws by itself", sandbox_id, exc)
