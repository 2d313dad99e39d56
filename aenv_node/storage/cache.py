"""The local layer cache: on-demand range fetch from the repository into sparse files, with per-range LRU.

Why a hand-written cache: layers are immutable files in a repository that may be far larger than the node's
disk (DESIGN.md "Local cache").  The block engine reads a layer through ``RandomAccessSource.pread``; the cache
turns a read into range fetches of ``chunk_size`` (256 KiB) units, keeps them in one sparse file per layer and
evicts the least recently used *ranges* (not whole layers) between two watermarks, so a cache much smaller than
the data it serves still answers every read correctly (cold ranges are evicted and fetched again).  No library
does byte-range caching over an arbitrary object store with crash-safe presence tracking and single-flight
fetches, and the pieces are small.

This module is the cache's face and policy: :class:`LayerCache` (opening and reloading layers, adopting local
files, LRU eviction between watermarks, batched syncs and counters), :class:`CachedSource`, the janitor task.
Its parts: :mod:`.cache_layer` (one layer's sparse file and presence bitmap, and the order of their writes that
makes the cache crash-safe), :mod:`.cache_read` (the concurrent read path: single-flight ranged fetches,
readahead, lock-free ``pread`` of cached chunks), :mod:`.cache_stats` (the counters it reports),
:mod:`.cache_peers` (P2P, off unless ``peers`` is given: missing ranges from other nodes' caches, checked by
checksum, and the bounds of serving ours to them).

Counters (hits, misses, fetches, bytes fetched/evicted, last access) live in memory and are written to SQLite
(``cache_entries``) through ``CacheStore`` in one batched transaction at each sync, never per read.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from .cache_peers import PeerOptions
from .cache_layer import (
    ABSENT,
    BUSY,
    PRESENT,
    CachedLayer,
    Flight,
    check_punch_hole,
    chunk_runs,
    load_layers,
    punch_hole,
)
from .cache_read import ChunkReader
from .cache_stats import CacheStats, LayerCacheStats, layer_stats, total_stats
from .errors import CacheError, CacheFilesystemUnsupported
from .repository.base import Repository, check_digest, digest_of_file
from .repository.errors import DigestMismatch

if TYPE_CHECKING:  # SQLAlchemy is imported only by caches that persist counters
    from .cache_store import CacheStore

__all__ = [
    "LayerCache",
    "CachedSource",
    "CacheStats",
    "LayerCacheStats",
    "CacheError",
    "CacheFilesystemUnsupported",
    "CHUNK_SIZE",
    "punch_hole",
    "run_janitor",
]

log = logging.getLogger(__name__)

CHUNK_SIZE = 256 * 1024


class LayerCache(ChunkReader):
    """The node's local cache of repository layers.  Thread-safe; blocking (async callers use to_thread).

    ``capacity_bytes`` bounds the cached bytes: when they exceed ``high_watermark * capacity`` the least recently
    used chunks are evicted until they are at most ``low_watermark * capacity``.  ``store`` (optional) persists
    counters to SQLite; ``flush_interval_s`` is how often a reader thread syncs bitmaps and counters if nobody
    called ``flush()`` in the meantime (the node's cache janitor calls ``flush()`` on its own schedule).
    """

    def __init__(
        self,
        cache_dir: str | os.PathLike[str],
        repository: Repository,
        *,
        capacity_bytes: int,
        high_watermark: float = 0.95,
        low_watermark: float = 0.70,
        store: CacheStore | None = None,
        chunk_size: int = CHUNK_SIZE,
        max_fetch_bytes: int = 4 * 1024 * 1024,
        readahead_bytes: int = 1024 * 1024,
        flush_interval_s: float = 5.0,
        durable: bool = True,
        peers: PeerOptions | None = None,
    ) -> None:
        if not 0 < low_watermark <= high_watermark <= 1:
            raise ValueError(f"need 0 < low_watermark <= high_watermark <= 1, got {low_watermark}, {high_watermark}")
        if capacity_bytes <= 0:
            raise ValueError("cache capacity_bytes must be positive")
        if chunk_size <= 0 or chunk_size % 4096:
            raise ValueError("cache chunk_size must be a positive multiple of 4096")
        self.dir = Path(cache_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        check_punch_hole(self.dir)
        super().__init__(
            repository, chunk_size=chunk_size, max_fetch_bytes=max_fetch_bytes, readahead_bytes=readahead_bytes,
            peers=peers,
        )
        self.capacity_bytes = capacity_bytes
        self.high_bytes = int(capacity_bytes * high_watermark)
        self.low_bytes = int(capacity_bytes * low_watermark)
        self.flush_interval_s = flush_interval_s
        self.durable = durable
        self.store = store

        self._open_lock = threading.Lock()  # serialises creation of a layer's files
        self._evict_lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._layers: dict[str, CachedLayer] = {}
        self._last_flush = time.monotonic()
        self._closed = False
        self._load()

    # -- public API -------------------------------------------------------------------------------------------
    def source(self, digest: str, size: int | None = None) -> CachedSource:
        return CachedSource(self, digest, size)

    def layer_size(self, digest: str, size: int | None = None) -> int:
        return self._layer(digest, size).size

    def read(self, digest: str, offset: int, length: int, size: int | None = None) -> bytes:
        """``length`` bytes of layer ``digest`` from ``offset`` (shorter only at the end of the layer)."""
        if offset < 0 or length < 0:
            raise ValueError(f"bad range offset={offset} length={length}")
        if self._closed:
            raise CacheError(f"read of {digest} from a closed cache")
        layer = self._layer(digest, size)
        out = self._read(layer, offset, length)
        if self._cached_bytes > self.high_bytes:
            self.evict()
        if time.monotonic() - self._last_flush >= self.flush_interval_s:
            self._flush(blocking=False)
        return out

    def serve_range(self, digest: str, offset: int, length: int) -> bytes:
        """A range of a layer for a peer, only if every chunk of it is cached here now (never fetched):
        ``PeerServeRefused`` (404 not cached or P2P off, 400 a bad range) or ``PeerServeBusy`` (503) if not."""
        check_digest(digest)
        if self._closed:
            raise CacheError(f"read of {digest} from a closed cache")
        with self._lock:
            layer = self._layers.get(digest)
        return self.read_present_range(layer, offset, length)

    def cached_layers(self, limit: int) -> list[str]:
        """Up to ``limit`` digests of layers with cached bytes, most recently used first (what the node
        announces to the holder index for P2P)."""
        with self._lock:
            held = [x for x in self._layers.values() if x.cached_bytes > 0]
        held.sort(key=lambda x: x.last_access_at, reverse=True)
        return [x.digest for x in held[:limit]]

    def adopt(self, digest: str, path: str | os.PathLike[str], *, verify: bool = True, move: bool = False) -> None:
        """Put a local layer file (e.g. a freshly sealed layer) into the cache without fetching it.

        ``verify`` hashes the file first (``DigestMismatch`` if it is not ``digest``).  ``move=True`` renames the
        file into the cache when the layer is not cached yet and the file is on the cache's filesystem (no copy);
        otherwise the missing ranges are copied in with ``copy_file_range``.
        """
        check_digest(digest)
        path = Path(path)
        if verify:
            actual = digest_of_file(path)
            if actual != digest:
                raise DigestMismatch(digest, actual, str(path))
        size = path.stat().st_size
        if move and self._adopt_by_rename(digest, path, size):
            self._after_insert()
            return
        layer = self._layer(digest, size)
        if layer.size != size:
            raise CacheError(f"{path} is {size} bytes but cached layer {digest} is {layer.size}")
        claimed: list[int] = []
        with self._lock:
            for c in range(layer.n_chunks):
                if layer.state[c] == ABSENT:
                    layer.state[c] = BUSY
                    layer.flights[c] = Flight()
                    claimed.append(c)
        done: list[int] = []
        try:
            with open(path, "rb") as src:
                for run in chunk_runs(claimed, 1 << 30):
                    off = run[0] * self.chunk_size
                    end = min((run[-1] + 1) * self.chunk_size, layer.size)
                    pos = off
                    while pos < end:
                        n = os.copy_file_range(src.fileno(), layer.data_fd, end - pos, pos, pos)
                        if n == 0:
                            raise CacheError(f"{path} ended early while adopting it")
                        pos += n
                    done.extend(run)
        finally:
            self._publish(layer, done, adopted=True)
            finished = set(done)
            self._release(layer, [c for c in claimed if c not in finished], None)
        self._sync_layer(layer)
        self._after_insert()

    def contains(self, digest: str, offset: int, length: int) -> bool:
        """Whether every byte of the range is cached now (no fetch)."""
        with self._lock:
            layer = self._layers.get(digest)
            if layer is None:
                return False
            end = min(offset + length, layer.size)
            if end <= offset:
                return True
            return all(layer.state[c] == PRESENT for c in range(offset // self.chunk_size, (end - 1) // self.chunk_size + 1))

    def evict(self, target_bytes: int | None = None) -> int:
        """Evict least recently used chunks until at most ``target_bytes`` (default: the low watermark) are
        cached; return the bytes evicted.  Returns 0 at once if another thread is already evicting."""
        if not self._evict_lock.acquire(blocking=target_bytes is not None):
            return 0
        try:
            return self._evict(self.low_bytes if target_bytes is None else target_bytes)
        finally:
            self._evict_lock.release()

    def discard(self, digest: str) -> None:
        """Forget a layer entirely (its files and its row), e.g. after it was deleted from the repository.
        The caller makes sure no reader is using it."""
        with self._open_lock:
            with self._lock:
                layer = self._layers.pop(digest, None)
                if layer is None:
                    return
                for c in range(layer.n_chunks):
                    if layer.state[c] == PRESENT:
                        self._lru.pop((layer, c), None)
                self._cached_bytes -= layer.cached_bytes
            self._close_layer(layer)
            for p in (layer.bitmap_path, layer.data_path):
                p.unlink(missing_ok=True)
        if self.store is not None:
            self.store.delete([digest])

    def flush(self) -> None:
        """Make every cached range durable in the bitmaps and write changed counters to the store."""
        self._flush(blocking=True)

    def stats(self) -> CacheStats:
        with self._lock:
            return total_stats(
                list(self._layers.values()),
                capacity_bytes=self.capacity_bytes,
                cached_bytes=self._cached_bytes,
                write_errors=self._write_errors,
                peers=None if self.peers is None else self.peers.snapshot(),
            )

    def layer_stats(self, digest: str) -> LayerCacheStats | None:
        with self._lock:
            x = self._layers.get(digest)
            return None if x is None else layer_stats(x)

    def close(self) -> None:
        if self._closed:
            return
        self.flush()
        self._closed = True
        with self._lock:
            layers = list(self._layers.values())
        for layer in layers:
            self._close_layer(layer)

    def __enter__(self) -> LayerCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- layers: open, create, load ---------------------------------------------------------------------------
    def _paths(self, hexd: str) -> tuple[Path, Path]:
        return self.dir / f"{hexd}.cache", self.dir / f"{hexd}.bitmap"

    def _layer(self, digest: str, size: int | None) -> CachedLayer:
        layer = self._layers.get(digest)
        if layer is not None:
            return layer
        hexd = check_digest(digest)
        if size is None:
            size = self.repository.layer_size(digest)  # raises LayerNotFound
        with self._open_lock:
            layer = self._layers.get(digest)
            if layer is not None:
                return layer
            if self._closed:
                raise CacheError("the cache is closed")
            data_path, bitmap_path = self._paths(hexd)
            layer = CachedLayer(digest, size, self.chunk_size, data_path, bitmap_path)
            layer.create_files(self.dir, durable=self.durable)
            with self._lock:
                self._layers[digest] = layer
            return layer

    def _load(self) -> None:
        """Rebuild the in-memory state from the bitmaps on disk; reconcile the store's rows with it."""
        rows = self.store.load() if self.store is not None else {}
        loaded = load_layers(self.dir, self.chunk_size)
        for layer in loaded:
            row = rows.get(layer.digest)
            if row is not None:
                layer.hits, layer.misses = row.hits, row.misses
                layer.fetched_bytes, layer.evicted_bytes = row.fetched_bytes, row.evicted_bytes
                layer.created_at, layer.last_access_at = row.created_at, row.last_access_at
            else:
                layer.last_access_at = layer.bitmap_path.stat().st_mtime
        loaded.sort(key=lambda x: x.last_access_at)  # least recently used layers first in the LRU
        for layer in loaded:
            self._layers[layer.digest] = layer
            for c in range(layer.n_chunks):
                if layer.state[c] == PRESENT:
                    self._lru[(layer, c)] = None
            self._cached_bytes += layer.cached_bytes
        if self.store is not None:
            gone = [d for d in rows if d not in self._layers]
            self.store.delete(gone)
        if self._cached_bytes > self.high_bytes:
            self.evict()
        self._flush(blocking=True)

    def _adopt_by_rename(self, digest: str, path: Path, size: int) -> bool:
        hexd = check_digest(digest)
        with self._open_lock:
            if digest in self._layers:
                return False
            data_path, bitmap_path = self._paths(hexd)
            try:
                os.rename(path, data_path)
            except OSError as e:
                if e.errno == errno.EXDEV:  # another filesystem: copy instead
                    return False
                raise
            layer = CachedLayer(digest, size, self.chunk_size, data_path, bitmap_path)
            if self.durable:
                fd = os.open(data_path, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    os.fdatasync(fd)
                finally:
                    os.close(fd)
            layer.disk_bits[:] = b"\xff" * len(layer.disk_bits)
            if layer.n_chunks % 8:
                layer.disk_bits[-1] = (1 << (layer.n_chunks % 8)) - 1
            layer.create_files(self.dir, durable=self.durable, data_ready=True)
            with self._lock:
                self._layers[digest] = layer
                for c in range(layer.n_chunks):
                    layer.state[c] = PRESENT
                    self._lru[(layer, c)] = None
                layer.cached_bytes = size
                layer.adopted_bytes += size
                self._cached_bytes += size
            return True

    def _close_layer(self, layer: CachedLayer) -> None:
        layer.close_files()

    def _after_insert(self) -> None:
        if self._cached_bytes > self.high_bytes:
            self.evict()

    # -- eviction ---------------------------------------------------------------------------------------------
    def invalidate(self, digest: str, offset: int, length: int) -> int:
        """Drop the cached chunks holding ``[offset, offset + length)`` of a layer, so the next read fetches
        them again: a reader found bytes there that fail their checksum (a copy corrupted in the repository
        since fixed, or on the way). Chunks being fetched are left alone. Returns the bytes dropped."""
        victims: dict[CachedLayer, list[int]] = {}
        with self._lock:
            layer = self._layers.get(digest)
            if layer is None or length <= 0:
                return 0
            end = min(offset + length, layer.size)
            for c in range(offset // self.chunk_size, (end - 1) // self.chunk_size + 1):
                if layer.state[c] == PRESENT:
                    self._lru.pop((layer, c), None)
                    victims.setdefault(layer, []).append(c)
            freed = self._take_chunks(victims)
        self._drop_taken(victims)
        return freed

    def _evict(self, target: int) -> int:
        victims: dict[CachedLayer, list[int]] = {}
        with self._lock:
            cached = self._cached_bytes
            while cached > target and self._lru:
                (layer, c), _ = self._lru.popitem(last=False)
                cached -= layer.chunk_len(c)
                victims.setdefault(layer, []).append(c)
            freed = self._take_chunks(victims)
        self._drop_taken(victims)
        return freed

    def _take_chunks(self, victims: dict[CachedLayer, list[int]]) -> int:
        """Under the metadata lock: mark the chunks (already out of the LRU) BUSY and no longer cached."""
        freed = 0
        for layer, chunks in victims.items():
            for c in chunks:
                n = layer.chunk_len(c)
                layer.state[c] = BUSY
                layer.flights[c] = Flight()
                layer.gen[c] += 1
                layer.unsynced.pop(c, None)
                layer.disk_bits[c >> 3] &= ~(1 << (c & 7)) & 0xFF
                layer.cached_bytes -= n
                layer.evicted_bytes += n
                layer.dirty = True
                self._cached_bytes -= n
                freed += n
        return freed

    def _drop_taken(self, victims: dict[CachedLayer, list[int]]) -> None:
        """Outside the lock: clear their bits in the bitmap file, free their blocks, and make them ABSENT."""
        for layer, chunks in victims.items():
            chunks.sort()
            try:
                layer.drop_chunks(chunks, self._lock, durable=self.durable)
            finally:
                self._release(layer, chunks, None)

    # -- durability and counters ------------------------------------------------------------------------------
    def _sync_layer(self, layer: CachedLayer) -> None:
        layer.sync(self._lock, durable=self.durable)

    def _flush(self, blocking: bool) -> None:
        if not self._flush_lock.acquire(blocking=blocking):
            return
        try:
            self._last_flush = time.monotonic()
            with self._lock:
                layers = list(self._layers.values())
            for layer in layers:
                self._sync_layer(layer)
            if self.store is None:
                return
            from .cache_store import CacheRow

            rows = []
            with self._lock:
                for x in layers:
                    if x.dirty:
                        x.dirty = False
                        rows.append(CacheRow.of(x))
            try:
                self.store.save(rows)
            except Exception:
                with self._lock:
                    for x in layers:
                        if any(r.layer_digest == x.digest for r in rows):
                            x.dirty = True
                raise
        finally:
            self._flush_lock.release()


class CachedSource:
    """A repository layer read through the local cache: implements ``RandomAccessSource``."""

    def __init__(self, cache: LayerCache, digest: str, size: int | None = None) -> None:
        self.cache = cache
        self.digest = digest
        self.size = cache.layer_size(digest, size)

    def pread(self, offset: int, length: int) -> bytes:
        if length <= 0:
            return b""
        return self.cache.read(self.digest, offset, length, self.size)

    def invalidate(self, offset: int, length: int) -> None:
        """Forget the cached copy of a range whose bytes failed their checksum (the next read fetches it)."""
        self.cache.invalidate(self.digest, offset, length)

    def close(self) -> None:
        """Nothing to release: the cache owns the files."""

    def __repr__(self) -> str:
        return f"CachedSource({self.digest}, size={self.size})"


async def run_janitor(
    cache: LayerCache, interval_s: float = 5.0, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """The node's cache janitor task: every ``interval_s`` sync bitmaps and counters (``flush``) and enforce the
    high watermark, in a worker thread, until cancelled; a last flush runs shielded on the way out.  With it,
    reader threads rarely pay for a flush themselves."""
    task_status.started()
    try:
        while True:
            await trio.sleep(interval_s)
            await trio.to_thread.run_sync(cache.flush)
            if cache.stats().cached_bytes > cache.high_bytes:
                await trio.to_thread.run_sync(cache.evict)
    finally:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(cache.flush)
