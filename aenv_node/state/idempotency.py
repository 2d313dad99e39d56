"""Idempotent creates (the ``idempotency_keys`` table): the one module that records, replays and expires them.

E2B's SDKs send an ``Idempotency-Key`` header with ``POST /v2/sandboxes`` so that a create they retry (a
timeout, a dropped connection, a 503 while a node restarts) cannot make a second sandbox. The key is recorded
in the transaction that inserts the sandbox (:func:`record`); a request with a known key gets that sandbox
back (:func:`prior_create`) if it is the same request (same hash), and an :class:`IdempotencyMismatch`
otherwise. A create that never ran (it failed, or the node died under it, so the sandbox was never
``running``) does not hold its key: the retry creates anew. Keys go after :data:`KEY_TTL`.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from collections.abc import Mapping
from typing import Any, Optional

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from .errors import IdempotencyMismatch
from .models import Event, IdempotencyKey, Sandbox, SandboxState

__all__ = ["KEY_TTL", "expire_keys", "prior_create", "record", "request_hash"]

#: How long a key is remembered (E2B's and most APIs' window for a retry).
KEY_TTL = dt.timedelta(hours=24)


def request_hash(request: Mapping[str, Any]) -> str:
    """A stable hash of a request's effective fields (canonical JSON)."""
    return hashlib.sha256(json.dumps(request, sort_keys=True, separators=(",", ":"), default=str)
                          .encode()).hexdigest()


def prior_create(s: Session, key: str, digest: str) -> Optional[str]:
    """The sandbox an earlier create with ``key`` made, if the retry should get it back; None when the key is
    new or its create never ran (its record is dropped then). Raises IdempotencyMismatch for another request."""
    row = s.get(IdempotencyKey, key)
    if row is None:
        return None
    if row.request_hash != digest:
        raise IdempotencyMismatch(key, row.sandbox_id)
    sb = s.get(Sandbox, row.sandbox_id)
    ran = s.scalar(select(Event.id).where(Event.sandbox_id == row.sandbox_id,
                                          Event.to_state == SandboxState.RUNNING.value).limit(1))
    if sb is None or (ran is None and sb.state in (SandboxState.KILLED, SandboxState.ERROR)):
        s.delete(row)
        return None
    return row.sandbox_id


def record(s: Session, key: str, digest: str, sandbox_id: str) -> None:
    """Remember that ``key`` created ``sandbox_id`` (in the transaction that inserts the sandbox)."""
    s.flush()  # the sandbox row first: without a relationship the unit of work does not order the two
    s.add(IdempotencyKey(key=key, request_hash=digest, sandbox_id=sandbox_id))


def expire_keys(s: Session, before: dt.datetime) -> int:
    """Forget the keys recorded before ``before``; how many."""
    result = s.execute(delete(IdempotencyKey).where(IdempotencyKey.created_at < before))
    return int(getattr(result, "rowcount", 0) or 0)
