"""Faults of the shared snapshot repository, on a node whose repository is S3 (moto, a real S3 server over
HTTP) reached through a fault proxy on loopback (``faultproxy.py``): down, answering 500 and 503, slow. And a
corrupt manifest and a corrupt layer in a posix_fs repository that a second node resumes from.

What must hold: local work goes on (create, pause, a resume of a sandbox this node holds); what needs the
repository fails with a clear E2B error (503 "the snapshot repository is unavailable: ...", 502 for bad data)
and leaves the sandbox as it was; a pause whose publish failed is published once the fault clears.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Iterator
from urllib.parse import urlparse

import httpx
import pytest
from e2b import Sandbox

from ..conftest import free_pool_cidr, free_port
from ..storage.s3server import (  # noqa: F401  (moto_endpoint is a fixture)
    ACCESS_KEY,
    REGION,
    SECRET_KEY,
    delete_bucket,
    make_s3_repository,
    moto_endpoint,
)
from .conftest import NodeProcess, node_in_tmp, start_node, stop_node
from .faultproxy import FaultProxy

pytestmark = pytest.mark.vm

MARK = "/home/user/repo-fault.txt"


def _wait(predicate: Callable[[], bool], what: str, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.3)


def _assert_e2b_error(r: httpx.Response, status: int, contains: str) -> None:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert body["code"] == status and contains in body["message"], body


@pytest.fixture
def s3_node(moto_endpoint: str,  # noqa: F811
            monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[NodeProcess, FaultProxy, Any]]:
    repo = make_s3_repository(moto_endpoint)
    up = urlparse(moto_endpoint)
    proxy = FaultProxy(up.hostname or "127.0.0.1", up.port or 80)
    try:
        with node_in_tmp("aenv-s3fault-", AENV_NET_WARM_SLOTS="1",
                         AENV_STORAGE_REPOSITORY="s3", AENV_STORAGE_S3_ENDPOINT=proxy.url,
                         AENV_STORAGE_S3_BUCKET=repo.bucket, AENV_STORAGE_S3_REGION=REGION,
                         AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY,
                         # botocore's attempts, fewer, so each fault is given up on in seconds
                         AENV_STORAGE_S3_MAX_ATTEMPTS="2", AENV_SNAPSHOT_PUBLISH_RETRY_INTERVAL_S="1") as node:
            for k, v in node.sdk_env().items():
                monkeypatch.setenv(k, v)
            yield node, proxy, repo
    finally:
        proxy.close()
        delete_bucket(repo)


def _published(node: NodeProcess, sid: str) -> bool:
    rows = node.sql(f"SELECT s.published FROM sandboxes b JOIN snapshots s ON s.id = b.snapshot_id "
                    f"WHERE b.id = '{sid}' AND b.state = 'paused'")
    return bool(rows and rows[0][0])


def _paused_with_mark(node: NodeProcess) -> str:
    sb = Sandbox.create(timeout=600)
    sb.files.write(MARK, f"kept by {sb.sandbox_id}")
    sb.pause()
    return sb.sandbox_id


def test_s3_down_erroring_and_slow(s3_node: tuple[NodeProcess, FaultProxy, Any]) -> None:
    node, proxy, repo = s3_node
    held = _paused_with_mark(node)
    doomed = _paused_with_mark(node)
    _wait(lambda: _published(node, held) and _published(node, doomed), "the first pauses were not published")
    assert proxy.connections > 0  # the node's repository traffic goes through the proxy
    Sandbox.connect(doomed, timeout=600)  # its record now says running here
    assert repo.get_ownership(doomed) is not None

    for mode, status in (("down", 0), ("error", 503), ("error", 500)):
        proxy.set(mode, status=status)
        # local work goes on: a create and a pause need no repository
        cut = _paused_with_mark(node)
        _wait(lambda: bool(node.sql(f"SELECT 1 FROM events WHERE sandbox_id = '{cut}' "  # noqa: B023
                                    "AND operation = 'snapshot_publish' AND error IS NOT NULL")),
              f"{mode} {status}: no failed publish recorded")
        assert not _published(node, cut)
        # a resume must claim the sandbox in the repository: a clear 503, and the sandbox stays paused
        with node.api() as c:
            r = c.post(f"/sandboxes/{held}/connect", json={"timeout": 600})
        _assert_e2b_error(r, 503, "the snapshot repository is unavailable")
        assert node.sql(f"SELECT state FROM sandboxes WHERE id = '{held}'") == [("paused",)]
        if mode == "down":  # a kill succeeds; the record it could not delete is deleted once the fault clears
            with node.api() as c:
                assert c.delete(f"/sandboxes/{doomed}").status_code == 204
            unsettled = lambda: node.sql(f"SELECT error IS NOT NULL FROM events "  # noqa: E731
                                         f"WHERE sandbox_id = '{doomed}' AND operation = 'ownership_settle'")
            _wait(lambda: bool(unsettled()), "the record the kill could not delete is not recorded")
            assert set(unsettled()) == {(1,)}

        # the fault clears: the failed publish is retried, and the resume works
        proxy.set("pass")
        _wait(lambda: _published(node, cut), f"{mode} {status}: the failed publish was not retried")  # noqa: B023
        if mode == "down":
            # the retry deletes the record, then commits its event: wait for the event, then check the record
            # (checked the other way round, the test could read the event between the two)
            _wait(lambda: node.sql(f"SELECT error IS NULL FROM events WHERE sandbox_id = '{doomed}' "
                                   "AND operation = 'ownership_settle' ORDER BY id DESC LIMIT 1") == [(1,)],
                  "the killed sandbox's record was not settled")
            assert repo.get_ownership(doomed) is None
        back = Sandbox.connect(cut, timeout=600)
        assert back.files.read(MARK) == f"kept by {cut}"
        back.kill()

    # slow: every connection waits 2 s; the repository's work is slower, nothing fails
    proxy.set("slow", delay=2)
    t0 = time.monotonic()
    back = Sandbox.connect(held, timeout=600)
    assert time.monotonic() - t0 > 2
    assert back.files.read(MARK) == f"kept by {held}"
    back.pause()
    _wait(lambda: _published(node, held), "the slow publish did not finish")
    proxy.set("pass")
    Sandbox.kill(held)


def test_corrupt_manifest_and_layer_in_the_repository(monkeypatch: pytest.MonkeyPatch) -> None:
    """A second node resumes a sandbox the first paused; the repository's copy of its snapshot is corrupt
    (a manifest that is not JSON, then a layer whose bytes do not match their digest): a clear 502, the
    second node keeps nothing of the import, and the sandbox resumes once the repository is whole again."""
    tag = f"{os.getpid()}-{random.randrange(10**6)}"
    repo = Path("/var/tmp") / f"aenv-corrupt-repo-{tag}"
    states = [Path("/var/tmp") / f"aenv-corrupt-{i}-{tag}" for i in (1, 2)]
    first = second = None
    try:
        first = start_node(states[0], port=free_port(), pool=free_pool_cidr(), AENV_NET_WARM_SLOTS="1",
                           AENV_STORAGE_REPOSITORY_PATH=str(repo))
        for k, v in first.sdk_env().items():
            monkeypatch.setenv(k, v)
        sid = _paused_with_mark(first)
        _wait(lambda: _published(first, sid), "the pause was not published")  # type: ignore[arg-type]
        snap = first.sql(f"SELECT snapshot_id FROM sandboxes WHERE id = '{sid}'")[0][0]
        stop_node(first.proc)
        second = start_node(states[1], port=free_port(), pool=free_pool_cidr(), AENV_NET_WARM_SLOTS="1",
                            AENV_STORAGE_REPOSITORY_PATH=str(repo))
        for k, v in second.sdk_env().items():
            monkeypatch.setenv(k, v)

        manifest = repo / "manifests" / f"{snap}.json"
        good = manifest.read_bytes()
        manifest.write_bytes(good[: len(good) // 2])  # torn: not JSON
        with second.api() as c:
            r = c.post(f"/sandboxes/{sid}/connect", json={"timeout": 600})
        _assert_e2b_error(r, 502, f"manifest '{snap}' in the repository is corrupt")
        assert second.sql(f"SELECT count(*) FROM snapshots WHERE id = '{snap}'") == [(0,)]
        manifest.write_bytes(good)

        # the pause's memory layer (the pages it dirtied; read whole by a resume): one byte flipped
        newest = json.loads(good)["memory_layers"][-1].removeprefix("sha256:")
        victim = repo / "layers" / "sha256" / newest[:2] / newest
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
        with second.api() as c:
            r = c.post(f"/sandboxes/{sid}/connect", json={"timeout": 600})
        _assert_e2b_error(r, 502, "")
        assert second.sql(f"SELECT state FROM sandboxes WHERE id = '{sid}'") in ([], [("paused",)])
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))

        back = Sandbox.connect(sid, timeout=600)
        assert back.files.read(MARK) == f"kept by {sid}"
        back.kill()
    finally:
        for i, n in enumerate((first, second)):
            if n is not None:
                stop_node(n.proc)
                shutil.copy(n.log_path, f"/var/tmp/aenv-corrupt-last-node-{i + 1}.log")
        for d in [repo, *states]:
            shutil.rmtree(d, ignore_errors=True)
