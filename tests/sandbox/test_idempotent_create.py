"""Idempotent creates with the unmodified E2B SDK (``Sandbox.create(idempotency_key=...)`` sends the
``Idempotency-Key`` header): a retried create gets the same sandbox, concurrent ones make one, another request
with the key is a 409 with E2B's ``error_code``, and no second sandbox is ever made."""

from __future__ import annotations

import threading
import uuid

import httpx
import pytest
from e2b import Sandbox, SandboxException

from .conftest import NodeProcess

pytestmark = pytest.mark.vm


def _count(node: NodeProcess, marker: str) -> int:
    rows = node.sql(f"SELECT count(*) FROM sandboxes WHERE json_extract(metadata, '$.marker') = '{marker}'")
    return int(rows[0][0])


def test_a_retried_create_gets_the_same_sandbox(sdk_env: NodeProcess) -> None:
    marker, key = uuid.uuid4().hex, f"retry-{uuid.uuid4().hex}"
    first = Sandbox.create(metadata={"marker": marker}, idempotency_key=key)
    try:
        again = Sandbox.create(metadata={"marker": marker}, idempotency_key=key)
        assert again.sandbox_id == first.sandbox_id
        assert again.commands.run("echo same").stdout == "same\n"  # the replayed answer reaches envd
        assert _count(sdk_env, marker) == 1
        assert sdk_env.sql(f"SELECT sandbox_id FROM idempotency_keys WHERE key = '{key}'") == [(first.sandbox_id,)]
        # the same key with another request: refused, naming the key's sandbox; nothing is created
        with pytest.raises(SandboxException, match="409") as err:
            Sandbox.create(metadata={"marker": marker, "other": "yes"}, idempotency_key=key)
        assert first.sandbox_id in str(err.value)
        raw = httpx.post(f"{sdk_env.url}/v2/sandboxes", headers={"X-API-KEY": sdk_env.api_key,
                                                                 "Idempotency-Key": key},
                         json={"templateID": "base"}, timeout=60)
        assert raw.status_code == 409 and raw.json()["error_code"] == "idempotency_request_mismatch", raw.text
        bad = httpx.post(f"{sdk_env.url}/v2/sandboxes", headers={"X-API-KEY": sdk_env.api_key,
                                                                 "Idempotency-Key": "has space"},
                         json={"templateID": "base"}, timeout=60)
        assert bad.status_code == 400 and "Idempotency-Key" in bad.json()["message"]
        assert _count(sdk_env, marker) == 1
        # killed after it ran: a late retry still gets that answer back, not a new sandbox
        first.kill()
        late = httpx.post(f"{sdk_env.url}/v2/sandboxes", headers={"X-API-KEY": sdk_env.api_key,
                                                                  "Idempotency-Key": key},
                          json={"templateID": "base", "metadata": {"marker": marker}}, timeout=60)
        assert late.status_code == 201 and late.json()["sandboxID"] == first.sandbox_id, late.text
        assert _count(sdk_env, marker) == 1
    finally:
        first.kill()


def test_concurrent_creates_with_one_key_make_one_sandbox(sdk_env: NodeProcess) -> None:
    marker, key = uuid.uuid4().hex, f"burst-{uuid.uuid4().hex}"
    ids: list[str] = []
    errors: list[BaseException] = []

    def create() -> None:
        try:
            ids.append(Sandbox.create(metadata={"marker": marker}, idempotency_key=key).sandbox_id)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=create) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    try:
        assert not errors, errors
        assert len(ids) == 4 and len(set(ids)) == 1, ids
        assert _count(sdk_env, marker) == 1
    finally:
        for sid in set(ids):
            Sandbox.kill(sid)
