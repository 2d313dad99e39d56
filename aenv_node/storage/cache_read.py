"""The read path of the local layer cache: serve a read from cached chunks, fetch the missing ones.

Why a module of its own: this is the hot, concurrent part of the cache, and its locking rules are the ones a
change can break silently; the rest of :class:`~.cache.LayerCache` (opening layers, adopting files, eviction,
syncs, counters) only has to follow them.  It is :class:`ChunkReader`, the base class of ``LayerCache``, and
not a separate object, because it shares the cache's metadata lock, LRU and byte count with eviction and
adoption: the chunk state transitions here (claim, publish, release) are the ones those use too.

Concurrency: readers call from OS threads (the block engine is threaded).  One ``threading.Lock`` guards the
metadata (chunk states, LRU, counters); all I/O happens outside it.  A chunk is ABSENT, PRESENT or BUSY (being
fetched or evicted); a reader that finds it BUSY waits on that operation's ``threading.Event`` instead of
fetching it again (single-flight).  Readers of PRESENT chunks ``pread`` without holding the lock and then check
the chunk's generation number, which eviction bumps before it punches; a changed generation means "read again".
Contiguous missing chunks of one read are fetched with one ranged GET (up to ``max_fetch_bytes``); a read that
starts where the previous read of the layer ended and misses also fetches up to ``readahead_bytes`` of the
following absent chunks in that request (sequential scans of a remote layer pay one round trip per
read + readahead, not per read).

With P2P (``peers``, :mod:`.cache_peers`) a missing run is first asked of a peer that caches the layer, in
pieces of at most ``p2p.max_range_bytes``, each checked against the layer's checksum record; a piece no peer
gives comes from the repository.  Either way the bytes land in the cache file the same way, so a node that got
a range from a peer serves it in turn (``read_present_range``: PRESENT chunks only, never a fetch).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Iterable

from .cache_layer import (
    ABSENT,
    BUSY,
    PRESENT,
    CachedLayer,
    Flight,
    chunk_runs,
    pread_all,
)
from .cache_peers import PeerOptions, PeerReader, PeerServeRefused
from .errors import CacheError
from .fileops import pwrite_all
from .repository.base import Repository

__all__ = ["ChunkReader"]

log = logging.getLogger("aenv_node.storage.cache")  # the cache's one logger name, whichever module logs


class ChunkReader:
    """The chunk-level read path and the chunk state transitions of :class:`~.cache.LayerCache` (its base).

    Holds what the read path shares with the rest of the cache: the repository, the chunk geometry, the
    metadata lock, the LRU of PRESENT chunks and the count of cached bytes.
    """

    def __init__(self, repository: Repository, *, chunk_size: int, max_fetch_bytes: int, readahead_bytes: int,
                 peers: PeerOptions | None = None) -> None:
        self.repository = repository
        #: P2P: the peer side of fetches and serves (None: P2P off, every missing range from the repository)
        self.peers = None if peers is None else PeerReader(peers, repository, chunk_size)
        self.chunk_size = chunk_size
        self.max_fetch_chunks = max(1, max_fetch_bytes // chunk_size)
        self.readahead_chunks = max(0, readahead_bytes // chunk_size)
        self._lock = threading.Lock()
        self._lru: collections.OrderedDict[tuple[CachedLayer, int], None] = collections.OrderedDict()
        self._cached_bytes = 0
        self._write_errors = 0

    def _read(self, layer: CachedLayer, offset: int, length: int) -> bytes:
        end = min(offset + length, layer.size)
        if end <= offset:
            return b""
        cs = self.chunk_size
        c0, c1 = offset // cs, (end - 1) // cs
        # chunk -> the bytes of [offset, end) that lie in that chunk
        got: dict[int, memoryview] = {}
        first = True
        while len(got) < c1 - c0 + 1:
            to_read: list[tuple[int, int]] = []
            to_wait: list[Flight] = []
            to_fetch: list[int] = []
            with self._lock:
                layer.last_access_at = time.time()
                layer.dirty = True
                for c in range(c0, c1 + 1):
                    if c in got:
                        continue
                    st = layer.state[c]
                    if st == PRESENT:
                        to_read.append((c, layer.gen[c]))
                        self._lru.move_to_end((layer, c))
                        if first:
                            layer.hits += 1
                    else:
                        if first:
                            layer.misses += 1
                        if st == BUSY:
                            to_wait.append(layer.flights[c])
                        else:
                            layer.state[c] = BUSY
                            layer.flights[c] = Flight()
                            to_fetch.append(c)
                if first and to_fetch and offset == layer.next_offset and to_fetch[-1] == c1:
                    # sequential miss: fetch the following absent chunks in the same request
                    for c in range(c1 + 1, min(c1 + 1 + self.readahead_chunks, layer.n_chunks)):
                        if layer.state[c] != ABSENT:
                            break
                        layer.state[c] = BUSY
                        layer.flights[c] = Flight()
                        to_fetch.append(c)
                if first:
                    layer.next_offset = end
            first = False
            if to_fetch:
                self._fetch(layer, to_fetch, got, offset, end)
            if to_read:
                self._read_present(layer, to_read, got, offset, end)
            for f in to_wait:
                f.event.wait()
                if f.error is not None:
                    raise f.error
        pieces = [got[c] for c in range(c0, c1 + 1)]
        whole = pieces[0].obj
        if isinstance(whole, bytes) and len(whole) == end - offset and all(p.obj is whole for p in pieces):
            return whole  # one pread/fetch returned exactly the range: no copy
        return b"".join(pieces)

    def _read_present(
        self, layer: CachedLayer, chunks: list[tuple[int, int]], got: dict[int, memoryview], offset: int, end: int
    ) -> None:
        """pread the requested bytes of PRESENT chunks; keep those whose generation did not change meanwhile."""
        gens = dict(chunks)
        cs = self.chunk_size
        for run in chunk_runs([c for c, _ in chunks], 1 << 30):
            lo = max(offset, run[0] * cs)
            hi = min(end, (run[-1] + 1) * cs)
            buf = memoryview(pread_all(layer.data_fd, hi - lo, lo))
            with self._lock:
                for c in run:
                    if layer.gen[c] == gens[c]:  # not evicted meanwhile: the bytes we read are the cached ones
                        got[c] = buf[max(lo, c * cs) - lo : min(hi, (c + 1) * cs) - lo]

    def _fetch(
        self, layer: CachedLayer, claimed: list[int], got: dict[int, memoryview], offset: int, end: int
    ) -> None:
        """Fetch claimed (BUSY) chunks from the repository, write them to the cache file, publish them."""
        cs = self.chunk_size
        pending = set(claimed)
        try:
            for run in chunk_runs(claimed, self.max_fetch_chunks):
                off = run[0] * cs
                n = min((run[-1] + 1) * cs, layer.size) - off
                data = self._fetch_bytes(layer, off, n)
                view = memoryview(data)
                for c in run:
                    if c * cs < end:  # (chunks after the range are readahead)
                        got[c] = view[max(offset, c * cs) - off : min(end, (c + 1) * cs) - off]
                try:
                    pwrite_all(layer.data_fd, data, off)
                except OSError as e:  # e.g. the cache disk is full: serve the bytes, do not cache them
                    log.warning("cache: cannot write %s [%d, %d): %s", layer.digest, off, off + n, e)
                    with self._lock:
                        self._write_errors += 1
                    self._release(layer, run, None)
                else:
                    self._publish(layer, run)
                pending.difference_update(run)
        except BaseException as e:
            self._release(layer, sorted(pending), e)
            raise

    def _fetch_bytes(self, layer: CachedLayer, off: int, n: int) -> bytes:
        """The layer's bytes ``[off, off+n)``: from peers where they give them (checked), else the repository;
        counted (``fetches``/``fetched_bytes`` are the repository's, the peer counters the peers')."""
        if self.peers is None:
            return self._fetch_repository(layer, off, n)
        step = max(self.chunk_size, self.peers.options.max_range_bytes // self.chunk_size * self.chunk_size)
        pieces: list[bytes] = []
        for pos in range(off, off + n, step):
            k = min(step, off + n - pos)
            got = self.peers.fetch(layer.digest, layer.size, pos, k)
            pieces.append(got if got is not None else self._fetch_repository(layer, pos, k))
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    def _fetch_repository(self, layer: CachedLayer, off: int, n: int) -> bytes:
        data = self.repository.read_range(layer.digest, off, n)
        if len(data) != n:
            raise CacheError(
                f"repository returned {len(data)} bytes for {layer.digest} [{off}, {off + n}), expected {n}"
            )
        with self._lock:
            layer.fetches += 1
            layer.fetched_bytes += n
        return data

    def read_present_range(self, layer: CachedLayer | None, offset: int, length: int) -> bytes:
        """Serve a peer: ``[offset, offset+length)`` of the layer if every chunk of it is PRESENT now, read
        without fetching anything (``PeerServeRefused`` 404 otherwise; 400 past the layer's end).  Counts
        neither a hit nor a miss (the peer counters count it); the chunks become most recently used."""
        peers = self.peers
        if peers is None:
            raise PeerServeRefused(404, "this node does not serve layer ranges to peers (p2p.enabled = false)")
        peers.admit(length)
        served: int | None = None
        try:
            if layer is None:
                raise PeerServeRefused(404, "the layer is not cached on this node")
            if offset < 0 or length <= 0 or offset + length > layer.size:
                raise PeerServeRefused(400, f"range [{offset}, {offset + length}) is not inside the layer's "
                                       f"{layer.size} bytes")
            cs = self.chunk_size
            chunks = range(offset // cs, (offset + length - 1) // cs + 1)
            with self._lock:
                if not all(layer.state[c] == PRESENT for c in chunks):
                    raise PeerServeRefused(404, "the range is not cached on this node")
                gens = [layer.gen[c] for c in chunks]
                for c in chunks:
                    self._lru.move_to_end((layer, c))
            data = pread_all(layer.data_fd, length, offset)
            with self._lock:
                if [layer.gen[c] for c in chunks] != gens:  # evicted while it was read
                    raise PeerServeRefused(404, "the range was evicted from this node's cache")
            served = len(data)
            return data
        finally:
            peers.release(served)

    def _publish(self, layer: CachedLayer, chunks: Iterable[int], adopted: bool = False) -> None:
        """Make BUSY chunks whose bytes are in the cache file PRESENT (unsynced until the next sync)."""
        flights = []
        with self._lock:
            for c in chunks:
                n = layer.chunk_len(c)
                layer.state[c] = PRESENT
                layer.unsynced[c] = layer.gen[c]
                self._lru[(layer, c)] = None
                layer.cached_bytes += n
                self._cached_bytes += n
                if adopted:
                    layer.adopted_bytes += n
                flights.append(layer.flights.pop(c))
            layer.dirty = True
        for f in flights:
            f.event.set()

    def _release(self, layer: CachedLayer, chunks: Iterable[int], error: BaseException | None) -> None:
        """Give up BUSY chunks (back to ABSENT); waiters see ``error`` (or retry if None)."""
        flights = []
        with self._lock:
            for c in chunks:
                layer.state[c] = ABSENT
                f = layer.flights.pop(c)
                f.error = error
                flights.append(f)
        for f in flights:
            f.event.set()
