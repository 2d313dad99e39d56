"""The node-facing routes: ``/health``, ``/init``, ``/envs``, ``/metrics``, ``/quiesce``, ``/thaw``.

``/init`` is what the node calls after every boot, resume and fork: it sets the
env vars every process gets, the access token, the default user and workdir,
and the guest clock (a restored VM wakes with the clock of its snapshot), and thaws the root filesystem a
pause left frozen (``quiesce.py``: ``/quiesce`` and ``/thaw`` bracket a capture).

Access token changes follow E2B's envd, except that where E2B proves the
right to rotate the token through Firecracker's MMDS (which a QEMU guest does
not have), the node proves it by sending the current token in
``X-Access-Token``: a first ``/init`` may set any token; later ones must carry
the current token, in the body (no change) or in the header (rotation or
reset), else 401.
"""

from __future__ import annotations

import json
import logging
import re
import time
from typing import Any

from .version import __envd_version__
from .errors import HttpError
from .http import Request
from .metrics import Metrics
from .quiesce import Quiescer
from .state import EnvdState

log = logging.getLogger("envd.control")

_MAX_TIME_IN_PAST_NS = 50_000_000
_MAX_TIME_IN_FUTURE_NS = 5_000_000_000
_RFC3339 = re.compile(
    r"(\d{4})-(\d{2})-(\d{2})[Tt ](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?(Z|z|[+-]\d{2}:\d{2})"
)


def parse_rfc3339_ns(value: str) -> int:
    """RFC 3339 timestamp -> ns since the epoch (ValueError if malformed)."""
    m = _RFC3339.fullmatch(value.strip())
    if not m:
        raise ValueError(f"invalid timestamp {value!r}")
    import calendar

    year, month, day, hour, minute, second = (int(m.group(i)) for i in range(1, 7))
    seconds = calendar.timegm((year, month, day, hour, minute, second, 0, 0, 0))
    frac = m.group(7) or ""
    nanos = int((frac + "000000000")[:9]) if frac else 0
    tz = m.group(8)
    if tz not in ("Z", "z"):
        sign = 1 if tz[0] == "+" else -1
        seconds -= sign * (int(tz[1:3]) * 3600 + int(tz[4:6]) * 60)
    return seconds * 1_000_000_000 + nanos


# Every /init answer names the running envd version (as E2B's envd does), so the
# node learns it from the call it makes anyway.
_VERSION_HEADER = ("x-envd-version", __envd_version__)


def _json(body: Any) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


class ControlApi:
    def __init__(self, state: EnvdState, *, set_clock: bool, metrics: Metrics, quiescer: Quiescer) -> None:
        self.state = state
        self.set_clock = set_clock
        self.metrics = metrics
        self.quiescer = quiescer

    async def quiesce(self, request: Request) -> None:
        """sync() and freeze the root filesystem for a capture: ``{"frozen": bool, "reason"?}``."""
        frozen, reason = await self.quiescer.freeze()
        await request.respond(200, [("cache-control", "no-store"), ("content-type", "application/json")],
                              _json({"frozen": frozen, **({"reason": reason} if reason else {})}))

    async def thaw(self, request: Request) -> None:
        thawed = await self.quiescer.thaw()
        await request.respond(200, [("cache-control", "no-store"), ("content-type", "application/json")],
                              _json({"thawed": thawed}))

    async def health(self, request: Request) -> None:
        await request.respond(204, [("cache-control", "no-store"), _VERSION_HEADER])

    async def envs(self, request: Request) -> None:
        await request.respond(
            200,
            [("cache-control", "no-store"), ("content-type", "application/json")],
            _json(dict(self.state.env_vars)),
        )

    async def get_metrics(self, request: Request) -> None:
        try:
            sample = self.metrics.sample()
        except OSError as exc:
            log.error("metrics failed: %s", exc)
            await request.respond(500, [("cache-control", "no-store")])
            return
        await request.respond(
            200, [("cache-control", "no-store"), ("content-type", "application/json")], _json(sample)
        )

    async def init(self, request: Request) -> None:
        headers = [("cache-control", "no-store"), _VERSION_HEADER]
        # a resume or fork of a pause: the guest stopped frozen for its capture
        await self.quiescer.thaw("resumed")
        try:
            body = await request.read_body(1024 * 1024)
        except ValueError as exc:
            await request.respond(400, headers, str(exc).encode())
            return
        if body.strip():
            try:
                data = json.loads(body)
                if not isinstance(data, dict):
                    raise ValueError("body is not a JSON object")
            except ValueError as exc:
                log.error("bad /init body: %s", exc)
                await request.respond(400, headers, f"failed to decode request: {exc}".encode())
                return
            try:
                self.apply(data, request.headers.get("x-access-token"))
            except HttpError as exc:
                log.warning("/init refused: %s", exc.message)
                await request.respond(exc.status, headers, exc.message.encode())
                return
        await request.respond(204, headers)

    def apply(self, data: dict[str, Any], header_token: str | None) -> None:
        """Apply an /init body (raises HttpError 400/401)."""
        state = self.state
        ts_ns: int | None = None
        if data.get("timestamp"):
            try:
                ts_ns = parse_rfc3339_ns(str(data["timestamp"]))
            except ValueError as exc:
                raise HttpError(400, str(exc)) from exc
            if ts_ns <= state.last_init_ns:
                log.info("ignoring /init older than the last one applied")
                return
        token = data.get("accessToken")
        if token is not None and not isinstance(token, str):
            raise HttpError(400, "accessToken must be a string")
        if state.access_token is not None and token != state.access_token and not state.token_ok(header_token):
            if token is None:
                raise HttpError(401, "access token reset not authorized")
            raise HttpError(401, "access token validation failed")
        envs = data.get("envVars")
        if envs is not None and not isinstance(envs, dict):
            raise HttpError(400, "envVars must be an object")
        if ts_ns is not None:
            state.last_init_ns = ts_ns
            self._maybe_set_clock(ts_ns)
        for key, value in (envs or {}).items():
            state.env_vars[str(key)] = str(value)
        state.access_token = token
        if data.get("defaultUser"):
            state.default_user = str(data["defaultUser"])
        if data.get("defaultWorkdir"):
            state.default_workdir = str(data["defaultWorkdir"])

    def _maybe_set_clock(self, host_ns: int) -> None:
        now = time.time_ns()
        if host_ns - _MAX_TIME_IN_PAST_NS <= now <= host_ns + _MAX_TIME_IN_FUTURE_NS:
            return
        if not self.set_clock:
            log.info("guest clock off by %.3f s; clock setting disabled", (now - host_ns) / 1e9)
            return
        try:
            time.clock_settime_ns(time.CLOCK_REALTIME, host_ns)
            log.info("set the clock (was off by %.3f s)", (now - host_ns) / 1e9)
        except OSError as exc:
            log.error("failed to set system time: %s", exc)
