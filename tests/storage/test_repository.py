"""Contract tests of the layer repository: the same tests run against posix_fs and s3 (a real moto server
over HTTP)."""

from __future__ import annotations

import hashlib
import os
import random
import threading
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from s3server import (  # noqa: F401
    ACCESS_KEY,
    REGION,
    SECRET_KEY,
    big_s3,
    delete_bucket,
    make_s3_repository,
    moto_endpoint,
)

from aenv_node.storage.repository import (
    OWNER_PAUSED,
    OWNER_RUNNING,
    DigestMismatch,
    IncompleteSnapshot,
    InvalidName,
    LayerNotFound,
    ManifestNotFound,
    OwnershipChanged,
    OwnershipConflict,
    OwnershipUnsupported,
    PosixFsRepository,
    Repository,
    RepositoryUnavailable,
    layer_key,
    open_repository,
    sandbox_record_id,
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
def test_s3_failed_part_aborts_upload(moto_endpoint: str, tmp_path: Path) -> None:  # noqa: F811 - a fixture from s3server
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


def test_a_linked_upload_of_an_old_layer_survives_the_sweep_of_cut_uploads(tmp_path: Path) -> None:
    """A layer made long ago is linked into a repository on its filesystem; while the link is hashed, the
    repository's collector sweeps uploads older than its grace: the upload is not taken for a cut one (the
    link had the source's old mtime until it was in place, and a publish of the base layer failed with
    ENOENT under a collector running every 2 s)."""
    repo = PosixFsRepository(tmp_path / "repo")
    src = tmp_path / "old.layer"
    src.write_bytes(os.urandom(32 << 20))
    long_ago = time.time() - 86400
    os.utime(src, (long_ago, long_ago))
    d = "sha256:" + hashlib.sha256(src.read_bytes()).hexdigest()
    swept = 0
    done = threading.Event()

    def sweep() -> None:
        nonlocal swept
        while not done.is_set():
            swept += repo.sweep_incomplete(60)

    sweeper = threading.Thread(target=sweep)
    sweeper.start()
    try:
        for _ in range(5):
            repo.put_layer(d, src)
            repo.delete_layer(d)
            os.utime(src, (long_ago, long_ago))
    finally:
        done.set()
        sweeper.join()
    assert swept == 0
    no_leftovers(repo)


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


def test_open_repository(tmp_path: Path, moto_endpoint: str) -> None:  # noqa: F811 - a fixture from s3server
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


# -- sandbox ownership (compare-and-swap) ---------------------------------------------------------------------


def test_ownership_lifecycle(repo: Repository) -> None:
    sid = "i0123456789abcdef0123"
    assert repo.get_ownership(sid) is None
    assert repo.drop_ownership(sid, "a") is False
    # a first pause publishes: absent -> paused, owner a
    r1 = repo.release_sandbox(sid, "a", "snap-1")
    assert (r1.owner, r1.state, r1.generation, r1.snapshot_id) == ("a", OWNER_PAUSED, 1, "snap-1")
    assert repo.get_ownership(sid) == r1
    doc = repo.get_manifest(sandbox_record_id(sid))
    assert doc["snapshot_id"] == "snap-1" and doc["published_at"] > 0  # still the pointer importers read
    # b claims it (paused: anyone may); the snapshot it names stays
    r2 = repo.claim_sandbox(sid, "b")
    assert (r2.owner, r2.state, r2.generation, r2.snapshot_id) == ("b", OWNER_RUNNING, 2, "snap-1")
    # now a may neither claim, publish nor delete it
    with pytest.raises(OwnershipConflict, match="is running on node b") as ei:
        repo.claim_sandbox(sid, "a")
    assert ei.value.owner == "b" and ei.value.state == OWNER_RUNNING
    with pytest.raises(OwnershipConflict):
        repo.release_sandbox(sid, "a", "snap-x")
    with pytest.raises(OwnershipConflict):
        repo.drop_ownership(sid, "a")
    assert repo.get_ownership(sid) == r2
    # the owner re-claims idempotently, then pauses it at a newer snapshot
    assert repo.claim_sandbox(sid, "b").generation == 3
    r4 = repo.release_sandbox(sid, "b", "snap-2")
    assert (r4.owner, r4.state, r4.generation, r4.snapshot_id) == ("b", OWNER_PAUSED, 4, "snap-2")
    # a swap against a version that moved on is refused, never applied
    stale = r1  # paused, as first read: the decision to claim was right then
    with pytest.raises(OwnershipChanged):
        repo.claim_sandbox(sid, "a", expect=stale)
    with pytest.raises(OwnershipChanged):
        repo.claim_sandbox(sid, "a", expect=None)  # "create": but it exists
    with pytest.raises(OwnershipChanged):
        repo.drop_ownership(sid, "b", expect=r2)
    assert repo.get_ownership(sid) == r4
    assert repo.drop_ownership(sid, "b") is True
    assert repo.get_ownership(sid) is None and not repo.has_manifest(sandbox_record_id(sid))
    with pytest.raises(OwnershipChanged):
        repo.release_sandbox(sid, "b", "snap-3", expect=r4)  # "replace": but it is gone
    # a pointer written before ownership existed: paused, nobody's, generation 0
    repo.put_manifest(sandbox_record_id(sid), {"sandbox_id": sid, "snapshot_id": "snap-old", "published_at": 1.0})
    legacy = repo.get_ownership(sid)
    assert legacy is not None and (legacy.owner, legacy.state, legacy.generation) == ("", OWNER_PAUSED, 0)
    claimed = repo.claim_sandbox(sid, "c")
    assert (claimed.owner, claimed.generation, claimed.snapshot_id) == ("c", 1, "snap-old")
    assert repo.drop_ownership(sid, "c")
    no_leftovers(repo)


def _race(repo: Repository, sid: str, contenders: int) -> list[object]:
    """``contenders`` threads claim ``sid`` at once; each returns its Ownership or the exception."""
    barrier = threading.Barrier(contenders)
    results: list[object] = [None] * contenders

    def claim(i: int) -> None:
        barrier.wait()
        try:
            results[i] = repo.claim_sandbox(sid, f"node-{i}")
        except Exception as exc:  # noqa: BLE001 - collected and asserted below
            results[i] = exc

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(contenders)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


@pytest.mark.parametrize("initial", ["absent", "paused"])
def test_ownership_claim_race_threads(repo: Repository, initial: str) -> None:
    """Eight threads claim the same sandbox at once, ten rounds: exactly one wins each round, every other
    gets OwnershipConflict naming the winner, and the record names the winner."""
    for round_ in range(10):
        sid = f"irace{round_:02d}{initial}"
        if initial == "paused":
            repo.release_sandbox(sid, "pauser", f"snap-{round_}")
        results = _race(repo, sid, 8)
        wins = [r for r in results if not isinstance(r, Exception)]
        losses = [r for r in results if isinstance(r, Exception)]
        assert len(wins) == 1, results
        winner = wins[0].owner  # type: ignore[attr-defined]
        assert all(isinstance(e, OwnershipConflict) and e.owner == winner for e in losses), losses
        rec = repo.get_ownership(sid)
        assert rec is not None and rec.owner == winner and rec.state == OWNER_RUNNING
        assert rec.generation == (2 if initial == "paused" else 1)
    no_leftovers(repo)


def _claim_in_process(root: str, sid: str, name: str, barrier, out) -> None:  # type: ignore[no-untyped-def]
    r = PosixFsRepository(root)
    barrier.wait()
    try:
        out.put((name, "won", r.claim_sandbox(sid, name).generation))
    except OwnershipConflict as exc:
        out.put((name, "conflict", exc.owner))
    except Exception as exc:  # noqa: BLE001
        out.put((name, "error", repr(exc)))


def test_ownership_claim_race_processes(tmp_path: Path) -> None:
    """Separate processes (each with its own repository object, as two nodes on one host) race to claim the
    same paused sandbox through a posix_fs repository: the flock makes exactly one win, every round."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    root = str(tmp_path / "repo")
    PosixFsRepository(root).release_sandbox("iproc", "pauser", "snap-0")
    for round_ in range(5):
        sid = f"iproc{round_}"
        PosixFsRepository(root).release_sandbox(sid, "pauser", "snap-0")
        barrier, out = ctx.Barrier(6), ctx.Queue()
        procs = [ctx.Process(target=_claim_in_process, args=(root, sid, f"p{i}", barrier, out)) for i in range(6)]
        for p in procs:
            p.start()
        results = [out.get(timeout=60) for _ in procs]
        for p in procs:
            p.join(30)
            assert p.exitcode == 0
        won = [r for r in results if r[1] == "won"]
        assert len(won) == 1, results
        assert all(r[1] == "conflict" and r[2] == won[0][0] for r in results if r is not won[0]), results
        rec = PosixFsRepository(root).get_ownership(sid)
        assert rec is not None and rec.owner == won[0][0] and rec.generation == 2


def test_s3_conditional_writes_probe(moto_endpoint: str) -> None:  # noqa: F811 - a fixture from s3server
    """moto honours If-None-Match / If-Match on PUT and If-Match on DELETE: the probe says so; with deletes
    assumed unconditional, a drop fences the record first and still removes it."""
    repo = make_s3_repository(moto_endpoint)
    try:
        repo.require_conditional_writes()
        assert repo.conditional_writes is True and repo.conditional_deletes is True
        assert repo.list_manifests() == []  # the probe cleaned up after itself
        repo.release_sandbox("ifence", "a", "snap-1")
        repo.conditional_deletes = False
        rec = repo.get_ownership("ifence")
        repo.claim_sandbox("ifence", "a")
        with pytest.raises(OwnershipChanged):  # the fence is itself a compare-and-swap
            repo.drop_ownership("ifence", "a", expect=rec)
        assert repo.drop_ownership("ifence", "a") is True
        assert repo.get_ownership("ifence") is None
    finally:
        delete_bucket(repo)


def test_s3_server_without_conditional_writes_is_refused(  # type: ignore[no-untyped-def]
    big_s3,  # noqa: F811 - a fixture from s3server
) -> None:
    """s3rver answers 200 to a PUT whose If-None-Match / If-Match fails: the backend finds out with its probe
    and refuses ownership writes (reads still work) instead of pretending to be single-writer."""
    if big_s3.kind != "s3rver":
        pytest.skip("s3rver is not installed (scripts/setup.d/55-s3rver.sh)")
    repo = make_s3_repository(big_s3)
    try:
        repo.put_manifest(sandbox_record_id("iold"), {"sandbox_id": "iold", "snapshot_id": "snap-1"})
        with pytest.raises(OwnershipUnsupported, match="ignores conditional writes"):
            repo.claim_sandbox("iold", "a")
        assert repo.conditional_writes is False
        with pytest.raises(OwnershipUnsupported):
            repo.release_sandbox("inew", "a", "snap-2")
        with pytest.raises(OwnershipUnsupported):
            repo.drop_ownership("iold", "a")
        rec = repo.get_ownership("iold")
        assert rec is not None and rec.snapshot_id == "snap-1" and rec.owner == ""  # untouched
        assert sorted(repo.list_manifests()) == [sandbox_record_id("iold")]
    finally:
        delete_bucket(repo)


# -- garbage collection ---------------------------------------------------------------------------------------


class Chains:
    """Three sandboxes' published chains (snapshot/manifest.py's shape) in one repository:

    * ``ka`` was killed: its record is gone, its snapshot ``snap-ka1`` and layers ``da1``/``ma1`` unreachable;
    * ``pb`` is paused after three pauses: its record names ``snap-pb3``; ``snap-pb1``/``snap-pb2`` (and the
      memory layers ``mb1``/``mb2`` only they name) are superseded; its disk chain ``db1``..``db3`` is all
      reachable from ``snap-pb3``;
    * ``rc`` is running (claimed after its first publish): its record still names ``snap-rc1``;
    * ``nd`` was claimed before any publish (a record with no snapshot).

    ``base`` (the disk base) and ``m0`` (a template's RAM image) are shared by every chain.
    """

    def __init__(self, repo: Repository, tmp: Path) -> None:
        self.repo, self.tmp = repo, tmp / "layers"
        self.tmp.mkdir()
        self.d: dict[str, str] = {}
        self.paths: dict[str, Path] = {}
        for i, name in enumerate(["base", "m0", "da1", "ma1", "db1", "db2", "db3", "mb1", "mb2", "mb3", "dc1",
                                  "new"]):
            self.d[name], self.paths[name] = write_layer(self.tmp, pattern(3000 + 101 * i, 100 + i), name)
        self.publish("ka", "snap-ka1", ["base", "da1"], ["m0", "ma1"])
        assert self.repo.drop_ownership("ka", "node-a")  # the kill
        self.publish("pb", "snap-pb1", ["base", "db1"], ["m0", "mb1"])
        self.publish("pb", "snap-pb2", ["base", "db1", "db2"], ["m0", "mb2"])
        self.publish("pb", "snap-pb3", ["base", "db1", "db2", "db3"], ["m0", "mb3"])
        self.publish("rc", "snap-rc1", ["base", "dc1"], ["m0"])
        self.repo.claim_sandbox("rc", "node-b")
        self.repo.claim_sandbox("nd", "node-a")

    def manifest(self, snap: str, disk: list[str], memory: list[str]) -> dict[str, object]:
        return {"version": 1, "snapshot_id": snap, "vmstate_b64": "",
                "disk_layers": [{"digest": self.d[n], "size": self.paths[n].stat().st_size, "virtual_size": 0}
                                for n in disk],
                "memory_layers": [self.d[n] for n in memory]}

    def publish(self, sid: str, snap: str, disk: list[str], memory: list[str], *, record: bool = True) -> None:
        """What publish_snapshot does: commit (layers, then the manifest), then move the record."""
        paths = {self.d[n]: self.paths[n] for n in disk + memory}
        self.repo.commit_snapshot(snap, self.manifest(snap, disk, memory), paths)
        if record:
            self.repo.release_sandbox(sid, "node-a", snap)

    def digests(self, *names: str) -> set[str]:
        return {self.d[n] for n in names}

    def size(self, *names: str) -> int:
        return sum(self.paths[n].stat().st_size for n in names)

    REACHABLE_MANIFESTS = {"sandbox-pb", "sandbox-rc", "sandbox-nd", "snap-pb3", "snap-rc1"}
    GARBAGE_MANIFESTS = {"snap-ka1", "snap-pb1", "snap-pb2"}
    REACHABLE_LAYERS = ("base", "m0", "db1", "db2", "db3", "mb3", "dc1")
    GARBAGE_LAYERS = ("da1", "ma1", "mb1", "mb2")


def age_everything(repo: Repository) -> float:
    """Make every object in the repository older than the grace returned (posix_fs: back-date the mtimes;
    s3, whose LastModified cannot be set and has one-second resolution: wait)."""
    if isinstance(repo, PosixFsRepository):
        old = time.time() - 7200
        for p in repo.root.rglob("*"):
            if p.is_file():
                os.utime(p, (old, old))
        return 3600.0
    time.sleep(3.2)
    return 2.0


def reuse_marks(repo: Repository) -> list[str]:
    if isinstance(repo, PosixFsRepository):
        return []
    return [k for k, _ in repo._list_objects("reuse/")]  # type: ignore[attr-defined]


def test_gc_removes_exactly_the_unreachable(repo: Repository, tmp_path: Path) -> None:
    c = Chains(repo, tmp_path)
    assert set(repo.list_manifests()) == Chains.REACHABLE_MANIFESTS | Chains.GARBAGE_MANIFESTS
    assert set(repo.list_layers()) == c.digests(*Chains.REACHABLE_LAYERS, *Chains.GARBAGE_LAYERS)
    report = repo.collect_garbage(0)
    assert set(report.manifests_removed) == Chains.GARBAGE_MANIFESTS
    assert set(report.layers_removed) == c.digests(*Chains.GARBAGE_LAYERS)
    assert report.bytes_removed == c.size(*Chains.GARBAGE_LAYERS)
    assert report.records == 3 and report.manifests_kept == 2 and report.layers_kept == 7
    assert not report.missing_manifests and not report.unreadable_manifests and not report.dry_run
    assert set(repo.list_manifests()) == Chains.REACHABLE_MANIFESTS
    assert set(repo.list_layers()) == c.digests(*Chains.REACHABLE_LAYERS)
    # what stays is still whole: every kept snapshot reads back, every layer it names is there
    for snap in ("snap-pb3", "snap-rc1"):
        m = repo.get_manifest(snap)
        for d in [x["digest"] for x in m["disk_layers"]] + m["memory_layers"]:
            assert repo.read_layer(d) == c.paths[next(n for n, v in c.d.items() if v == d)].read_bytes()
    assert repo.get_ownership("rc").state == OWNER_RUNNING  # records are never touched
    assert reuse_marks(repo) == []  # s3: every reuse mark was older than the cut-off
    # a second collection finds nothing more
    again = repo.collect_garbage(0)
    assert again.manifests_removed == [] and again.layers_removed == [] and again.bytes_removed == 0
    no_leftovers(repo)


def test_gc_large_grace_and_dry_run_remove_nothing(repo: Repository, tmp_path: Path) -> None:
    c = Chains(repo, tmp_path)
    before = (sorted(repo.list_manifests()), sorted(repo.list_layers()))
    marks = reuse_marks(repo)
    report = repo.collect_garbage(3600)
    assert report.manifests_removed == [] and report.layers_removed == [] and report.bytes_removed == 0
    assert report.manifests_kept == 5 and report.layers_kept == 11
    assert (sorted(repo.list_manifests()), sorted(repo.list_layers())) == before
    dry = repo.collect_garbage(0, dry_run=True)
    assert dry.dry_run
    assert set(dry.manifests_removed) == Chains.GARBAGE_MANIFESTS  # what it would remove...
    assert set(dry.layers_removed) == c.digests(*Chains.GARBAGE_LAYERS)
    assert dry.bytes_removed == c.size(*Chains.GARBAGE_LAYERS)
    assert (sorted(repo.list_manifests()), sorted(repo.list_layers())) == before  # ... and removed nothing
    assert reuse_marks(repo) == marks
    # a collection told to stop before it sweeps removes nothing either
    stop = threading.Event()
    stop.set()
    stopped = repo.collect_garbage(0, stop=stop)
    assert stopped.stopped and stopped.manifests_removed == [] and stopped.layers_removed == []
    assert (sorted(repo.list_manifests()), sorted(repo.list_layers())) == before


def test_gc_spares_a_layer_a_publish_reuses(repo: Repository, tmp_path: Path) -> None:
    """An old layer nothing reaches is reused by a publish in progress on another node: the reuse (the real
    ``put_layer`` / ``commit_snapshot`` path, which stores nothing for a present layer) refreshes its age, so
    a collection between the layer step and the record step leaves it, and every other old garbage goes."""
    c = Chains(repo, tmp_path)
    grace = age_everything(repo)
    # publish 1, layer step done, manifest not yet written: it re-put ma1 (killed ka's memory layer)
    assert repo.put_layer(c.d["ma1"], c.paths["ma1"]) == layer_key(c.d["ma1"])
    # publish 2, manifest written, record not yet: it reuses da1 and mb1 and uploads a new layer
    c.publish("qq", "snap-qq1", ["base", "da1", "new"], ["m0", "mb1"], record=False)
    report = repo.collect_garbage(grace)
    assert set(report.manifests_removed) == Chains.GARBAGE_MANIFESTS
    assert set(report.layers_removed) == c.digests("mb2")  # the only old garbage nobody reused
    assert set(repo.list_layers()) == c.digests(*Chains.REACHABLE_LAYERS, "da1", "ma1", "mb1", "new")
    assert "snap-qq1" in repo.list_manifests()
    # the publish completes; once it is older than the grace, only then-unreachable things go
    repo.release_sandbox("qq", "node-a", "snap-qq1")
    later = repo.collect_garbage(0)
    assert set(later.layers_removed) == c.digests("ma1")  # reused by a publish that never wrote a manifest
    assert set(repo.list_manifests()) == Chains.REACHABLE_MANIFESTS | {"sandbox-qq", "snap-qq1"}
    no_leftovers(repo)


def test_gc_without_reuse_refresh_would_remove_it(repo: Repository, tmp_path: Path) -> None:
    """The control for the test above: the same old layer, not reused, is removed."""
    c = Chains(repo, tmp_path)
    grace = age_everything(repo)
    assert repo.has_layer(c.d["ma1"])
    report = repo.collect_garbage(grace)
    assert c.d["ma1"] in report.layers_removed and not repo.has_layer(c.d["ma1"])
    # and a re-put after that uploads it again
    repo.put_layer(c.d["ma1"], c.paths["ma1"])
    assert repo.read_layer(c.d["ma1"]) == c.paths["ma1"].read_bytes()


def test_posix_put_layer_hard_links_on_the_same_filesystem(tmp_path: Path) -> None:
    repo = PosixFsRepository(tmp_path / "repo")
    data = pattern(200_000, 7)
    d, p = write_layer(tmp_path, data)
    old = time.time() - 86400
    os.utime(p, (old, old))
    repo.put_layer(d, p)
    stored = Path(repo.local_path(d))  # type: ignore[arg-type]
    assert os.stat(stored).st_ino == os.stat(p).st_ino and os.stat(p).st_nlink == 2  # one copy on disk
    assert stored.read_bytes() == data
    assert time.time() - os.stat(stored).st_mtime < 600  # its repository age starts at the put
    # the node's local file can go (its own GC): the repository keeps the bytes
    p.unlink()
    assert repo.read_layer(d) == data
    # a wrong digest is still refused, and nothing is left behind
    _, bad_p = write_layer(tmp_path, pattern(1000, 8))
    with pytest.raises(DigestMismatch):
        repo.put_layer(digest(b"something else"), bad_p)
    assert repo.list_layers() == [d] and os.stat(bad_p).st_nlink == 1
    no_leftovers(repo)


def test_posix_put_layer_racing_itself_leaves_no_temporary_link(tmp_path: Path) -> None:
    """Two puts of one layer both link it; the second's rename onto a link of the same inode is a no-op in
    POSIX, which once left its temporary name behind (found by a node publishing three pauses at once)."""
    repo = PosixFsRepository(tmp_path / "repo")
    d, p = write_layer(tmp_path, pattern(100_000, 9))
    repo.put_layer(d, p)
    final = Path(repo.local_path(d))  # type: ignore[arg-type]
    assert repo._link_layer(d, p, final, d.split(":", 1)[1])  # what the slower of two racing puts does
    no_leftovers(repo)
    assert os.stat(p).st_nlink == 2


def test_posix_put_layer_copies_what_it_cannot_link(tmp_path: Path) -> None:
    """A pipe (not a regular file) is copied; so is a file on another filesystem (EXDEV), when /dev/shm is one."""
    repo = PosixFsRepository(tmp_path / "repo")
    data = pattern(100_000, 9)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_bytes(data))
    writer.start()
    repo.put_layer(digest(data), fifo)
    writer.join(10)
    assert repo.read_layer(digest(data)) == data and os.stat(repo.local_path(digest(data))).st_nlink == 1  # type: ignore[arg-type]
    shm = Path("/dev/shm")
    if shm.is_dir() and os.stat(shm).st_dev != os.stat(tmp_path).st_dev:
        other = pattern(50_000, 10)
        src = shm / f"aenv-test-{os.getpid()}-{random.getrandbits(32):08x}"
        try:
            src.write_bytes(other)
            repo.put_layer(digest(other), src)
            stored = os.stat(repo.local_path(digest(other)))  # type: ignore[arg-type]
            assert stored.st_ino != os.stat(src).st_ino and repo.read_layer(digest(other)) == other
        finally:
            src.unlink()
    no_leftovers(repo)


def test_gc_is_conservative_about_what_it_cannot_read(repo: Repository, tmp_path: Path) -> None:
    """A record naming an absent manifest is reported; a kept manifest whose layers cannot be read stops the
    layer sweep (its layers are unknown) until it is collected itself; a bad grace is refused."""
    c = Chains(repo, tmp_path)
    repo.release_sandbox("lost", "node-a", "snap-gone")
    repo.put_manifest("snap-odd", {"disk_layers": [{"size": 1}], "memory_layers": []})  # no digest: unreadable
    report = repo.collect_garbage(3600)
    assert report.missing_manifests == ["snap-gone"] and report.unreadable_manifests == ["snap-odd"]
    report = repo.collect_garbage(0)  # snap-odd is unreachable and now old enough: it goes, unread
    assert "snap-odd" in report.manifests_removed and report.unreadable_manifests == []
    assert set(report.layers_removed) == c.digests(*Chains.GARBAGE_LAYERS)
    repo.put_manifest("sandbox-bad", {"snapshot_id": 5})  # an unreadable record: this collection keeps all
    assert repo.collect_garbage(0).manifests_removed == []
    assert "sandbox-bad" in repo.list_manifests()
    with pytest.raises(ValueError):
        repo.collect_garbage(-1)
