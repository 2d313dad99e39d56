"""The storage core's verifying LayerReader reading real layer files from a repository through the cache."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from s3server import delete_bucket, make_s3_repository, moto_endpoint  # noqa: F401

from aenv_node.storage.cache import LayerCache
from aenv_node.storage.layer import LayerReader, LayerWriter
from aenv_node.storage.repository import PosixFsRepository, Repository

KiB, MiB = 1024, 1024 * 1024


@pytest.fixture(params=["posix_fs", "s3"])
def repo(request: pytest.FixtureRequest, tmp_path: Path):  # type: ignore[no-untyped-def]
    if request.param == "posix_fs":
        yield PosixFsRepository(tmp_path / "repo")
    else:
        r = make_s3_repository(request.getfixturevalue("moto_endpoint"))
        yield r
        delete_bucket(r)


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_layer_reader_over_cached_source(repo: Repository, tmp_path: Path, compression: str | None) -> None:
    rnd = random.Random(21)
    vsize = 8 * MiB
    image = bytearray(vsize)
    (tmp_path / "w").mkdir()
    with LayerWriter(tmp_path / "w", vsize, compression=compression) as w:
        for off in range(0, vsize, 256 * KiB):  # half the blocks data (some compressible), half holes
            if rnd.random() < 0.5:
                n = rnd.choice([4, 64, 128]) * KiB
                data = rnd.randbytes(n // 2) + bytes(n // 2)
                image[off : off + n] = data
                w.add_data(off, data)
        info = w.finish()
    digest = "sha256:" + info.digest
    repo.put_layer(digest, info.path)
    with LayerCache(tmp_path / "cache", repo, capacity_bytes=512 * KiB, low_watermark=0.5) as cache:
        reader = LayerReader(cache.source(digest), digest=info.digest)
        for _ in range(150):
            off = rnd.randrange(0, vsize - 1)
            n = min(rnd.randrange(1, 300 * KiB), vsize - off)
            assert reader.read(off, n) == bytes(image[off : off + n])
        reader.verify()  # every checksum of the layer, read through the small cache
        assert cache.stats().evicted_bytes > 0


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_a_cached_range_that_fails_its_checksum_is_fetched_again(tmp_path: Path, compression: str | None) -> None:
    """A cached copy damaged after its fetch (or a repository copy corrupt when fetched, repaired since) is
    dropped and fetched again by the reader that meets it; a repository copy still corrupt is a LayerCorrupt."""
    from aenv_node.storage.errors import LayerCorrupt

    repo = PosixFsRepository(tmp_path / "repo")
    vsize = 2 * MiB
    data = random.Random(5).randbytes(vsize)
    (tmp_path / "w").mkdir()
    with LayerWriter(tmp_path / "w", vsize, compression=compression) as w:
        w.add_data(0, data)
        info = w.finish()
    digest = "sha256:" + info.digest
    repo.put_layer(digest, info.path)
    stored = next((tmp_path / "repo" / "layers" / "sha256").glob(f"*/{info.digest}"))
    good = stored.read_bytes()
    middle = len(good) // 2

    def flip(path: Path) -> None:
        b = bytearray(path.read_bytes())
        b[middle] ^= 0xFF
        path.write_bytes(bytes(b))

    with LayerCache(tmp_path / "cache", repo, capacity_bytes=64 * MiB) as cache:
        reader = LayerReader(cache.source(digest), digest=info.digest)
        flip(stored)  # corrupt in the repository when first fetched
        with pytest.raises(LayerCorrupt):
            reader.read(0, vsize)
        stored.write_bytes(good)  # repaired: the cached bad copy is not served again
        assert reader.read(0, vsize) == data
        cached = tmp_path / "cache" / f"{info.digest}.cache"
        flip(cached)  # damaged in the cache after the fetch
        assert reader.read(0, vsize) == data
        assert cache.contains(digest, 0, len(good))
