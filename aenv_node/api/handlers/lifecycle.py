"""E2B sandbox lifecycle routes, served by the sandbox service: create, kill, connect, resume, pause,
snapshots, fork, network, metrics.

Each reaches the service through ``api.sandboxes`` (a 501 when the node runs none). Errors are the
service's typed exceptions, mapped by the API's one table (``errors.py``); a handler raises an
``ApiError`` itself only where E2B's SDK reads a particular message (connect's "Paused sandbox ...
not found") or for a condition the service does not know (a timeout over the node's maximum).
"""

from __future__ import annotations

import re

from quart import request

from ...state import Sandbox as SandboxRow
from ...state import SandboxState
from ...state.errors import NotFound
from ...state.repository import get_sandbox
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
    ResumeSandbox,
    Sandbox,
    SandboxMetric,
    SnapshotInfo,
)
from .sandboxes import check_timeout

# what E2B's SDK sends ([a-z0-9-]), and the other characters such keys commonly have
_IDEMPOTENCY_KEY = re.compile(r"[A-Za-z0-9_-]{1,255}")


def _sandbox(api: ApiContext, row: SandboxRow) -> Sandbox:
    return Sandbox.from_row(row, node_id=api.node.node_id, domain=api.cfg.api.domain)


async def create_sandbox_v2(api: ApiContext, body: NewSandbox) -> Sandbox:
    service = api.sandboxes
    cfg = api.cfg.sandbox
    timeout = body.timeout if body.timeout is not None else cfg.default_timeout_s
    check_timeout(api.cfg, timeout)
    network = body.network
    key = request.headers.get("Idempotency-Key")
    if key is not None and not _IDEMPOTENCY_KEY.fullmatch(key):
        raise ApiError(400, "Idempotency-Key must be 1 to 255 letters, digits, '-' or '_'")
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


async def get_sandbox_metrics(api: ApiContext, sandboxID: str) -> list[SandboxMetric]:
    """The guest's current figures (envd's /metrics); empty while the sandbox is not running here."""
    sb = await api.node.db.run(lambda s: get_sandbox(s, sandboxID))
    doc = await api.sandboxes.guest_metrics(sandboxID)
    if doc is None:
        return []
    return [SandboxMetric.from_envd(doc, cpu_count=sb.cpu_count)]


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
}
