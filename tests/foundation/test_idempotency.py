"""Idempotency keys on real SQLite: a retry gets the sandbox back, another request with the key is refused, a
create that never ran frees its key, keys expire and go with their sandbox."""

from __future__ import annotations

import datetime as dt

import pytest
from sqlalchemy import select

from aenv_node.state import Database, IdempotencyKey, IdempotencyMismatch, Sandbox, SandboxState, utcnow
from aenv_node.state import repository as repo
from aenv_node.state.idempotency import expire_keys, prior_create, record, request_hash



def _create(db: Database, sid: str, key: str, digest: str, *, runs: bool) -> None:
    with db.session() as s:
        repo.insert_sandbox(s, Sandbox(id=sid, template_id="base"))
        record(s, key, digest, sid)
    if runs:
        with db.session() as s:
            repo.transition(s, sid, SandboxState.RUNNING, operation="create")


def test_request_hash_is_canonical() -> None:
    assert request_hash({"a": 1, "b": [1, 2]}) == request_hash({"b": [1, 2], "a": 1})
    assert request_hash({"a": 1}) != request_hash({"a": 2})


def test_a_retry_gets_the_sandbox_and_another_request_is_refused(db: Database) -> None:
    digest = request_hash({"template": "base"})
    _create(db, "sb1", "k1", digest, runs=True)
    with db.session() as s:
        assert prior_create(s, "k1", digest) == "sb1"
        assert prior_create(s, "k2", digest) is None
        with pytest.raises(IdempotencyMismatch, match="sb1"):
            prior_create(s, "k1", request_hash({"template": "other"}))
    with db.session() as s:  # killed after it ran: the retry still gets it (the first answer, again)
        repo.transition(s, "sb1", SandboxState.KILLING, operation="kill")
        repo.transition(s, "sb1", SandboxState.KILLED, operation="kill")
    with db.session() as s:
        assert prior_create(s, "k1", digest) == "sb1"


def test_a_create_that_never_ran_frees_its_key(db: Database) -> None:
    digest = request_hash({"template": "base"})
    _create(db, "sb1", "k1", digest, runs=False)
    with db.session() as s:  # e.g. the node died under the create: reconcile marked it killed
        repo.transition(s, "sb1", SandboxState.KILLING, operation="reconcile")
        repo.transition(s, "sb1", SandboxState.KILLED, operation="reconcile")
    with db.session() as s:
        assert prior_create(s, "k1", digest) is None
    with db.session() as s:
        assert s.get(IdempotencyKey, "k1") is None
        record(s, "k1", digest, "sb1")  # the retry's own create may take the key again


def test_keys_expire_and_go_with_their_sandbox(db: Database) -> None:
    digest = request_hash({})
    _create(db, "sb1", "k1", digest, runs=True)
    _create(db, "sb2", "k2", digest, runs=True)
    with db.session() as s:
        assert expire_keys(s, utcnow() - dt.timedelta(hours=1)) == 0
        s.get(IdempotencyKey, "k1").created_at = utcnow() - dt.timedelta(days=2)
    with db.session() as s:
        assert expire_keys(s, utcnow() - dt.timedelta(hours=24)) == 1
        s.delete(s.get(Sandbox, "sb2"))
    with db.session() as s:
        assert list(s.scalars(select(IdempotencyKey))) == []
