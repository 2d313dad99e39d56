"""State changes with their events, in one transaction.

DESIGN.md: every state change goes to SQLite in one transaction with its event
row. This module is the only writer of ``sandboxes.state``; it checks the
transition against the lifecycle graph so a bug cannot, say, mark a killed
sandbox running, and it appends the ``events`` row in the same session.
"""

from __future__ import annotations

import datetime as dt
from typing import Any, Iterable, Optional

from sqlalchemy import select
from sqlalchemy.orm import Session

from .errors import IllegalTransition, NotFound
from .models import Event, EventSubject, NetworkSlot, Sandbox, SandboxState, SlotState, utcnow

__all__ = [
    "ALLOWED_TRANSITIONS",
    "insert_sandbox",
    "transition",
    "get_sandbox",
    "record_event",
    "update_sandbox",
    "live_sandboxes",
    "set_end",
    "extend_end",
]

S = SandboxState

#: from-state -> states it may move to.
ALLOWED_TRANSITIONS: dict[SandboxState, frozenset[SandboxState]] = {
    S.CREATING: frozenset({S.RUNNING, S.ERROR, S.KILLING, S.KILLED}),
    S.RUNNING: frozenset({S.PAUSING, S.SNAPSHOTTING, S.FORKING, S.KILLING, S.ERROR}),
    S.PAUSING: frozenset({S.PAUSED, S.RUNNING, S.ERROR, S.KILLING}),
    S.PAUSED: frozenset({S.RESUMING, S.KILLING}),
    S.RESUMING: frozenset({S.RUNNING, S.PAUSED, S.ERROR, S.KILLING}),
    S.SNAPSHOTTING: frozenset({S.RUNNING, S.ERROR, S.KILLING}),
    S.FORKING: frozenset({S.RUNNING, S.ERROR, S.KILLING}),
    S.KILLING: frozenset({S.KILLED, S.ERROR}),
    S.ERROR: frozenset({S.KILLING, S.KILLED}),
    S.KILLED: frozenset(),
}


def record_event(
    session: Session,
    operation: str,
    *,
    sandbox_id: Optional[str] = None,
    subject: EventSubject = EventSubject.SANDBOX,
    subject_id: Optional[str] = None,
    from_state: Optional[str] = None,
    to_state: Optional[str] = None,
    duration_ms: Optional[float] = None,
    error: Optional[str] = None,
    detail: Optional[dict[str, Any]] = None,
) -> Event:
    ev = Event(
        ts=utcnow(),
        sandbox_id=sandbox_id,
        subject=subject,
        subject_id=subject_id if subject_id is not None else sandbox_id,
        operation=operation,
        from_state=from_state,
        to_state=to_state,
        duration_ms=duration_ms,
        error=error,
        detail=detail,
    )
    session.add(ev)
    return ev


def insert_sandbox(session: Session, sandbox: Sandbox, *, operation: str = "create") -> Sandbox:
    """Insert a new sandbox row (state ``creating`` unless set) with its event."""
    if sandbox.state is None:
        sandbox.state = S.CREATING
    session.add(sandbox)
    record_event(session, operation, sandbox_id=sandbox.id, from_state=None, to_state=sandbox.state)
    return sandbox


def get_sandbox(session: Session, sandbox_id: str, *, include_killed: bool = False) -> Sandbox:
    sb = session.get(Sandbox, sandbox_id)
    if sb is None or (not include_killed and sb.state == S.KILLED):
        raise NotFound(f"sandbox {sandbox_id} not found")
    return sb


def transition(
    session: Session,
    sandbox_id: str,
    to_state: SandboxState,
    *,
    operation: str,
    expect: Optional[Iterable[SandboxState]] = None,
    duration_ms: Optional[float] = None,
    error: Optional[str] = None,
    detail: Optional[dict[str, Any]] = None,
    **fields: Any,
) -> Sandbox:
    """Move a sandbox to ``to_state``, set ``fields``, and append the event.

    ``expect`` narrows the states the sandbox may be in (e.g. pause only from
    running); the lifecycle graph is always enforced.
    """
    sb = session.get(Sandbox, sandbox_id)
    if sb is None:
        raise NotFound(f"sandbox {sandbox_id} not found")
    current = SandboxState(sb.state)
    if expect is not None and current not in set(expect):
        raise IllegalTransition(sandbox_id, current, to_state, operation)
    if to_state != current and to_state not in ALLOWED_TRANSITIONS[current]:
        raise IllegalTransition(sandbox_id, current, to_state, operation)
    now = utcnow()
    sb.state = to_state
    sb.updated_at = now
    if to_state == S.PAUSED:
        sb.paused_at = now
    elif to_state == S.KILLED:
        sb.killed_at = now
    if error is not None and to_state == S.ERROR:
        sb.error = error
    for key, value in fields.items():
        if not hasattr(Sandbox, key):
            raise AttributeError(f"Sandbox has no column {key}")
        setattr(sb, key, value)
    record_event(
        session,
        operation,
        sandbox_id=sandbox_id,
        from_state=current.value,
        to_state=to_state.value,
        duration_ms=duration_ms,
        error=error,
        detail=detail,
    )
    return sb


def update_sandbox(
    session: Session,
    sandbox_id: str,
    *,
    operation: str,
    detail: Optional[dict[str, Any]] = None,
    **fields: Any,
) -> Sandbox:
    """Change a live sandbox's fields without a state change, with its event."""
    sb = get_sandbox(session, sandbox_id)
    for key, value in fields.items():
        if not hasattr(Sandbox, key):
            raise AttributeError(f"Sandbox has no column {key}")
        setattr(sb, key, value)
    sb.updated_at = utcnow()
    record_event(session, operation, sandbox_id=sandbox_id, from_state=sb.state,
                 to_state=sb.state, detail=detail)
    return sb


def claim_slot(session: Session, slot_index: int, sandbox_id: str) -> None:
    """Record that a sandbox holds a network slot (in the sandbox's transaction)."""
    row = session.get(NetworkSlot, slot_index)
    if row is not None:
        row.state = SlotState.IN_USE
        row.sandbox_id = sandbox_id
        row.updated_at = utcnow()


def release_slot_of(session: Session, sandbox_id: str) -> None:
    for row in session.scalars(select(NetworkSlot).where(NetworkSlot.sandbox_id == sandbox_id)):
        row.state = SlotState.WARM
        row.sandbox_id = None
        row.updated_at = utcnow()


def live_sandboxes(session: Session) -> list[Sandbox]:
    return list(session.scalars(select(Sandbox).where(Sandbox.state != S.KILLED)))


def seconds_until(when: dt.datetime) -> float:
    return (when - utcnow()).total_seconds()


def set_end(session: Session, sandbox_id: str, timeout_s: int) -> Sandbox:
    """The sandbox now ends ``timeout_s`` seconds from now (E2B's set_timeout), with its event."""
    end = utcnow() + dt.timedelta(seconds=timeout_s)
    return update_sandbox(session, sandbox_id, operation="set_timeout", detail={"timeout_s": timeout_s},
                          end_at=end)


def extend_end(session: Session, sandbox_id: str, seconds: int) -> Sandbox:
    """The sandbox ends no sooner than ``seconds`` from now (E2B's refresh: it never shortens a life), with its
    event when that moves its end."""
    sb = get_sandbox(session, sandbox_id)
    end = utcnow() + dt.timedelta(seconds=seconds)
    if sb.end_at >= end:
        return sb
    return update_sandbox(session, sandbox_id, operation="refresh", detail={"duration_s": seconds}, end_at=end)
