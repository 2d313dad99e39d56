"""The local layer cache: on-demand range fetch from the repository into sparse files, with per-range LRU.

Why a hand-written cache: layers are immutable files in a repository that may be far larger than the node's
disk (DESIGN.md "Local cache").  The block engine reads a layer through ``RandomAccessSource.pread``; the cache
turns a read into range fetches of ``chunk_size`` (256 KiB) units, keeps them in one sparse file per layer and
evicts the least recently used *ranges* (not whole layers) between two watermarks, so a cache much smaller than
the data it serves still answers every read correctly (cold ranges are evicted and fetched again).  No library
does byte-range caching over an arbitrary object store with crash-safe presence tracking and single-flight
fetches, and the pieces are small.

Files, per layer ``sha256:<hex>`` in ``cache_dir``:

* ``<hex>.cache``: sparse file of the layer's full size; a cached range sits at its own offset;
* ``<hex>.bitmap``: a 32-byte header (magic, chunk size, layer size, CRC) then one bit per chunk.

Crash safety (the on-disk bitmap never claims bytes that are not durably in the cache file):

* fill: the chunk is ``pwrite``-n into the cache file; the bit is set in memory at once (readers use it); the
  on-disk bit is set only by a *sync* that first ``fdatasync``-s the cache file.  Syncs are batched (every
  ``flush_interval_s``, on ``flush()`` and on ``close()``), so fetches do not pay an fsync each.  A crash loses
  at most the bits set since the last sync: those ranges are simply fetched again.
* evict: bits are cleared in the bitmap file and the bitmap is ``fdatasync``-ed BEFORE the hole is punched, so a
  crash in between leaves a harmless cached range that the bitmap no longer claims.
* A per-layer lock orders bitmap writers, so an older bitmap image can never overwrite a newer one.
Writing the whole bitmap (512 bytes per GiB of layer) in place is cheap; a torn write mixes two images that
are each a subset of the durable data, which is still safe.

Eviction punches holes with ``fallocate(FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE)`` through ctypes: Python's
``os.posix_fallocate`` can only allocate, and truncating or rewriting the file would move or lose the other
ranges; punching frees exactly the evicted blocks and keeps every other range at its offset.  The cache
directory's filesystem must support it (ext4, xfs, btrfs, tmpfs do); this is checked when the cache opens.

Concurrency: readers call from OS threads (the block engine is threaded).  One ``threading.Lock`` guards the
metadata (chunk states, LRU, counters); all I/O happens outside it.  A chunk is ABSENT, PRESENT or BUSY (being
fetched or evicted); a reader that finds it BUSY waits on that operation's ``threading.Event`` instead of
fetching it again (single-flight).  Readers of PRESENT chunks ``pread`` without holding the lock and then check
the chunk's generation number, which eviction bumps before it punches; a changed generation means "read again".
Contiguous missing chunks of one read are fetched with one ranged GET (up to ``max_fetch_bytes``); a read that
starts where the previous read of the layer ended and misses also fetches up to ``readahead_bytes`` of the
following absent chunks in that request (sequential scans of a remote layer pay one round trip per
read + readahead, not per read).

Counters (hits, misses, fetches, bytes fetched/evicted, last access) live in memory and are written to SQLite
(``cache_entries``) through ``CacheStore`` in one batched transaction at each sync, never per read.
"""

from __future__ import annotations

import array
import collections
import ctypes
import ctypes.util
import errno
import logging
import os
import struct
import threading
import time
import uuid
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Optional

import trio

from .errors import StorageError
from .fileops import fsync_dir, pwrite_all
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

_ABSENT, _PRESENT, _BUSY = 0, 1, 2

_MAGIC = b"AENVCBM1"
_HEADER = struct.Struct("<8sIIQII")  # magic, version, chunk_size, layer_size, n_chunks, crc32(previous fields)
_HEADER_SIZE = 32
_VERSION = 1


class CacheError(StorageError):
    """The local cache cannot do its job (its directory is unusable, a repository read came back short)."""


class CacheFilesystemUnsupported(CacheError):
    """The cache directory's filesystem cannot punch holes, so eviction could not free space."""


# -- hole punching ----------------------------------------------------------------------------------------------
_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02
_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_fallocate = _libc.fallocate
_fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
_fallocate.restype = ctypes.c_int


def punch_hole(fd: int, offset: int, length: int) -> None:
    """Deallocate ``[offset, offset+length)`` of an open file, keeping its size (reads there return zeros)."""
    if length <= 0:
        return
    if _fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, length) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"fallocate(PUNCH_HOLE) failed: {os.strerror(e)}")


def _check_punch_hole(directory: Path) -> None:
    probe = directory / f".probe-{uuid.uuid4().hex[:8]}"
    fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.pwrite(fd, b"\xff" * 8192, 0)
        punch_hole(fd, 0, 4096)
        if os.pread(fd, 4096, 0) != bytes(4096) or os.fstat(fd).st_size != 8192:
            raise CacheFilesystemUnsupported(f"hole punching in {directory} did not zero the range")
    except OSError as e:
        if e.errno in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise CacheFilesystemUnsupported(
                f"the filesystem of cache_dir {directory} cannot punch holes (fallocate PUNCH_HOLE: {e.strerror}); "
                "put the cache on ext4, xfs, btrfs or tmpfs"
            ) from e
        raise
    finally:
        os.close(fd)
        probe.unlink()


def _pread_all(fd: int, length: int, offset: int) -> bytes:
    out = os.pread(fd, length, offset)
    if len(out) == length:
        return out
    parts = [out]
    got = len(out)
    while got < length:
        b = os.pread(fd, length - got, offset + got)
        if not b:
            raise CacheError(f"cache file shorter than expected at offset {offset + got}")
        parts.append(b)
        got += len(b)
    return b"".join(parts)


# -- statistics -------------------------------------------------------------------------------------------------
@dataclass
class LayerCacheStats:
    digest: str
    size_bytes: int
    cached_bytes: int
    hits: int
    misses: int
    fetches: int
    fetched_bytes: int
    evicted_bytes: int
    adopted_bytes: int
    last_access_at: float


@dataclass
class CacheStats:
    """Totals over all layers (``hits``/``misses`` count chunks; ``fetches`` count repository reads)."""

    entries: int
    capacity_bytes: int
    cached_bytes: int
    hits: int
    misses: int
    fetches: int
    fetched_bytes: int
    evicted_bytes: int
    adopted_bytes: int
    write_errors: int


class _Flight:
    """One in-progress fetch or eviction of a chunk; others wait on ``event``."""

    __slots__ = ("event", "error")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.error: Optional[BaseException] = None


class _Layer:
    """Per-layer state.  Everything but the fds and ``bitmap_lock`` is guarded by the cache's ``_lock``."""

    def __init__(self, digest: str, size: int, chunk: int, data_path: Path, bitmap_path: Path) -> None:
        self.digest = digest
        self.size = size
        self.n_chunks = (size + chunk - 1) // chunk
        self.data_path = data_path
        self.bitmap_path = bitmap_path
        self.data_fd = -1
        self.bitmap_fd = -1
        self.state = bytearray(self.n_chunks)
        self.gen = array.array("I", bytes(4 * self.n_chunks))
        self.disk_bits = bytearray((self.n_chunks + 7) // 8)  # image of the on-disk bitmap
        self.flights: dict[int, _Flight] = {}
        self.unsynced: dict[int, int] = {}  # chunk -> generation, written but not yet fdatasync-ed
        self.bitmap_lock = threading.Lock()  # orders bitmap-file writers (sync vs evict)
        self.next_offset = -1  # where the last read ended: a read starting there is sequential (readahead)
        now = time.time()
        self.created_at = now
        self.last_access_at = now
        self.cached_bytes = 0
        self.hits = 0
        self.misses = 0
        self.fetches = 0
        self.fetched_bytes = 0
        self.evicted_bytes = 0
        self.adopted_bytes = 0
        self.dirty = True  # counters changed since the last store flush


class LayerCache:
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
        store: "Optional[CacheStore]" = None,
        chunk_size: int = CHUNK_SIZE,
        max_fetch_bytes: int = 4 * 1024 * 1024,
        readahead_bytes: int = 1024 * 1024,
        flush_interval_s: float = 5.0,
        durable: bool = True,
    ) -> None:
        if not 0 < low_watermark <= high_watermark <= 1:
            raise ValueError(f"need 0 < low_watermark <= high_watermark <= 1, got {low_watermark}, {high_watermark}")
        if capacity_bytes <= 0:
            raise ValueError("cache capacity_bytes must be positive")
        if chunk_size <= 0 or chunk_size % 4096:
            raise ValueError("cache chunk_size must be a positive multiple of 4096")
        self.dir = Path(cache_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        _check_punch_hole(self.dir)
        self.repository = repository
        self.capacity_bytes = capacity_bytes
        self.high_bytes = int(capacity_bytes * high_watermark)
        self.low_bytes = int(capacity_bytes * low_watermark)
        self.chunk_size = chunk_size
        self.max_fetch_chunks = max(1, max_fetch_bytes // chunk_size)
        self.readahead_chunks = max(0, readahead_bytes // chunk_size)
        self.flush_interval_s = flush_interval_s
        self.durable = durable
        self.store = store

        self._lock = threading.Lock()
        self._open_lock = threading.Lock()  # serialises creation of a layer's files
        self._evict_lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._layers: dict[str, _Layer] = {}
        self._lru: "collections.OrderedDict[tuple[_Layer, int], None]" = collections.OrderedDict()
        self._cached_bytes = 0
        self._write_errors = 0
        self._last_flush = time.monotonic()
        self._closed = False
        self._load()

    # -- public API -------------------------------------------------------------------------------------------
    def source(self, digest: str, size: int | None = None) -> "CachedSource":
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
                if layer.state[c] == _ABSENT:
                    layer.state[c] = _BUSY
                    layer.flights[c] = _Flight()
                    claimed.append(c)
        done: list[int] = []
        try:
            with open(path, "rb") as src:
                for run in _runs(claimed, 1 << 30):
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
            return all(layer.state[c] == _PRESENT for c in range(offset // self.chunk_size, (end - 1) // self.chunk_size + 1))

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
                    if layer.state[c] == _PRESENT:
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
            ls = list(self._layers.values())
            return CacheStats(
                entries=len(ls),
                capacity_bytes=self.capacity_bytes,
                cached_bytes=self._cached_bytes,
                hits=sum(x.hits for x in ls),
                misses=sum(x.misses for x in ls),
                fetches=sum(x.fetches for x in ls),
                fetched_bytes=sum(x.fetched_bytes for x in ls),
                evicted_bytes=sum(x.evicted_bytes for x in ls),
                adopted_bytes=sum(x.adopted_bytes for x in ls),
                write_errors=self._write_errors,
            )

    def layer_stats(self, digest: str) -> LayerCacheStats | None:
        with self._lock:
            x = self._layers.get(digest)
            if x is None:
                return None
            return LayerCacheStats(
                digest=x.digest,
                size_bytes=x.size,
                cached_bytes=x.cached_bytes,
                hits=x.hits,
                misses=x.misses,
                fetches=x.fetches,
                fetched_bytes=x.fetched_bytes,
                evicted_bytes=x.evicted_bytes,
                adopted_bytes=x.adopted_bytes,
                last_access_at=x.last_access_at,
            )

    def close(self) -> None:
        if self._closed:
            return
        self.flush()
        self._closed = True
        with self._lock:
            layers = list(self._layers.values())
        for layer in layers:
            self._close_layer(layer)

    def __enter__(self) -> "LayerCache":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- layers: open, create, load ---------------------------------------------------------------------------
    def _paths(self, hexd: str) -> tuple[Path, Path]:
        return self.dir / f"{hexd}.cache", self.dir / f"{hexd}.bitmap"

    def _layer(self, digest: str, size: int | None) -> _Layer:
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
            layer = _Layer(digest, size, self.chunk_size, data_path, bitmap_path)
            self._create_files(layer)
            with self._lock:
                self._layers[digest] = layer
            return layer

    def _header(self, layer: _Layer) -> bytes:
        fields = (_MAGIC, _VERSION, self.chunk_size, layer.size, layer.n_chunks)
        crc = zlib.crc32(struct.pack("<8sIIQI", *fields))
        return _HEADER.pack(*fields, crc)

    def _create_files(self, layer: _Layer, data_ready: bool = False) -> None:
        """Create the sparse data file (unless ``data_ready``) and an all-zero bitmap, atomically published."""
        if not data_ready:
            fd = os.open(layer.data_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                os.ftruncate(fd, layer.size)
            except BaseException:
                os.close(fd)
                raise
            layer.data_fd = fd
        else:
            layer.data_fd = os.open(layer.data_path, os.O_RDWR | os.O_CLOEXEC)
        tmp = self.dir / f".tmp-{layer.bitmap_path.name}-{uuid.uuid4().hex[:8]}"
        with open(tmp, "wb") as f:
            f.write(self._header(layer) + bytes(layer.disk_bits))
            f.flush()
            if self.durable:
                os.fsync(f.fileno())
        os.rename(tmp, layer.bitmap_path)
        if self.durable:
            fsync_dir(self.dir)
        layer.bitmap_fd = os.open(layer.bitmap_path, os.O_RDWR | os.O_CLOEXEC)

    def _load(self) -> None:
        """Rebuild the in-memory state from the bitmaps on disk; reconcile the store's rows with it."""
        rows = self.store.load() if self.store is not None else {}
        for pattern in (".tmp-*", ".probe-*"):  # leftovers of a crash while creating a bitmap / probing
            for p in self.dir.glob(pattern):
                p.unlink(missing_ok=True)
        loaded: list[_Layer] = []
        for bitmap_path in self.dir.glob("*.bitmap"):
            hexd = bitmap_path.name[: -len(".bitmap")]
            data_path = self.dir / f"{hexd}.cache"
            layer = self._load_one(hexd, data_path, bitmap_path)
            if layer is None:
                log.warning("cache: discarding unusable cache files of sha256:%s", hexd)
                bitmap_path.unlink(missing_ok=True)
                data_path.unlink(missing_ok=True)
                continue
            row = rows.get(layer.digest)
            if row is not None:
                layer.hits, layer.misses = row.hits, row.misses
                layer.fetched_bytes, layer.evicted_bytes = row.fetched_bytes, row.evicted_bytes
                layer.created_at, layer.last_access_at = row.created_at, row.last_access_at
            else:
                layer.last_access_at = bitmap_path.stat().st_mtime
            loaded.append(layer)
        # Data files without a bitmap never held claimed bytes (the bitmap is created with the file).
        known = {x.data_path for x in loaded}
        for p in self.dir.glob("*.cache"):
            if p not in known:
                p.unlink(missing_ok=True)
        loaded.sort(key=lambda x: x.last_access_at)  # least recently used layers first in the LRU
        for layer in loaded:
            self._layers[layer.digest] = layer
            for c in range(layer.n_chunks):
                if layer.state[c] == _PRESENT:
                    self._lru[(layer, c)] = None
            self._cached_bytes += layer.cached_bytes
        if self.store is not None:
            gone = [d for d in rows if d not in self._layers]
            self.store.delete(gone)
        if self._cached_bytes > self.high_bytes:
            self.evict()
        self._flush(blocking=True)

    def _load_one(self, hexd: str, data_path: Path, bitmap_path: Path) -> _Layer | None:
        try:
            raw = bitmap_path.read_bytes()
            magic, version, chunk, size, n, crc = _HEADER.unpack_from(raw)
        except (OSError, struct.error):
            return None
        if (
            magic != _MAGIC
            or version != _VERSION
            or crc != zlib.crc32(raw[:28])
            or chunk != self.chunk_size
            or n != (size + chunk - 1) // chunk
            or len(raw) != _HEADER_SIZE + (n + 7) // 8
        ):
            return None
        try:
            if data_path.stat().st_size != size:
                return None
        except FileNotFoundError:
            return None
        layer = _Layer("sha256:" + hexd, size, chunk, data_path, bitmap_path)
        layer.disk_bits[:] = raw[_HEADER_SIZE:]
        for c in range(n):
            if layer.disk_bits[c >> 3] & (1 << (c & 7)):
                layer.state[c] = _PRESENT
                layer.cached_bytes += self._chunk_len(layer, c)
        layer.dirty = True
        layer.data_fd = os.open(data_path, os.O_RDWR | os.O_CLOEXEC)
        layer.bitmap_fd = os.open(bitmap_path, os.O_RDWR | os.O_CLOEXEC)
        return layer

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
            layer = _Layer(digest, size, self.chunk_size, data_path, bitmap_path)
            if self.durable:
                fd = os.open(data_path, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    os.fdatasync(fd)
                finally:
                    os.close(fd)
            layer.disk_bits[:] = b"\xff" * len(layer.disk_bits)
            if layer.n_chunks % 8:
                layer.disk_bits[-1] = (1 << (layer.n_chunks % 8)) - 1
            self._create_files(layer, data_ready=True)
            with self._lock:
                self._layers[digest] = layer
                for c in range(layer.n_chunks):
                    layer.state[c] = _PRESENT
                    self._lru[(layer, c)] = None
                layer.cached_bytes = size
                layer.adopted_bytes += size
                self._cached_bytes += size
            return True

    def _close_layer(self, layer: _Layer) -> None:
        for name in ("data_fd", "bitmap_fd"):
            fd = getattr(layer, name)
            if fd >= 0:
                os.close(fd)
                setattr(layer, name, -1)

    # -- the read path ----------------------------------------------------------------------------------------
    def _chunk_len(self, layer: _Layer, c: int) -> int:
        return min(self.chunk_size, layer.size - c * self.chunk_size)

    def _read(self, layer: _Layer, offset: int, length: int) -> bytes:
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
            to_wait: list[_Flight] = []
            to_fetch: list[int] = []
            with self._lock:
                layer.last_access_at = time.time()
                layer.dirty = True
                for c in range(c0, c1 + 1):
                    if c in got:
                        continue
                    st = layer.state[c]
                    if st == _PRESENT:
                        to_read.append((c, layer.gen[c]))
                        self._lru.move_to_end((layer, c))
                        if first:
                            layer.hits += 1
                    else:
                        if first:
                            layer.misses += 1
                        if st == _BUSY:
                            to_wait.append(layer.flights[c])
                        else:
                            layer.state[c] = _BUSY
                            layer.flights[c] = _Flight()
                            to_fetch.append(c)
                if first and to_fetch and offset == layer.next_offset and to_fetch[-1] == c1:
                    # sequential miss: fetch the following absent chunks in the same request
                    for c in range(c1 + 1, min(c1 + 1 + self.readahead_chunks, layer.n_chunks)):
                        if layer.state[c] != _ABSENT:
                            break
                        layer.state[c] = _BUSY
                        layer.flights[c] = _Flight()
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
        self, layer: _Layer, chunks: list[tuple[int, int]], got: dict[int, memoryview], offset: int, end: int
    ) -> None:
        """pread the requested bytes of PRESENT chunks; keep those whose generation did not change meanwhile."""
        gens = dict(chunks)
        cs = self.chunk_size
        for run in _runs([c for c, _ in chunks], 1 << 30):
            lo = max(offset, run[0] * cs)
            hi = min(end, (run[-1] + 1) * cs)
            buf = memoryview(_pread_all(layer.data_fd, hi - lo, lo))
            with self._lock:
                for c in run:
                    if layer.gen[c] == gens[c]:  # not evicted meanwhile: the bytes we read are the cached ones
                        got[c] = buf[max(lo, c * cs) - lo : min(hi, (c + 1) * cs) - lo]

    def _fetch(self, layer: _Layer, claimed: list[int], got: dict[int, memoryview], offset: int, end: int) -> None:
        """Fetch claimed (BUSY) chunks from the repository, write them to the cache file, publish them."""
        cs = self.chunk_size
        pending = set(claimed)
        try:
            for run in _runs(claimed, self.max_fetch_chunks):
                off = run[0] * cs
                n = min((run[-1] + 1) * cs, layer.size) - off
                data = self.repository.read_range(layer.digest, off, n)
                if len(data) != n:
                    raise CacheError(
                        f"repository returned {len(data)} bytes for {layer.digest} [{off}, {off + n}), expected {n}"
                    )
                view = memoryview(data)
                for c in run:
                    if c * cs < end:  # (chunks after the range are readahead)
                        got[c] = view[max(offset, c * cs) - off : min(end, (c + 1) * cs) - off]
                with self._lock:
                    layer.fetches += 1
                    layer.fetched_bytes += n
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

    def _publish(self, layer: _Layer, chunks: Iterable[int], adopted: bool = False) -> None:
        flights = []
        with self._lock:
            for c in chunks:
                n = self._chunk_len(layer, c)
                layer.state[c] = _PRESENT
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

    def _release(self, layer: _Layer, chunks: Iterable[int], error: BaseException | None) -> None:
        """Give up BUSY chunks (back to ABSENT); waiters see ``error`` (or retry if None)."""
        flights = []
        with self._lock:
            for c in chunks:
                layer.state[c] = _ABSENT
                f = layer.flights.pop(c)
                f.error = error
                flights.append(f)
        for f in flights:
            f.event.set()

    def _after_insert(self) -> None:
        if self._cached_bytes > self.high_bytes:
            self.evict()

    # -- eviction ---------------------------------------------------------------------------------------------
    def _evict(self, target: int) -> int:
        victims: dict[_Layer, list[int]] = {}
        freed = 0
        with self._lock:
            while self._cached_bytes > target and self._lru:
                (layer, c), _ = self._lru.popitem(last=False)
                n = self._chunk_len(layer, c)
                layer.state[c] = _BUSY
                layer.flights[c] = _Flight()
                layer.gen[c] += 1
                layer.unsynced.pop(c, None)
                layer.disk_bits[c >> 3] &= ~(1 << (c & 7)) & 0xFF
                layer.cached_bytes -= n
                layer.evicted_bytes += n
                layer.dirty = True
                self._cached_bytes -= n
                freed += n
                victims.setdefault(layer, []).append(c)
        for layer, chunks in victims.items():
            chunks.sort()
            try:
                # 1. the bitmap file stops claiming the chunks (durably), 2. only then are their blocks freed.
                with layer.bitmap_lock:
                    with self._lock:
                        image = bytes(layer.disk_bits)
                    pwrite_all(layer.bitmap_fd, image, _HEADER_SIZE)
                    if self.durable:
                        os.fdatasync(layer.bitmap_fd)
                for run in _runs(chunks, 1 << 30):
                    off = run[0] * self.chunk_size
                    punch_hole(layer.data_fd, off, min((run[-1] + 1) * self.chunk_size, layer.size) - off)
            finally:
                self._release(layer, chunks, None)
        return freed

    # -- durability and counters ------------------------------------------------------------------------------
    def _sync_layer(self, layer: _Layer) -> None:
        """fdatasync the cache file, then record the chunks that were written before it in the bitmap file."""
        with layer.bitmap_lock:
            with self._lock:
                if not layer.unsynced or layer.data_fd < 0:
                    return
                pending = dict(layer.unsynced)
            if self.durable:
                os.fdatasync(layer.data_fd)
            with self._lock:
                for c, g in pending.items():
                    if layer.unsynced.get(c) == g:
                        del layer.unsynced[c]
                        if layer.state[c] == _PRESENT and layer.gen[c] == g:
                            layer.disk_bits[c >> 3] |= 1 << (c & 7)
                image = bytes(layer.disk_bits)
            pwrite_all(layer.bitmap_fd, image, _HEADER_SIZE)

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
                        rows.append(
                            CacheRow(
                                layer_digest=x.digest,
                                path=str(x.data_path),
                                size_bytes=x.size,
                                cached_bytes=x.cached_bytes,
                                hits=x.hits,
                                misses=x.misses,
                                fetched_bytes=x.fetched_bytes,
                                evicted_bytes=x.evicted_bytes,
                                created_at=x.created_at,
                                last_access_at=x.last_access_at,
                            )
                        )
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

    def close(self) -> None:
        """Nothing to release: the cache owns the files."""

    def __repr__(self) -> str:
        return f"CachedSource({self.digest}, size={self.size})"


async def run_janitor(
    cache: LayerCache, interval_s: float = 5.0, *, task_status: "trio.TaskStatus[None]" = trio.TASK_STATUS_IGNORED
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


def _runs(chunks: list[int], max_len: int) -> list[list[int]]:
    """Split sorted chunk indexes into runs of consecutive indexes, at most ``max_len`` long."""
    runs: list[list[int]] = []
    for c in chunks:
        if runs and runs[-1][-1] == c - 1 and len(runs[-1]) < max_len:
            runs[-1].append(c)
        else:
            runs.append([c])
    return runs



