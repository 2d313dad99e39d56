"""P2P layer ranges, the storage side: the per-chunk checksum record (written with the layer in posix_fs and S3,
atomically, before the layer), and the cache's use of peers: checked bytes are used, bad ones are rejected and
the repository answers instead, every outcome counted; serving answers from PRESENT chunks only, bounded."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from pathlib import Path

import pytest
from s3server import delete_bucket, make_s3_repository, moto_endpoint  # noqa: F401

from tests.cluster.p2p_nodes import CountingRepository

from aenv_node.storage.cache import LayerCache
from aenv_node.storage.cache_peers import PeerFetchError, PeerOptions, PeerServeBusy, PeerServeRefused
from aenv_node.storage.repository import PosixFsRepository, Repository
from aenv_node.storage.repository.chunksums import (
    CHUNKSUM_SIZE,
    ChecksumMismatch,
    ChunkHasher,
    ChunkSums,
    chunksums_key,
)

MiB = 1 << 20
CS = CHUNKSUM_SIZE


def put(repo: Repository, tmp: Path, data: bytes) -> str:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    src = tmp / f"src-{digest[7:19]}"
    src.write_bytes(data)
    repo.put_layer(digest, src)
    return digest


class CachePeer:
    """A peer source whose one peer is another real LayerCache (its serve path), optionally corrupting what it
    sends: the transport (HTTP in a node) is what the cluster tests cover."""

    def __init__(self, other: LayerCache, *, corrupt: bool = False, fail: str | None = None) -> None:
        self.other = other
        self.corrupt = corrupt
        self.fail = fail
        self.asked = 0

    def holders(self, digest: str) -> Sequence[str]:
        return ["other"]

    def read_range(self, peer: str, digest: str, offset: int, length: int) -> bytes:
        self.asked += 1
        if self.fail is not None:
            raise PeerFetchError(self.fail, "told to fail")
        try:
            data = self.other.serve_range(digest, offset, length)
        except PeerServeRefused as exc:
            raise PeerFetchError("absent" if exc.status == 404 else "status", str(exc)) from exc
        if self.corrupt:
            data = bytes([data[0] ^ 0xFF]) + data[1:]
        return data

    def close(self) -> None:
        pass


# -- the record -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("size", [0, 1, CS - 1, CS, CS + 1, 3 * CS + 4096])
def test_hasher_sums_each_chunk_whatever_the_feed(size: int) -> None:
    data = random.Random(size).randbytes(size)
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    want = [hashlib.sha256(data[i:i + CS]).hexdigest() for i in range(0, size, CS)]
    for step in (1000, CS, 3 * CS + 7, 1 << 20):
        h = ChunkHasher()
        for i in range(0, size, step):
            h.update(data[i:i + step])
        rec = h.record(digest)
        assert rec.sums == want and rec.size == size and rec.n_chunks == len(want)
        assert ChunkSums.decode(rec.encode()) == rec


def test_verify_accepts_the_bytes_and_refuses_others() -> None:
    data = random.Random(1).randbytes(3 * CS + 100)
    h = ChunkHasher()
    h.update(data)
    rec = h.record("sha256:" + hashlib.sha256(data).hexdigest())
    rec.verify(0, data[: 2 * CS])
    rec.verify(CS, data[CS:])  # up to the short last chunk
    bad = bytearray(data[CS: 2 * CS])
    bad[123] ^= 1
    with pytest.raises(ChecksumMismatch, match="chunk 1"):
        rec.verify(CS, bytes(bad))
    with pytest.raises(ChecksumMismatch, match="whole chunks"):
        rec.verify(4096, data[4096:CS + 4096])  # not on a chunk boundary: cannot be checked
    with pytest.raises(ChecksumMismatch, match="whole chunks"):
        rec.verify(0, data[: CS + 1])


def test_a_record_of_another_version_or_incomplete_is_refused() -> None:
    import json

    h = ChunkHasher()
    h.update(b"x" * (CS + 1))
    doc = json.loads(h.record("sha256:" + "0" * 64).encode())
    for change in ({"version": 2}, {"sums": doc["sums"][:1]}, {"chunk_size": 1000}, {"extra": 1},
                   {"sums": ["X" * 64, doc["sums"][1]]}):
        with pytest.raises(ValueError):
            ChunkSums.decode(json.dumps({**doc, **change}).encode())
    assert ChunkSums.decode(json.dumps(doc).encode()).n_chunks == 2


@pytest.mark.parametrize("size", [CS + 5, 7 * MiB + 3])  # one PUT / a multipart upload on S3
def test_put_layer_stores_the_record_and_delete_removes_it(repo: Repository, tmp_path: Path, size: int) -> None:
    data = random.Random(size).randbytes(size)
    digest = put(repo, tmp_path, data)
    rec = repo.get_chunksums(digest)
    assert rec is not None and rec.digest == digest and rec.size == size and rec.chunk_size == CS
    rec.verify(0, data)
    assert repo.list_layers() == [digest]  # the record is no layer
    assert set(repo.layer_infos()) == {digest}
    repo.delete_layer(digest)
    assert repo.get_chunksums(digest) is None


def test_the_record_is_in_place_before_the_layer_and_a_failed_put_leaves_neither(tmp_path: Path) -> None:
    repo = PosixFsRepository(tmp_path / "repo")
    data = random.Random(3).randbytes(CS * 2)
    src = tmp_path / "src"
    src.write_bytes(data)
    with pytest.raises(ValueError):  # DigestMismatch: nothing becomes visible
        repo.put_layer("sha256:" + "1" * 64, src)
    assert not list((repo.root / "layers").rglob("*1111*"))
    # a layer put by an older node (no record) is simply never fetched from peers
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    repo.put_layer(digest, src)
    (repo.root / chunksums_key(digest)).unlink()
    assert repo.get_chunksums(digest) is None
    repo.put_layer(digest, src)  # already present: only touched, no record appears
    assert repo.get_chunksums(digest) is None


# -- the cache with peers -------------------------------------------------------------------------------------

def test_ranges_come_from_the_peer_checked_and_the_repository_is_not_read(tmp_path: Path) -> None:
    repo = CountingRepository(tmp_path / "repo")
    data = random.Random(4).randbytes(6 * MiB + 1234)
    digest = put(repo, tmp_path, data)
    a = LayerCache(tmp_path / "a", repo, capacity_bytes=64 * MiB, durable=False,
                   peers=PeerOptions(source=CachePeer(None, fail="absent")))  # type: ignore[arg-type]
    assert a.read(digest, 0, len(data)) == data  # A from the repository (its peer has nothing)
    read_by_a = repo.bytes_read
    assert read_by_a == len(data)
    peer = CachePeer(a)
    b = LayerCache(tmp_path / "b", repo, capacity_bytes=64 * MiB, durable=False, peers=PeerOptions(source=peer))
    for off in range(0, len(data), 1 << 20):
        assert b.read(digest, off, 1 << 20) == data[off:off + (1 << 20)]
    assert repo.bytes_read == read_by_a  # B read nothing from the repository
    st = b.stats()
    assert st.p2p and st.fetched_bytes == 0 and st.peer_bytes == len(data) and st.peer_fetches >= 2
    assert sum(st.peer_failures.values()) == 0
    assert a.stats().served_bytes == len(data) and a.stats().served_ranges == st.peer_fetches
    a.close()
    b.close()


def test_corrupted_peer_bytes_are_rejected_and_the_repository_answers(tmp_path: Path) -> None:
    repo = CountingRepository(tmp_path / "repo")
    data = random.Random(5).randbytes(2 * MiB)
    digest = put(repo, tmp_path, data)
    a = LayerCache(tmp_path / "a", repo, capacity_bytes=64 * MiB, durable=False,
                   peers=PeerOptions(source=CachePeer(None, fail="absent")))  # type: ignore[arg-type]
    a.read(digest, 0, len(data))
    before = repo.bytes_read
    peer = CachePeer(a, corrupt=True)
    b = LayerCache(tmp_path / "b", repo, capacity_bytes=64 * MiB, durable=False, peers=PeerOptions(source=peer))
    assert b.read(digest, 0, len(data)) == data  # the right bytes, from the repository
    st = b.stats()
    assert peer.asked >= 1 and st.peer_failures["checksum"] == peer.asked
    assert st.peer_bytes == 0 and st.peer_fallbacks >= 1 and st.fetched_bytes == len(data)
    assert repo.bytes_read == before + len(data)
    # and what B cached are the right bytes: a third cache reads them from B, checked, unchanged
    c = LayerCache(tmp_path / "c", repo, capacity_bytes=64 * MiB, durable=False,
                   peers=PeerOptions(source=CachePeer(b)))
    assert c.read(digest, 0, len(data)) == data and c.stats().peer_bytes == len(data)
    for x in (a, b, c):
        x.close()


@pytest.mark.parametrize("reason", ["timeout", "unreachable", "status", "absent"])
def test_any_peer_failure_falls_back_to_the_repository_and_is_counted(tmp_path: Path, reason: str) -> None:
    repo = CountingRepository(tmp_path / "repo")
    data = random.Random(6).randbytes(MiB)
    digest = put(repo, tmp_path, data)
    peer = CachePeer(None, fail=reason)  # type: ignore[arg-type]
    b = LayerCache(tmp_path / "b", repo, capacity_bytes=64 * MiB, durable=False,
                   peers=PeerOptions(source=peer, max_attempts=1))
    assert b.read(digest, 0, len(data)) == data
    st = b.stats()
    assert st.peer_failures[reason] == peer.asked >= 1 and st.fetched_bytes == len(data)
    b.close()


def test_a_layer_without_a_record_never_asks_a_peer(tmp_path: Path) -> None:
    repo = CountingRepository(tmp_path / "repo")
    data = random.Random(7).randbytes(MiB)
    digest = put(repo, tmp_path, data)
    (repo.root / chunksums_key(digest)).unlink()
    a = LayerCache(tmp_path / "a", repo, capacity_bytes=64 * MiB, durable=False)
    a.read(digest, 0, len(data))
    peer = CachePeer(a)
    b = LayerCache(tmp_path / "b", repo, capacity_bytes=64 * MiB, durable=False, peers=PeerOptions(source=peer))
    assert b.read(digest, 0, len(data)) == data
    assert peer.asked == 0 and b.stats().peer_fallbacks >= 1
    a.close()
    b.close()


def test_serving_is_from_present_chunks_only_and_bounded(tmp_path: Path) -> None:
    repo = CountingRepository(tmp_path / "repo")
    data = random.Random(8).randbytes(4 * MiB)
    digest = put(repo, tmp_path, data)
    off = LayerCache(tmp_path / "off", repo, capacity_bytes=64 * MiB, durable=False)
    off.read(digest, 0, CS)
    with pytest.raises(PeerServeRefused) as refused:
        off.serve_range(digest, 0, CS)  # P2P off: serves nothing
    assert refused.value.status == 404
    a = LayerCache(tmp_path / "a", repo, capacity_bytes=64 * MiB, durable=False,
                   peers=PeerOptions(source=CachePeer(None, fail="absent"), max_range_bytes=MiB,  # type: ignore[arg-type]
                                     max_serves=1))
    a.read(digest, 0, CS)  # one chunk cached (and its readahead: none, a first read)
    read = repo.bytes_read
    assert a.serve_range(digest, 0, CS) == data[:CS]
    assert a.serve_range(digest, 4096, 100) == data[4096:4196]
    for offset, length, status in ((CS, CS, 404), (0, 2 * CS, 404), (0, 2 * MiB, 400), (4 * MiB - 10, 20, 400)):
        with pytest.raises(PeerServeRefused) as refused:
            a.serve_range(digest, offset, length)
        assert refused.value.status == status, (offset, length)
    with pytest.raises(PeerServeRefused) as refused:
        a.serve_range("sha256:" + "2" * 64, 0, CS)  # a layer it never opened
    assert refused.value.status == 404
    assert repo.bytes_read == read  # serving never fetched
    assert a.peers is not None
    a.peers._serving.acquire()  # one serve in progress: the next is refused at once
    with pytest.raises(PeerServeBusy):
        a.serve_range(digest, 0, CS)
    a.peers._serving.release()
    st = a.stats()
    assert (st.served_ranges, st.served_busy) == (2, 1) and st.served_absent == 4  # the 400 on length: at admit
    assert st.served_bytes == CS + 100
    off.close()
    a.close()
