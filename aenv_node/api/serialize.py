"""Rows to E2B JSON models (reference/e2b-protocol.md section 3).

E2B's models know two sandbox states, ``running`` and ``paused``; the node has
more. ``e2b_state`` folds them; sandboxes in ``error`` or ``killed`` are not
E2B-visible (the native ``/events`` and the CLI show them).
"""

from __future__ import annotations

import datetime as dt
from typing import Any, Optional

from ..state import Event, Sandbox, SandboxState, Snapshot, Template

__all__ = ["rfc3339", "e2b_state", "listed_sandbox", "sandbox_detail", "event_json", "template_json"]

_RUNNING_LIKE = {
    SandboxState.CREATING.value,
    SandboxState.RUNNING.value,
    SandboxState.SNAPSHOTTING.value,
    SandboxState.FORKING.value,
    SandboxState.RESUMING.value,
}
_PAUSED_LIKE = {SandboxState.PAUSING.value, SandboxState.PAUSED.value}


def rfc3339(ts: Optional[dt.datetime]) -> Optional[str]:
    if ts is None:
        return None
    return ts.astimezone(dt.timezone.utc).isoformat().replace("+00:00", "Z")


def e2b_state(state: str) -> Optional[str]:
    if state in _RUNNING_LIKE:
        return "running"
    if state in _PAUSED_LIKE:
        return "paused"
    return None


def listed_sandbox(sb: Sandbox) -> dict[str, Any]:
    out: dict[str, Any] = {
        "templateID": sb.template_id,
        "sandboxID": sb.id,
        "clientID": sb.client_id or sb.node_id,
        "startedAt": rfc3339(sb.started_at),
        "endAt": rfc3339(sb.end_at),
        "cpuCount": sb.cpu_count,
        "memoryMB": sb.memory_mb,
        "diskSizeMB": sb.disk_size_mb,
        "metadata": dict(sb.metadata_ or {}),
        "state": e2b_state(sb.state) or sb.state,
        "envdVersion": sb.envd_version,
    }
    if sb.alias:
        out["alias"] = sb.alias
    return out


def sandbox_detail(sb: Sandbox, *, domain: str = "") -> dict[str, Any]:
    out = listed_sandbox(sb)
    out["envdAccessToken"] = sb.envd_access_token
    out["allowInternetAccess"] = sb.allow_internet_access
    out["domain"] = domain or None
    out["lifecycle"] = {
        "autoResume": sb.auto_resume,
        "onTimeout": "pause" if sb.auto_pause else "kill",
    }
    if sb.network_policy:
        out["network"] = sb.network_policy
    return out


def event_json(ev: Event) -> dict[str, Any]:
    return {
        "id": ev.id,
        "ts": rfc3339(ev.ts),
        "sandboxID": ev.sandbox_id,
        "subject": ev.subject,
        "subjectID": ev.subject_id,
        "operation": ev.operation,
        "fromState": ev.from_state,
        "toState": ev.to_state,
        "durationMs": ev.duration_ms,
        "error": ev.error,
        "detail": ev.detail,
    }


def template_json(t: Template) -> dict[str, Any]:
    return {
        "templateID": t.id,
        "aliases": [t.alias] if t.alias else [],
        "cpuCount": t.cpu_count,
        "memoryMB": t.memory_mb,
        "diskSizeMB": t.disk_size_mb,
        "envdVersion": t.envd_version,
        "createdAt": rfc3339(t.created_at),
        "updatedAt": rfc3339(t.updated_at),
        "public": False,
        "buildStatus": t.status,
        "kind": t.kind,
    }


def snapshot_json(sn: Snapshot) -> dict[str, Any]:
    return {
        "snapshotID": sn.id,
        "names": [sn.name] if sn.name else [],
        "parentID": sn.parent_id,
        "sourceSandboxID": sn.source_sandbox_id,
        "kind": sn.kind,
        "status": sn.status,
        "createdAt": rfc3339(sn.created_at),
    }
