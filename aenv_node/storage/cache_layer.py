"""One layer in the local layer cache: its sparse data file, its presence bitmap file and its in-memory state.

Why a module of its own: the cache's policy (which chunks to keep, when to fetch, when to sync; see
:mod:`.cache`) rests on one small on-disk format and on the order in which its two files are written.  That
format and that order are what make the cache crash-safe, so they live here, apart from the policy, in one place
a reader can check.

Files, per layer ``sha256:<hex>`` in the cache directory:

* ``<hex>.cache``: sparse file of the layer's full size; a cached range sits at its own offset;
* ``<hex>.bitmap``: a 32-byte header (magic, chunk size, layer size, CRC) then one bit per chunk.

Crash safety (the on-disk bitmap never claims bytes that are not durably in the cache file):

* fill: the chunk is ``pwrite``-n into the cache file; the bit is set in memory at once (readers use it); the
  on-disk bit is set only by a *sync* (:meth:`CachedLayer.sync`) that first ``fdatasync``-s the cache file.
  Syncs are batched by the cache, so fetches do not pay an fsync each.  A crash loses at most the bits set
  since the last sync: those ranges are simply fetched again.
* evict (:meth:`CachedLayer.drop_chunks`): bits are cleared in the bitmap file and the bitmap is
  ``fdatasync``-ed BEFORE the hole is punched, so a crash in between leaves a harmless cached range that the
  bitmap no longer claims.
* A per-layer lock orders bitmap writers, so an older bitmap image can never overwrite a newer one.
Writing the whole bitmap (512 bytes per GiB of layer) in place is cheap; a torn write mixes two images that
are each a subset of the durable data, which is still safe.

Eviction punches holes with ``fallocate(FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE)`` through ctypes: Python's
``os.posix_fallocate`` can only allocate, and truncating or rewriting the file would move or lose the other
ranges; punching frees exactly the evicted blocks and keeps every other range at its offset.  The cache
directory's filesystem must support it (ext4, xfs, btrfs, tmpfs do); :func:`check_punch_hole` checks it when
the cache opens.
"""

from __future__ import annotations

import array
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
from pathlib import Path

from .errors import CacheError, CacheFilesystemUnsupported
from .fileops import fsync_dir, pwrite_all

__all__ = [
    "ABSENT",
    "BUSY",
    "PRESENT",
    "CachedLayer",
    "Flight",
    "check_punch_hole",
    "chunk_runs",
    "load_layers",
    "pread_all",
    "punch_hole",
]

log = logging.getLogger("aenv_node.storage.cache")  # the cache's one logger name, whichever module logs

# The state of one chunk: not cached, cached (readable without the lock), or being fetched or evicted.
ABSENT, PRESENT, BUSY = 0, 1, 2

_MAGIC = b"AENVCBM1"
_HEADER = struct.Struct("<8sIIQII")  # magic, version, chunk_size, layer_size, n_chunks, crc32(previous fields)
_HEADER_SIZE = 32
_VERSION = 1


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


def check_punch_hole(directory: Path) -> None:
    """Raise ``CacheFilesystemUnsupported`` unless ``directory``'s filesystem punches holes that read as zeros."""
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


def pread_all(fd: int, length: int, offset: int) -> bytes:
    """``pread`` exactly ``length`` bytes (a single call may return fewer); a cache file too short is an error."""
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


def chunk_runs(chunks: list[int], max_len: int) -> list[list[int]]:
    """Split sorted chunk indexes into runs of consecutive indexes, at most ``max_len`` long."""
    runs: list[list[int]] = []
    for c in chunks:
        if runs and runs[-1][-1] == c - 1 and len(runs[-1]) < max_len:
            runs[-1].append(c)
        else:
            runs.append([c])
    return runs


# -- one layer --------------------------------------------------------------------------------------------------
class Flight:
    """One in-progress fetch or eviction of a chunk; others wait on ``event``."""

    __slots__ = ("error", "event")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.error: BaseException | None = None


class CachedLayer:
    """Per-layer state.  Everything but the fds and ``bitmap_lock`` is guarded by the cache's metadata lock
    (the ``lock`` that :meth:`sync` and :meth:`drop_chunks` are given)."""

    def __init__(self, digest: str, size: int, chunk: int, data_path: Path, bitmap_path: Path) -> None:
        self.digest = digest
        self.size = size
        self.chunk_size = chunk
        self.n_chunks = (size + chunk - 1) // chunk
        self.data_path = data_path
        self.bitmap_path = bitmap_path
        self.data_fd = -1
        self.bitmap_fd = -1
        self.state = bytearray(self.n_chunks)
        self.gen = array.array("I", bytes(4 * self.n_chunks))
        self.disk_bits = bytearray((self.n_chunks + 7) // 8)  # image of the on-disk bitmap
        self.flights: dict[int, Flight] = {}
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

    def chunk_len(self, c: int) -> int:
        """Bytes in chunk ``c`` (the last chunk of a layer may be short)."""
        return min(self.chunk_size, self.size - c * self.chunk_size)

    # -- the files: create, load, close -----------------------------------------------------------------------
    def _header(self) -> bytes:
        fields = (_MAGIC, _VERSION, self.chunk_size, self.size, self.n_chunks)
        crc = zlib.crc32(struct.pack("<8sIIQI", *fields))
        return _HEADER.pack(*fields, crc)

    def create_files(self, directory: Path, *, durable: bool, data_ready: bool = False) -> None:
        """Create the sparse data file (unless ``data_ready``) and a bitmap of ``disk_bits``, atomically
        published in ``directory``; open both."""
        if not data_ready:
            fd = os.open(self.data_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                os.ftruncate(fd, self.size)
            except BaseException:
                os.close(fd)
                raise
            self.data_fd = fd
        else:
            self.data_fd = os.open(self.data_path, os.O_RDWR | os.O_CLOEXEC)
        tmp = directory / f".tmp-{self.bitmap_path.name}-{uuid.uuid4().hex[:8]}"
        with open(tmp, "wb") as f:
            f.write(self._header() + bytes(self.disk_bits))
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.rename(tmp, self.bitmap_path)
        if durable:
            fsync_dir(directory)
        self.bitmap_fd = os.open(self.bitmap_path, os.O_RDWR | os.O_CLOEXEC)

    @classmethod
    def load(cls, hexd: str, data_path: Path, bitmap_path: Path, chunk_size: int) -> CachedLayer | None:
        """The layer whose files survived from an earlier run, with the chunks its bitmap claims PRESENT; None
        if the files are unusable (bad header or CRC, another chunk size, sizes that do not match)."""
        try:
            raw = bitmap_path.read_bytes()
            magic, version, chunk, size, n, crc = _HEADER.unpack_from(raw)
        except (OSError, struct.error):
            return None
        if (
            magic != _MAGIC
            or version != _VERSION
            or crc != zlib.crc32(raw[:28])
            or chunk != chunk_size
            or n != (size + chunk - 1) // chunk
            or len(raw) != _HEADER_SIZE + (n + 7) // 8
        ):
            return None
        try:
            if data_path.stat().st_size != size:
                return None
        except FileNotFoundError:
            return None
        layer = cls("sha256:" + hexd, size, chunk, data_path, bitmap_path)
        layer.disk_bits[:] = raw[_HEADER_SIZE:]
        for c in range(n):
            if layer.disk_bits[c >> 3] & (1 << (c & 7)):
                layer.state[c] = PRESENT
                layer.cached_bytes += layer.chunk_len(c)
        layer.dirty = True
        layer.data_fd = os.open(data_path, os.O_RDWR | os.O_CLOEXEC)
        layer.bitmap_fd = os.open(bitmap_path, os.O_RDWR | os.O_CLOEXEC)
        return layer

    def close_files(self) -> None:
        for name in ("data_fd", "bitmap_fd"):
            fd = getattr(self, name)
            if fd >= 0:
                os.close(fd)
                setattr(self, name, -1)

    # -- durability: the order of the two files' writes -------------------------------------------------------
    def sync(self, lock: threading.Lock, *, durable: bool) -> None:
        """fdatasync the cache file, then record the chunks that were written before it in the bitmap file."""
        with self.bitmap_lock:
            with lock:
                if not self.unsynced or self.data_fd < 0:
                    return
                pending = dict(self.unsynced)
            if durable:
                os.fdatasync(self.data_fd)
            with lock:
                for c, g in pending.items():
                    if self.unsynced.get(c) == g:
                        del self.unsynced[c]
                        if self.state[c] == PRESENT and self.gen[c] == g:
                            self.disk_bits[c >> 3] |= 1 << (c & 7)
                image = bytes(self.disk_bits)
            pwrite_all(self.bitmap_fd, image, _HEADER_SIZE)

    def drop_chunks(self, chunks: list[int], lock: threading.Lock, *, durable: bool) -> None:
        """Free the blocks of sorted ``chunks``, whose bits the caller already cleared in ``disk_bits``."""
        # 1. the bitmap file stops claiming the chunks (durably), 2. only then are their blocks freed.
        with self.bitmap_lock:
            with lock:
                image = bytes(self.disk_bits)
            pwrite_all(self.bitmap_fd, image, _HEADER_SIZE)
            if durable:
                os.fdatasync(self.bitmap_fd)
        for run in chunk_runs(chunks, 1 << 30):
            off = run[0] * self.chunk_size
            punch_hole(self.data_fd, off, min((run[-1] + 1) * self.chunk_size, self.size) - off)


def load_layers(directory: Path, chunk_size: int) -> list[CachedLayer]:
    """The layers whose files survived in the cache ``directory`` from an earlier run.  Removes what a crash or
    an older format left there: temporary bitmaps and probes, unusable file pairs, data files without a bitmap."""
    for pattern in (".tmp-*", ".probe-*"):  # leftovers of a crash while creating a bitmap / probing
        for p in directory.glob(pattern):
            p.unlink(missing_ok=True)
    loaded: list[CachedLayer] = []
    for bitmap_path in directory.glob("*.bitmap"):
        hexd = bitmap_path.name[: -len(".bitmap")]
        data_path = directory / f"{hexd}.cache"
        layer = CachedLayer.load(hexd, data_path, bitmap_path, chunk_size)
        if layer is None:
            log.warning("cache: discarding unusable cache files of sha256:%s", hexd)
            bitmap_path.unlink(missing_ok=True)
            data_path.unlink(missing_ok=True)
            continue
        loaded.append(layer)
    # Data files without a bitmap never held claimed bytes (the bitmap is created with the file).
    known = {x.data_path for x in loaded}
    for p in directory.glob("*.cache"):
        if p not in known:
            p.unlink(missing_ok=True)
    return loaded
