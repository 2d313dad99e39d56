"""E2B sandbox lifecycle routes, served by the sandbox service: create, kill, connect, resume, pause,
snapshots, fork, network, metrics.

Each reaches the service through ``api.sandboxes`` (a 501 when the node runs none). Errors are the
service's typed exceptions, mapped by the API's one table (``errors.py``); a handler raises an
``ApiError`` itself only where E2B's SDK reads a particular message (connect's "Paused sandbox ...
not found") or for a condition the service does not know (a timeout over the node's maximum).
"""

from __future__ import annotations

import logging

import trio
from quart import request
from sqlalchemy import select

from ...state import Sandbox as SandboxRow
from ...state import SandboxState
from ...state.errors import NotFound
from ...snapshot.envd import EnvdUnavailable
from ...state.repository import extend_end, get_sandbox
from ..context import ApiContext, CreateRequest, Handler, Reply
from ..errors import ApiError, status_for
from ..models import (
    ConnectSandbox,
    Error,
    ForkResult,
    ForkSandbox,
    NetworkUpdate,
    NewSandbox,
    NewSnapshot,
    PauseSandbox,
    Refresh,
    ResumeSandbox,
    Sandbox,
    SandboxesWithMetrics,
    SandboxMetric,
    SnapshotInfo,
    e2b_state,
)
from ..query import SandboxesMetricsQuery, SandboxMetricsQuery
from ..routes import IDEMPOTENCY_KEY
from .sandboxes import check_timeout

log = logging.getLogger(__name__)

def _sandbox(api: ApiContext, row: SandboxRow) -> Sandbox:
    return Sandbox.from_row(row, node_id=api.node.node_id, domain=api.cfg.api.domain)


async def create_sandbox_v2(api: ApiContext, body: NewSandbox) -> Sandbox:
    service = api.sandboxes
    cfg = api.cfg.sandbox
    timeout = body.timeout if body.timeout is not None else cfg.default_timeout_s
    check_timeout(api.cfg, timeout)
    network = body.network
    key = request.headers.get(IDEMPOTENCY_KEY.name)  # its format is checked by the app (routes.IDEMPOTENCY_KEY)
    req = CreateRequest(
        template=body.template_id or cfg.default_template,
        timeout_s=timeout,
        metadata=dict(body.metadata),
        env_vars=dict(body.env_vars),
        auto_pause=body.auto_pause,
        auto_resume=body.auto_resume.enabled if body.auto_resume is not None else False,
        allow_internet_access=body.allow_internet_access,
        allow_out=network.allow_out if network is not None else None,
        deny_out=network.deny_out if network is not None else None,
        allow_public_traffic=network is None or network.allow_public_traffic is not False,
        idempotency_key=key,
    )
    return _sandbox(api, await service.create(req))


async def kill_sandbox(api: ApiContext, sandboxID: str) -> None:
    if not await api.sandboxes.kill(sandboxID):
        raise ApiError(404, f"sandbox {sandboxID} not found")


async def connect_sandbox_v2(api: ApiContext, sandboxID: str, body: ConnectSandbox) -> Reply:
    """200 with the sandbox when it runs; 201 when it was paused and has been resumed."""
    check_timeout(api.cfg, body.timeout)
    try:
        sb, resumed = await api.sandboxes.resume(sandboxID, timeout_s=body.timeout)
    except NotFound:
        # the SDK's connect() turns this 404 into SandboxNotFoundException with this wording
        raise ApiError(404, f"Paused sandbox {sandboxID} not found") from None
    return Reply(_sandbox(api, sb), status=201 if resumed else 200)


async def resume_sandbox(api: ApiContext, sandboxID: str, body: ResumeSandbox) -> Sandbox:
    check_timeout(api.cfg, body.timeout)
    sb = await api.node.db.run(lambda s: get_sandbox(s, sandboxID))
    if sb.state != SandboxState.PAUSED:
        raise ApiError(409, f"sandbox {sandboxID} is {sb.state}, not paused")
    row, _ = await api.sandboxes.resume(sandboxID, timeout_s=body.timeout)
    return _sandbox(api, row)


async def pause_sandbox(api: ApiContext, sandboxID: str, body: PauseSandbox) -> None:
    await api.sandboxes.pause(sandboxID)


async def create_snapshot(api: ApiContext, sandboxID: str, body: NewSnapshot) -> SnapshotInfo:
    await api.node.db.run(lambda s: get_sandbox(s, sandboxID))  # 404 for an unknown sandbox
    snapshot_id = await api.sandboxes.snapshot(sandboxID, name=body.name)
    return SnapshotInfo(snapshot_id=snapshot_id, names=[body.name] if body.name else [])


async def delete_template(api: ApiContext, templateID: str) -> None:
    """A user snapshot, or a built template (see ``TemplateService.delete``: running sandboxes keep going)."""
    if await api.sandboxes.delete_snapshot(templateID):
        return
    if not await api.sandboxes.templates.delete(templateID):
        raise ApiError(404, f"template or snapshot {templateID} not found")


def fork_result(api: ApiContext, child: SandboxRow | Exception) -> ForkResult:
    """A child's row, or the exception that stopped it, mapped like any handler error."""
    if isinstance(child, Exception):
        code, _ = status_for(child)
        return ForkResult(error=Error(code=code, message=f"{type(child).__name__}: {child}"))
    return ForkResult(sandbox=_sandbox(api, child))


async def fork_sandbox(api: ApiContext, sandboxID: str, body: ForkSandbox) -> list[ForkResult]:
    check_timeout(api.cfg, body.timeout)
    await api.node.db.run(lambda s: get_sandbox(s, sandboxID))
    children = await api.sandboxes.fork(sandboxID, count=body.count, timeout_s=body.timeout)
    return [fork_result(api, child) for child in children]


async def update_sandbox_network(api: ApiContext, sandboxID: str, body: NetworkUpdate) -> None:
    await api.sandboxes.update_network(sandboxID, allow_out=body.allow_out, deny_out=body.deny_out)


async def get_sandbox_metrics(api: ApiContext, sandboxID: str, query: SandboxMetricsQuery) -> list[SandboxMetric]:
    """The guest's current figures (envd's /metrics); empty while the sandbox is not running here, or while its
    guest does not answer (it is being paused, or just resumed): a sample is for now, there is none to give."""
    sb = await api.node.db.run(lambda s: get_sandbox(s, sandboxID))
    try:
        doc = await api.sandboxes.guest_metrics(sandboxID)
    except EnvdUnavailable as exc:
        log.info("no metrics of sandbox %s: %s", sandboxID, exc)
        return []
    if doc is None:
        return []
    return [SandboxMetric.from_envd(doc, cpu_count=sb.cpu_count)]


#: how many sandboxes' envd ``list_sandboxes_metrics`` asks at once
_METRICS_CONCURRENCY = 8


async def list_sandboxes_metrics(api: ApiContext, query: SandboxesMetricsQuery) -> SandboxesWithMetrics:
    """The current sample of each listed sandbox that runs on this node (others are left out, as E2B does)."""
    ids = list(dict.fromkeys(query.sandbox_ids))
    rows = await api.node.db.run(lambda s: {sb.id: sb for sb in s.scalars(
        select(SandboxRow).where(SandboxRow.id.in_(ids), SandboxRow.state == SandboxState.RUNNING))})
    found: dict[str, SandboxMetric] = {}
    limiter = trio.CapacityLimiter(_METRICS_CONCURRENCY)

    async def sample(sb: SandboxRow) -> None:
        async with limiter:
            try:
                doc = await api.sandboxes.guest_metrics(sb.id)
            except EnvdUnavailable:
                return  # it stopped answering (being paused, killed): as if it did not run
        if doc is not None:
            found[sb.id] = SandboxMetric.from_envd(doc, cpu_count=sb.cpu_count)

    async with trio.open_nursery() as nursery:
        for sb in rows.values():
            nursery.start_soon(sample, sb)
    return SandboxesWithMetrics(sandboxes={i: found[i] for i in ids if i in found})


#: the least a refresh keeps a sandbox alive (E2B's default and minimum)
REFRESH_MIN_S = 15


async def refresh_sandbox(api: ApiContext, sandboxID: str, body: Refresh) -> None:
    """E2B's refresh: the running sandbox ends no sooner than ``duration`` seconds from now (at least 15)."""
    sb = await api.node.db.run(lambda s: get_sandbox(s, sandboxID))
    if e2b_state(sb.state) != "running":
        raise ApiError(404, f"sandbox {sandboxID} is not running")
    seconds = max(body.duration if body.duration is not None else REFRESH_MIN_S, REFRESH_MIN_S)
    check_timeout(api.cfg, seconds)
    await api.node.db.run(extend_end, sandboxID, seconds)


HANDLERS: dict[str, Handler] = {
    "create_sandbox_v2": create_sandbox_v2,
    "create_sandbox": create_sandbox_v2,
    "kill_sandbox": kill_sandbox,
    "connect_sandbox_v2": connect_sandbox_v2,
    "connect_sandbox": connect_sandbox_v2,
    "resume_sandbox": resume_sandbox,
    "pause_sandbox": pause_sandbox,
    "create_snapshot": create_snapshot,
    "delete_template": delete_template,
    "fork_sandbox": fork_sandbox,
    "update_sandbox_network": update_sandbox_network,
    "get_sandbox_metrics": get_sandbox_metrics,
    "list_sandboxes_metrics": list_sandboxes_metrics,
    "refresh_sandbox": refresh_sandbox,
}
