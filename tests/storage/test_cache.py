"""The local layer cache over real repositories (posix_fs, and s3 through a real moto server over HTTP)."""

from __future__ import annotations

import hashlib
import random
import sqlite3
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from s3server import big_s3, delete_bucket, make_s3_repository, moto_endpoint  # noqa: F401

from aenv_node.state.db import Database, migrations_dir
from aenv_node.storage.cache import CHUNK_SIZE, CachedSource, LayerCache, run_janitor
from aenv_node.storage.cache_store import CacheStore
from aenv_node.storage.repository import DigestMismatch, LayerNotFound, PosixFsRepository, Repository
from aenv_node.storage.source import RandomAccessSource

KiB = 1024
MiB = 1024 * KiB
CH = CHUNK_SIZE


def digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def put(repo: Repository, tmp: Path, data: bytes) -> str:
    d = digest(data)
    p = tmp / f"src-{d[7:19]}"
    p.write_bytes(data)
    repo.put_layer(d, p)
    p.unlink()
    return d


@pytest.fixture
def posix_repo(tmp_path: Path) -> PosixFsRepository:
    return PosixFsRepository(tmp_path / "repo")


@pytest.fixture(params=["posix_fs", "s3"])
def repo(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Repository]:
    if request.param == "posix_fs":
        yield PosixFsRepository(tmp_path / "repo")
    else:
        r = make_s3_repository(request.getfixturevalue("moto_endpoint"))
        yield r
        delete_bucket(r)


@pytest.fixture
def db(tmp_path: Path) -> Iterator[Database]:
    d = Database(tmp_path / "aenv.db")
    if any(migrations_dir().joinpath("versions").glob("*.py")):
        d.upgrade()
    else:  # before the first Alembic revision existed
        from aenv_node.state.models import Base

        Base.metadata.create_all(d.engine)
    yield d
    d.close()


def allocated(cache: LayerCache) -> int:
    """Bytes of disk really allocated by the cache's data files (holes excluded)."""
    return sum(p.stat().st_blocks * 512 for p in cache.dir.glob("*.cache"))


# -- correctness with a cache far smaller than the data ---------------------------------------------------------
def test_small_cache_serves_random_reads(repo: Repository, tmp_path: Path) -> None:
    rnd = random.Random(1)
    datas = [rnd.randbytes(8 * MiB), rnd.randbytes(8 * MiB - 12345)]
    digests = [put(repo, tmp_path, x) for x in datas]
    with LayerCache(tmp_path / "cache", repo, capacity_bytes=1 * MiB, high_watermark=0.95, low_watermark=0.7) as cache:
        sources = [CachedSource(cache, d) for d in digests]
        assert all(isinstance(s, RandomAccessSource) for s in sources)
        assert [s.size for s in sources] == [len(x) for x in datas]

        @settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
        @given(which=st.integers(0, 1), offset=st.integers(0, 8 * MiB), length=st.integers(0, 700 * KiB))
        def check(which: int, offset: int, length: int) -> None:
            assert sources[which].pread(offset, length) == datas[which][offset : offset + length]
            assert cache.stats().cached_bytes <= cache.high_bytes

        check()
        # a whole-layer sequential scan, 64 KiB at a time
        assert b"".join(sources[1].pread(o, 64 * KiB) for o in range(0, len(datas[1]), 64 * KiB)) == datas[1]
        s = cache.stats()
        assert s.evicted_bytes > 0 and s.fetched_bytes > cache.capacity_bytes
        assert s.cached_bytes <= cache.high_bytes
        assert allocated(cache) <= cache.capacity_bytes + 64 * KiB  # evicted ranges really freed disk space


def test_concurrent_readers_with_eviction(posix_repo: PosixFsRepository, tmp_path: Path) -> None:
    """Several threads read random ranges while eviction runs under them: every byte is right."""
    data = random.Random(2).randbytes(6 * MiB)
    d = put(posix_repo, tmp_path, data)
    errors: list[str] = []
    with LayerCache(tmp_path / "cache", posix_repo, capacity_bytes=1 * MiB, low_watermark=0.5) as cache:
        src = cache.source(d)

        def reader(seed: int) -> None:
            r = random.Random(seed)
            for _ in range(800):
                off = r.randrange(0, len(data))
                n = r.randrange(1, 400 * KiB)
                if src.pread(off, n) != data[off : off + n]:
                    errors.append(f"bad bytes at {off}+{n}")

        threads = [threading.Thread(target=reader, args=(i,)) for i in range(4)]
        switch = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)  # switch threads very often, so races between readers and eviction happen
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        finally:
            sys.setswitchinterval(switch)
        assert errors == []
        assert cache.stats().evicted_bytes > 0


# -- single flight --------------------------------------------------------------------------------------------
def _slow_gets(repo, delay: float) -> list[str]:  # type: ignore[no-untyped-def]
    """Add network latency to every GetObject of a real S3 client (a botocore event hook); count the GETs."""
    gets: list[str] = []

    def slow(request, **_kw):  # type: ignore[no-untyped-def]
        gets.append(request.headers.get("Range", b"").decode() if isinstance(request.headers.get("Range"), bytes) else str(request.headers.get("Range")))
        time.sleep(delay)

    repo.client.meta.events.register("before-send.s3.GetObject", slow)
    return gets


def test_single_flight(moto_endpoint: str, tmp_path: Path) -> None:  # noqa: F811 - a fixture from s3server
    repo = make_s3_repository(moto_endpoint)
    try:
        data = random.Random(3).randbytes(2 * MiB)
        d = put(repo, tmp_path, data)
        gets = _slow_gets(repo, 0.3)
        with LayerCache(tmp_path / "cache", repo, capacity_bytes=64 * MiB) as cache:
            src = cache.source(d, size=len(data))
            n = 8
            barrier = threading.Barrier(n)
            results: list[bytes] = [b""] * n

            def reader(i: int) -> None:
                barrier.wait()
                results[i] = src.pread(CH + 1000 + i, 5000)

            threads = [threading.Thread(target=reader, args=(i,)) for i in range(n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert results == [data[CH + 1000 + i : CH + 6000 + i] for i in range(n)]
            assert gets == [f"bytes={CH}-{2 * CH - 1}"]  # ONE ranged GET of the one chunk
            st_ = cache.layer_stats(d)
            assert st_ is not None
            assert (st_.fetches, st_.fetched_bytes, st_.misses, st_.hits) == (1, CH, n, 0)
            # and it is cached now: no further GET
            assert src.pread(CH, 10) == data[CH : CH + 10]
            assert len(gets) == 1 and cache.layer_stats(d).hits == 1  # type: ignore[union-attr]
    finally:
        delete_bucket(repo)


def test_single_flight_failure_reaches_every_waiter(
    moto_endpoint: str,  # noqa: F811 - a fixture from s3server
    tmp_path: Path,
) -> None:
    repo = make_s3_repository(moto_endpoint)
    try:
        data = random.Random(4).randbytes(1 * MiB)
        d = put(repo, tmp_path, data)
        with LayerCache(tmp_path / "cache", repo, capacity_bytes=64 * MiB) as cache:
            src = cache.source(d)  # size known (HEAD) ...
            repo.delete_layer(d)  # ... then the layer disappears from the repository
            gets = _slow_gets(repo, 0.3)
            n = 5
            barrier = threading.Barrier(n)
            outcome: list[object] = [None] * n

            def reader(i: int) -> None:
                barrier.wait()
                try:
                    src.pread(0, 100)
                except LayerNotFound as e:
                    outcome[i] = e

            threads = [threading.Thread(target=reader, args=(i,)) for i in range(n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert all(isinstance(o, LayerNotFound) for o in outcome), outcome
            assert len(gets) == 1
            assert not cache.contains(d, 0, 100)
    finally:
        delete_bucket(repo)


# -- eviction -------------------------------------------------------------------------------------------------
def test_eviction_between_watermarks_is_lru_per_range(posix_repo: PosixFsRepository, tmp_path: Path) -> None:
    data = random.Random(5).randbytes(20 * CH)
    d = put(posix_repo, tmp_path, data)
    # capacity 16 chunks; high = 12 chunks, low = 8 chunks
    with LayerCache(
        tmp_path / "cache", posix_repo, capacity_bytes=16 * CH, high_watermark=0.75, low_watermark=0.5,
        readahead_bytes=0,
    ) as cache:
        src = cache.source(d)
        for c in range(12):
            assert src.pread(c * CH, CH) == data[c * CH : (c + 1) * CH]
        assert cache.stats().cached_bytes == 12 * CH and cache.stats().evicted_bytes == 0  # at high: no eviction
        src.pread(0, 10)  # chunk 0 becomes the most recently used
        src.pread(12 * CH, 10)  # 13 chunks > high: evict the 5 least recently used: 1..5
        present = [c for c in range(20) if cache.contains(d, c * CH, CH)]
        assert present == [0, 6, 7, 8, 9, 10, 11, 12]
        s = cache.stats()
        assert s.cached_bytes == 8 * CH and s.evicted_bytes == 5 * CH
        assert 8 * CH <= allocated(cache) <= 8 * CH + 64 * KiB  # holes really punched
        fetches = s.fetches
        assert src.pread(3 * CH + 7, 100) == data[3 * CH + 7 : 3 * CH + 107]  # evicted: fetched again
        assert cache.stats().fetches == fetches + 1
        # an explicit evict to a target
        assert cache.evict(0) == 9 * CH
        assert cache.stats().cached_bytes == 0 and allocated(cache) <= 64 * KiB
        assert src.pread(0, 20 * CH) == data


def test_sequential_readahead(posix_repo: PosixFsRepository, tmp_path: Path) -> None:
    data = random.Random(15).randbytes(16 * CH)
    d = put(posix_repo, tmp_path, data)
    with LayerCache(tmp_path / "cache", posix_repo, capacity_bytes=64 * MiB, readahead_bytes=4 * CH) as cache:
        src = cache.source(d)
        assert b"".join(src.pread(o, 64 * KiB) for o in range(0, len(data), 64 * KiB)) == data
        # chunk 0 (not yet known to be sequential), then 1-5, 6-10, 11-15 with 4 chunks of readahead each
        s = cache.stats()
        assert (s.fetches, s.fetched_bytes, s.misses) == (4, 16 * CH, 4)
        before = s.fetched_bytes
        d2 = put(posix_repo, tmp_path, data[::-1])
        cache.read(d2, 5 * CH, 10)  # a random read: no readahead
        cache.read(d2, 9 * CH, 10)
        assert cache.stats().fetched_bytes == before + 2 * CH


# -- restart --------------------------------------------------------------------------------------------------
def test_bitmap_survives_restart(posix_repo: PosixFsRepository, tmp_path: Path) -> None:
    data = random.Random(6).randbytes(3 * MiB + 5)
    d = put(posix_repo, tmp_path, data)
    ranges = [(0, 1000), (MiB, 300 * KiB), (3 * MiB, 5)]
    with LayerCache(tmp_path / "cache", posix_repo, capacity_bytes=64 * MiB) as cache:
        for off, n in ranges:
            cache.read(d, off, n)
        cached = cache.stats().cached_bytes
    posix_repo.delete_layer(d)  # from now on, only what the cache kept can be read
    with LayerCache(tmp_path / "cache", posix_repo, capacity_bytes=64 * MiB) as cache:
        assert cache.stats().cached_bytes == cached == 3 * CH + 5  # chunks 0, 4, 5 and the 5-byte tail
        for off, n in ranges:
            assert cache.read(d, off, n) == data[off : off + n]
        st_ = cache.layer_stats(d)
        assert st_ is not None and st_.fetches == 0 and st_.hits == 4
        with pytest.raises(LayerNotFound):
            cache.read(d, 2 * MiB, 10)  # never cached


def test_restart_without_sync_refetches(posix_repo: PosixFsRepository, tmp_path: Path) -> None:
    """Bits are written to the bitmap only after the data is synced: a cache that dies before its sync comes
    back without them (refetches) rather than trusting unsynced bytes."""
    data = random.Random(7).randbytes(2 * MiB)
    d = put(posix_repo, tmp_path, data)
    c1 = LayerCache(tmp_path / "cache", posix_repo, capacity_bytes=64 * MiB, flush_interval_s=3600)
    c1.read(d, 0, 2 * MiB)
    assert c1.stats().cached_bytes == 2 * MiB
    # "crash": c1 is never flushed or closed; a new cache opens the same directory
    c2 = LayerCache(tmp_path / "cache", posix_repo, capacity_bytes=64 * MiB)
    assert c2.stats().cached_bytes == 0
    assert c2.read(d, 100, MiB) == data[100 : MiB + 100]
    assert c2.stats().fetches == 1
    c2.close()
    c1._closed = True  # its files belong to c2 now; just drop the descriptors
    for x in c1._layers.values():
        c1._close_layer(x)


def test_restart_after_eviction_and_bad_bitmap(posix_repo: PosixFsRepository, tmp_path: Path) -> None:
    data = random.Random(8).randbytes(16 * CH)
    d, d2 = put(posix_repo, tmp_path, data), put(posix_repo, tmp_path, data[::-1])
    with LayerCache(tmp_path / "cache", posix_repo, capacity_bytes=8 * CH, low_watermark=0.5) as cache:
        cache.read(d, 0, 6 * CH)
        cache.flush()  # chunks 0-5 are now claimed by the bitmap file ...
        cache.read(d, 6 * CH, 10 * CH)  # ... and most get evicted again (16 chunks into an 8-chunk cache)
        cache.read(d2, 0, CH)
        present = [c for c in range(16) if cache.contains(d, c * CH, 1)]
        assert 0 < len(present) < 16
    (tmp_path / "cache" / f"{d2[7:]}.bitmap").write_bytes(b"garbage")
    with LayerCache(tmp_path / "cache", posix_repo, capacity_bytes=64 * MiB) as cache:
        assert [c for c in range(16) if cache.contains(d, c * CH, 1)] == present  # evicted stay evicted
        assert not (tmp_path / "cache" / f"{d2[7:]}.cache").exists()  # the unusable entry was discarded
        assert cache.read(d, 0, 16 * CH) == data
        assert cache.read(d2, 0, 16 * CH) == data[::-1]


# -- counters in SQLite ---------------------------------------------------------------------------------------
def test_stats_land_in_sqlite(posix_repo: PosixFsRepository, tmp_path: Path, db: Database) -> None:
    data = random.Random(9).randbytes(2 * MiB)
    d = put(posix_repo, tmp_path, data)

    def row() -> tuple | None:  # type: ignore[type-arg]
        with sqlite3.connect(db.path) as con:
            return con.execute(
                "SELECT path, size_bytes, cached_bytes, hits, misses, fetched_bytes, evicted_bytes, last_access_at "
                "FROM cache_entries WHERE layer_digest = ?",
                (d,),
            ).fetchone()

    kw = dict(capacity_bytes=4 * CH, high_watermark=1.0, low_watermark=0.5, store=CacheStore(db), flush_interval_s=3600)
    cache = LayerCache(tmp_path / "cache", posix_repo, **kw)  # type: ignore[arg-type]
    cache.read(d, 0, 3 * CH)  # 3 misses, one fetch of 3 chunks
    cache.read(d, 10, 10)  # 1 hit
    assert row() is None  # batched: nothing written per read
    cache.flush()
    r = row()
    assert r is not None
    path, size, cached, hits, misses, fetched, evicted, last_access = r
    assert (size, cached, hits, misses, fetched, evicted) == (2 * MiB, 3 * CH, 1, 3, 3 * CH, 0)
    assert path == str(tmp_path / "cache" / f"{d[7:]}.cache")
    assert last_access.endswith("Z") and last_access[:4] == time.strftime("%Y", time.gmtime())
    cache.read(d, 3 * CH, 2 * CH)  # 5 chunks > capacity 4: evict down to 2
    cache.close()  # close flushes
    assert row()[2:7] == (2 * CH, 1, 5, 5 * CH, 3 * CH)  # type: ignore[index]
    # counters continue across a restart
    cache = LayerCache(tmp_path / "cache", posix_repo, **kw)  # type: ignore[arg-type]
    cache.read(d, 4 * CH, 10)
    cache.close()
    assert row()[3] == 2  # type: ignore[index]
    # a layer discarded from the cache loses its row
    cache = LayerCache(tmp_path / "cache", posix_repo, **kw)  # type: ignore[arg-type]
    cache.discard(d)
    cache.close()
    assert row() is None and list((tmp_path / "cache").iterdir()) == []


async def test_janitor_flushes_counters(posix_repo: PosixFsRepository, tmp_path: Path, db: Database) -> None:
    """The janitor task (run in the node's nursery) writes counters periodically; readers never have to."""
    data = random.Random(14).randbytes(MiB)
    d = put(posix_repo, tmp_path, data)
    cache = LayerCache(tmp_path / "cache", posix_repo, capacity_bytes=64 * MiB, store=CacheStore(db),
                       flush_interval_s=3600)

    def hits_in_db() -> int | None:
        with sqlite3.connect(db.path) as con:
            r = con.execute("SELECT hits FROM cache_entries WHERE layer_digest = ?", (d,)).fetchone()
            return None if r is None else r[0]

    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(run_janitor, cache, 0.05)
            await trio.to_thread.run_sync(cache.read, d, 0, 10)
            await trio.to_thread.run_sync(cache.read, d, 0, 10)
            with trio.fail_after(10):
                while await trio.to_thread.run_sync(hits_in_db) != 1:
                    await trio.sleep(0.02)
            nursery.cancel_scope.cancel()
        assert hits_in_db() == 1
    finally:
        cache.close()


# -- adopt ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("move", [False, True])
def test_adopt_local_layer(posix_repo: PosixFsRepository, tmp_path: Path, move: bool) -> None:
    data = random.Random(10).randbytes(3 * MiB + 77)
    d = digest(data)
    local = tmp_path / "sealed.layer"
    local.write_bytes(data)
    with LayerCache(tmp_path / "cache", posix_repo, capacity_bytes=64 * MiB) as cache:
        with pytest.raises(DigestMismatch):
            cache.adopt(digest(b"other"), local)
        cache.adopt(d, local, move=move)
        assert local.exists() != move
        assert not posix_repo.has_layer(d)  # served without the repository
        src = cache.source(d)
        assert src.size == len(data)
        assert src.pread(0, len(data)) == data
        s = cache.stats()
        assert (s.fetches, s.cached_bytes, s.adopted_bytes) == (0, len(data), len(data))
    with LayerCache(tmp_path / "cache", posix_repo, capacity_bytes=64 * MiB) as cache:
        assert cache.read(d, MiB, 100) == data[MiB : MiB + 100]  # and it survives a restart


def test_adopt_fills_only_missing_ranges(posix_repo: PosixFsRepository, tmp_path: Path) -> None:
    data = random.Random(11).randbytes(2 * MiB)
    d = put(posix_repo, tmp_path, data)
    local = tmp_path / "sealed.layer"
    local.write_bytes(data)
    with LayerCache(tmp_path / "cache", posix_repo, capacity_bytes=64 * MiB) as cache:
        cache.read(d, CH, 10)
        cache.adopt(d, local)
        s = cache.stats()
        assert s.adopted_bytes == 2 * MiB - CH and s.cached_bytes == 2 * MiB and s.fetches == 1
        assert cache.read(d, 0, 2 * MiB) == data and cache.stats().fetches == 1


# -- a 1 GiB layer from S3 through a 64 MiB cache --------------------------------------------------------------
_BLOCK = 4096
_FILL = random.Random(12).randbytes(_BLOCK - 16)


def _expected(offset: int, length: int) -> bytes:
    """Bytes of the synthetic layer: each 4 KiB block = its index, a hash of it, then a fixed filler."""
    first, last = offset // _BLOCK, (offset + length - 1) // _BLOCK
    blob = b"".join(
        i.to_bytes(8, "little") + ((i * 0x9E3779B97F4A7C15) & (2**64 - 1)).to_bytes(8, "little") + _FILL
        for i in range(first, last + 1)
    )
    return blob[offset - first * _BLOCK : offset - first * _BLOCK + length]


def _write_synthetic(path: Path, size: int) -> str:
    import numpy as np

    h = hashlib.sha256()
    fill = np.frombuffer(_FILL, dtype=np.uint8)
    per = 16 * MiB // _BLOCK
    with open(path, "wb") as f:
        for start in range(0, size // _BLOCK, per):
            idx = np.arange(start, start + per, dtype=np.uint64)
            block = np.empty((per, _BLOCK), dtype=np.uint8)
            block[:, 0:8] = idx.view(np.uint8).reshape(per, 8)
            with np.errstate(over="ignore"):
                block[:, 8:16] = (idx * np.uint64(0x9E3779B97F4A7C15)).view(np.uint8).reshape(per, 8)
            block[:, 16:] = fill
            b = block.tobytes()
            h.update(b)
            f.write(b)
    return "sha256:" + h.hexdigest()


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["posix_fs", "s3"])
def test_1gib_layer_through_64mib_cache(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """A 1 GiB layer read through a 64 MiB cache: sampled reads across the whole layer are all correct, and far
    more than 64 MiB went through the cache.  The s3 variant runs on s3rver (file-backed); if only moto is
    available it samples far fewer reads, because moto copies the whole object on each ranged GET."""
    size = 1024 * MiB
    if backend == "s3":
        server = request.getfixturevalue("big_s3")
        repo: Repository = make_s3_repository(server, part_size=64 * MiB, upload_concurrency=2)
        n_random, n_spaced = (300, 32) if server.kind == "s3rver" else (6, 10)
    else:
        repo = PosixFsRepository(tmp_path / "repo")
        n_random, n_spaced = 400, 64
    try:
        path = tmp_path / "big.layer"
        d = _write_synthetic(path, size)
        with open(path, "rb") as f:
            assert f.read(_BLOCK * 3) == _expected(0, _BLOCK * 3)
        repo.put_layer(d, path)
        path.unlink()
        with LayerCache(tmp_path / "cache", repo, capacity_bytes=64 * MiB, max_fetch_bytes=8 * MiB) as cache:
            src = cache.source(d)
            assert src.size == size
            r = random.Random(13)
            reads = [(r.randrange(0, size - 1), r.randrange(1, 512 * KiB)) for _ in range(n_random)]
            step = size // n_spaced
            reads += [(i * step + r.randrange(0, CH), 8 * MiB - CH) for i in range(n_spaced)]  # across the layer
            reads += [(size - 100, 100), (0, 1)]
            for off, n in reads:
                assert src.pread(off, n) == _expected(off, min(n, size - off)), (off, n)
            hits = cache.stats().hits
            assert src.pread(*reads[-3]) == _expected(*reads[-3])  # read again: served from the cache
            s = cache.stats()
            assert s.hits > hits
            assert s.evicted_bytes > 0 and s.cached_bytes <= cache.high_bytes
            assert allocated(cache) <= 64 * MiB + MiB
            assert s.fetched_bytes > 64 * MiB + 8 * MiB  # far more than the cache holds went through it
    finally:
        if backend == "s3":
            delete_bucket(repo)
