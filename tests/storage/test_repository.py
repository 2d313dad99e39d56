"""Contract tests of the layer repository: the same tests run against posix_fs and s3 (a real moto server
over HTTP)."""

from __future__ import annotations

import hashlib
import os
import random
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from s3server import ACCESS_KEY, REGION, SECRET_KEY, delete_bucket, make_s3_repository, moto_endpoint  # noqa: F401

from aenv_node.storage.repository import (
    DigestMismatch,
    IncompleteSnapshot,
    InvalidName,
    LayerNotFound,
    ManifestNotFound,
    PosixFsRepository,
    Repository,
    RepositoryUnavailable,
    layer_key,
    open_repository,
)

MiB = 1024 * 1024


def digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def write_layer(tmp: Path, data: bytes, name: str | None = None) -> tuple[str, Path]:
    d = digest(data)
    p = tmp / (name or d[7:19])
    p.write_bytes(data)
    return d, p


def pattern(size: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(size)


@pytest.fixture(params=["posix_fs", "s3"])
def repo(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Repository]:
    if request.param == "posix_fs":
        r: Repository = PosixFsRepository(tmp_path / "repo")
        yield r
        r.close()
    else:
        endpoint = request.getfixturevalue("moto_endpoint")
        # Small multipart settings so multipart uploads happen with test-sized layers (5 MiB is S3's minimum).
        r = make_s3_repository(endpoint, multipart_threshold=6 * MiB, part_size=5 * MiB, upload_concurrency=2)
        yield r
        delete_bucket(r)


def no_leftovers(repo: Repository) -> None:
    """Nothing half-written is left: no temp files (posix_fs), no pending multipart upload (s3)."""
    if isinstance(repo, PosixFsRepository):
        tmps = [p for p in repo.root.rglob(".tmp-*")]
        assert tmps == []
    else:
        assert repo.pending_uploads() == []  # type: ignore[attr-defined]


# -- layers ---------------------------------------------------------------------------------------------------
def test_put_read_range_exists_delete(repo: Repository, tmp_path: Path) -> None:
    data = pattern(300_000, 1)
    d, p = write_layer(tmp_path, data)
    assert not repo.has_layer(d)
    loc = repo.put_layer(d, p)
    assert loc == layer_key(d) == f"layers/sha256/{d[7:9]}/{d[7:]}"
    assert repo.has_layer(d)
    assert repo.layer_size(d) == len(data)
    assert repo.read_range(d, 0, 10) == data[:10]
    assert repo.read_range(d, 123_456, 65_536) == data[123_456 : 123_456 + 65_536]
    assert repo.read_range(d, len(data) - 5, 100) == data[-5:]  # clipped at the end
    assert repo.read_range(d, len(data), 10) == b""
    assert repo.read_range(d, 7, 0) == b""
    assert repo.read_layer(d) == data
    assert repo.list_layers() == [d]
    if isinstance(repo, PosixFsRepository):
        assert Path(repo.local_path(d)).read_bytes() == data  # type: ignore[arg-type]
    else:
        assert repo.local_path(d) is None
    # idempotent: a second put of the same content is a no-op
    assert repo.put_layer(d, p) == loc
    assert repo.list_layers() == [d]
    repo.delete_layer(d)
    assert not repo.has_layer(d)
    assert repo.list_layers() == []
    with pytest.raises(LayerNotFound):
        repo.read_range(d, 0, 10)
    with pytest.raises(LayerNotFound):
        repo.layer_size(d)
    repo.delete_layer(d)  # deleting an absent layer is fine
    no_leftovers(repo)


def test_read_range_matches_bytes(repo: Repository, tmp_path: Path) -> None:
    data = pattern(200_003, 2)
    d, p = write_layer(tmp_path, data)
    repo.put_layer(d, p)

    @settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(offset=st.integers(0, len(data) + 10), length=st.integers(0, 70_000))
    def check(offset: int, length: int) -> None:
        assert repo.read_range(d, offset, length) == data[offset : offset + length]

    check()


def test_large_layer_roundtrip(repo: Repository, tmp_path: Path) -> None:
    data = pattern(17 * MiB + 12345, 3)  # s3: multipart, 4 parts of 5 MiB
    d, p = write_layer(tmp_path, data)
    repo.put_layer(d, p)
    assert repo.layer_size(d) == len(data)
    assert hashlib.sha256(repo.read_layer(d)).hexdigest() == d[7:]
    assert repo.read_range(d, 5 * MiB - 3, 10) == data[5 * MiB - 3 : 5 * MiB + 7]  # across a part boundary
    if not isinstance(repo, PosixFsRepository):
        etag = repo.client.head_object(Bucket=repo.bucket, Key=repo.prefix + layer_key(d))["ETag"]  # type: ignore[attr-defined]
        assert etag.strip('"').endswith("-4"), etag  # really went through a 4-part multipart upload
    no_leftovers(repo)


@pytest.mark.parametrize("size", [1000, 17 * MiB])
def test_digest_mismatch_stores_nothing(repo: Repository, tmp_path: Path, size: int) -> None:
    data = pattern(size, 4)
    _, p = write_layer(tmp_path, data)
    wrong = digest(data + b"x")
    with pytest.raises(DigestMismatch) as ei:
        repo.put_layer(wrong, p)
    assert ei.value.expected == wrong and ei.value.actual == digest(data)
    assert not repo.has_layer(wrong)
    assert repo.list_layers() == []
    no_leftovers(repo)


def test_invalid_names(repo: Repository, tmp_path: Path) -> None:
    for bad in ["", "sha256:", "sha256:" + "A" * 64, "md5:" + "a" * 64, "sha256:" + "a" * 63, "../etc"]:
        with pytest.raises(InvalidName):
            repo.has_layer(bad)
    for bad in ["", "../x", "a/b", ".hidden", "x" * 129, "a b"]:
        with pytest.raises(InvalidName):
            repo.put_manifest(bad, {})


# -- manifests ------------------------------------------------------------------------------------------------
def test_manifests(repo: Repository) -> None:
    assert repo.list_manifests() == []
    assert not repo.has_manifest("snap-1")
    with pytest.raises(ManifestNotFound):
        repo.get_manifest("snap-1")
    m = {"id": "snap-1", "parent": None, "layers": {"disk": [], "memory": []}, "n": 1}
    repo.put_manifest("snap-1", m)
    repo.put_manifest("snap-2", {"id": "snap-2"})
    assert repo.get_manifest("snap-1") == m
    assert repo.has_manifest("snap-1")
    assert repo.list_manifests() == ["snap-1", "snap-2"]
    repo.put_manifest("snap-1", {**m, "n": 2})  # replace
    assert repo.get_manifest("snap-1")["n"] == 2
    repo.delete_manifest("snap-1")
    assert repo.list_manifests() == ["snap-2"]
    with pytest.raises(TypeError):
        repo.put_manifest("snap-3", [1, 2])  # type: ignore[arg-type]
    no_leftovers(repo)


def test_commit_snapshot(repo: Repository, tmp_path: Path) -> None:
    base_d, base_p = write_layer(tmp_path, pattern(5000, 5))
    repo.put_layer(base_d, base_p)
    new_d, new_p = write_layer(tmp_path, pattern(7000, 6))
    m = {"id": "s1", "layers": [base_d, new_d]}
    res = repo.commit_snapshot("s1", m, {new_d: new_p, base_d: base_p}, require=[base_d])
    assert res.uploaded == [new_d] and res.already_present == [base_d]
    assert repo.get_manifest("s1") == m
    # A manifest naming a layer that is absent and not given is refused; nothing is written.
    ghost = digest(b"ghost")
    with pytest.raises(IncompleteSnapshot) as ei:
        repo.commit_snapshot("s2", {"layers": [base_d, ghost]}, {}, require=[base_d, ghost])
    assert ei.value.missing == [ghost]
    assert not repo.has_manifest("s2")
    # A failing layer upload leaves no manifest.
    bad_d, bad_p = digest(b"claimed"), write_layer(tmp_path, b"actual", "bad")[1]
    with pytest.raises(DigestMismatch):
        repo.commit_snapshot("s3", {"layers": [bad_d]}, {bad_d: bad_p})
    assert not repo.has_manifest("s3") and not repo.has_layer(bad_d)
    assert repo.list_manifests() == ["s1"]
    no_leftovers(repo)


# -- atomicity under a slow commit ----------------------------------------------------------------------------
def _feed_fifo(path: Path, data: bytes, piece: int, delay: float) -> None:
    with open(path, "wb", buffering=0) as f:
        for i in range(0, len(data), piece):
            f.write(data[i : i + piece])
            time.sleep(delay)


def test_reader_never_sees_partial_commit(repo: Repository, tmp_path: Path) -> None:
    """A reader polling while a slow commit runs sees either nothing or complete layers and a manifest whose
    layers are all present and intact.  The layer sources are pipes fed slowly by a thread."""
    datas = [pattern(13 * MiB + 7, 7), pattern(2 * MiB + 1, 8)]  # s3: one multipart, one single PUT
    digests = [digest(x) for x in datas]
    fifos = []
    for i in range(2):
        f = tmp_path / f"fifo{i}"
        os.mkfifo(f)
        fifos.append(f)

    def feeder() -> None:
        for f, data in zip(fifos, datas):
            _feed_fifo(f, data, MiB, 0.04)

    seen = {"polls": 0, "layer_seen": 0, "manifest_seen": 0}
    violations: list[str] = []
    done = threading.Event()

    def poller() -> None:
        while True:
            finished = done.is_set()
            seen["polls"] += 1
            for d, data in zip(digests, datas):
                if repo.has_layer(d):
                    seen["layer_seen"] += 1
                    if repo.layer_size(d) != len(data) or digest(repo.read_layer(d)) != d:
                        violations.append(f"partial layer {d}")
            if repo.has_manifest("snap"):
                seen["manifest_seen"] += 1
                for d in repo.get_manifest("snap")["layers"]:
                    if not repo.has_layer(d):
                        violations.append(f"manifest visible before layer {d}")
            if finished:
                return
            time.sleep(0.01)

    threads = [threading.Thread(target=feeder), threading.Thread(target=poller)]
    for t in threads:
        t.start()
    try:
        repo.commit_snapshot("snap", {"layers": digests}, dict(zip(digests, fifos)))
    finally:
        done.set()
        for t in threads:
            t.join(60)
    assert violations == []
    assert seen["polls"] >= 10  # the reader really polled during the commit
    assert seen["manifest_seen"] >= 1 and seen["layer_seen"] >= 2  # and finally saw it complete
    assert repo.get_manifest("snap") == {"layers": digests}
    no_leftovers(repo)


def test_truncated_source_leaves_nothing(repo: Repository, tmp_path: Path) -> None:
    """The writer of a large layer dies half way (the pipe closes early): nothing becomes visible, and no
    multipart upload is left pending."""
    data = pattern(16 * MiB, 9)
    d = digest(data)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    t = threading.Thread(target=_feed_fifo, args=(fifo, data[: 11 * MiB], MiB, 0.0))
    t.start()
    try:
        with pytest.raises(DigestMismatch):
            repo.put_layer(d, fifo)
    finally:
        t.join(30)
    assert not repo.has_layer(d)
    assert repo.list_layers() == []
    no_leftovers(repo)


# -- s3 specifics ---------------------------------------------------------------------------------------------
def test_s3_failed_part_aborts_upload(moto_endpoint: str, tmp_path: Path) -> None:
    """S3 rejects a part (injected by a botocore event handler on the real client): the upload is aborted,
    the layer is not visible, no pending upload remains."""
    repo = make_s3_repository(moto_endpoint, multipart_threshold=6 * MiB, part_size=5 * MiB, upload_concurrency=1)
    try:
        data = pattern(16 * MiB, 10)
        d, p = write_layer(tmp_path, data)
        calls = []

        def fail_third_part(params, **_kw):  # type: ignore[no-untyped-def]
            calls.append(params["PartNumber"])
            if params["PartNumber"] == 3:
                raise RuntimeError("injected failure while sending part 3")

        repo.client.meta.events.register("provide-client-params.s3.UploadPart", fail_third_part)
        with pytest.raises(RuntimeError, match="part 3"):
            repo.put_layer(d, p)
        assert calls == [1, 2, 3]
        assert not repo.has_layer(d)
        assert repo.pending_uploads() == []
        repo.client.meta.events.unregister("provide-client-params.s3.UploadPart", fail_third_part)
        repo.put_layer(d, p)  # and a retry succeeds
        assert digest(repo.read_layer(d)) == d
    finally:
        delete_bucket(repo)


def test_sweep_incomplete(repo: Repository, tmp_path: Path) -> None:
    if isinstance(repo, PosixFsRepository):
        stale = repo.root / "layers" / "sha256" / "ab"
        stale.mkdir(parents=True)
        old = stale / ".tmp-abc-123"
        old.write_bytes(b"half")
        os.utime(old, (time.time() - 7200, time.time() - 7200))
        fresh = repo.root / "manifests" / ".tmp-x-1"
        fresh.write_bytes(b"{")
        assert repo.sweep_incomplete(3600) == 1
        assert not old.exists() and fresh.exists()
        assert repo.sweep_incomplete(0) == 1
    else:
        c = repo.client  # type: ignore[attr-defined]
        key = repo.prefix + "layers/sha256/ab/" + "ab" * 32  # type: ignore[attr-defined]
        c.create_multipart_upload(Bucket=repo.bucket, Key=key)  # type: ignore[attr-defined]
        assert len(repo.pending_uploads()) == 1  # type: ignore[attr-defined]
        # (moto reports a fixed 2010 'Initiated' time, so the age cut-off is only exercised on posix_fs)
        assert repo.sweep_incomplete(0) == 1
    no_leftovers(repo)
    assert repo.list_layers() == []


def test_s3_unreachable_is_typed(tmp_path: Path) -> None:
    from aenv_node.storage.repository import S3Repository

    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    repo = S3Repository(
        bucket="b", region=REGION, endpoint_url=f"http://127.0.0.1:{port}", access_key_id=ACCESS_KEY,
        secret_access_key=SECRET_KEY, max_attempts=2, connect_timeout_s=1,
    )
    with pytest.raises(RepositoryUnavailable, match="cannot reach"):
        repo.has_layer(digest(b"x"))
    repo.close()


def test_open_repository(tmp_path: Path, moto_endpoint: str) -> None:
    r = open_repository("posix_fs", path=tmp_path / "r")
    assert isinstance(r, PosixFsRepository) and (tmp_path / "r" / "manifests").is_dir()
    s3 = open_repository(
        "s3", endpoint_url=moto_endpoint, bucket="open-repo-test", region=REGION, prefix="p",
        access_key_id=ACCESS_KEY, secret_access_key=SECRET_KEY,
    )
    assert s3.kind == "s3" and s3.prefix == "p/"  # type: ignore[attr-defined]
    s3.ensure_bucket()  # type: ignore[attr-defined]
    s3.put_manifest("m", {"a": 1})
    assert s3.get_manifest("m") == {"a": 1}
    delete_bucket(s3)
    with pytest.raises(ValueError, match="unknown repository kind"):
        open_repository("ftp")
    with pytest.raises(ValueError, match="region"):
        open_repository("s3", bucket="b", region="")
