"""Immutable, content-addressed layer files: a streaming writer and a verifying reader.

The byte layout is in ``layer_format.py``.  A layer is written once (to a temp file, fsynced, renamed to
``<sha256>.layer``) and never modified, so any number of images and nodes can share it and a cache can hold
any byte range of it.  The reader touches its source only through ``pread`` (``RandomAccessSource``), so it
works the same over a local file and over the on-demand cache of a remote repository.

Every byte the reader returns has been checked against a checksum (xxh3-64 or crc32 per 4 KiB block, or per
compressed group), and the header, trailer and index carry their own crc32: a damaged or truncated layer raises ``LayerCorrupt``
naming the part and file offset; it never yields wrong data.
"""

from __future__ import annotations

import array
import hashlib
import os
import secrets
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Literal, NamedTuple

import numpy as np

from . import layer_format as F
from .errors import LayerCorrupt, LayerFormatError
from .fileops import fsync_dir, pwrite_all
from .source import FileSource, RandomAccessSource

__all__ = ["Extent", "LayerInfo", "LayerWriter", "LayerReader", "write_layer_tail", "LAYER_SUFFIX"]

LAYER_SUFFIX = ".layer"
_B = F.BLOCK
_BMASK = F.BLOCK - 1
_SHIFT = F.BLOCK_SHIFT
_DATA = F.DATA_OFFSET
ZeroPolicy = Literal["keep", "omit", "zeroed"]

try:  # zstandard is a project dependency; keep uncompressed layers usable without it
    import zstandard as _zstd
except ImportError:  # pragma: no cover
    _zstd = None  # type: ignore[assignment]  # reason: typed as the module; every use checks for None first


class Extent(NamedTuple):
    """One mapping of a layer: ``length`` bytes at virtual ``offset``; data at ``data_offset`` of the data stream
    unless ``zeroed`` (reads as zeros, no data)."""

    offset: int
    length: int
    data_offset: int
    zeroed: bool


@dataclass(frozen=True)
class LayerInfo:
    digest: str  # hex sha256 of the whole file
    path: str
    file_size: int
    virtual_size: int
    extent_count: int
    data_bytes: int  # logical bytes of data extents (zeroed extents excluded)
    compressed: bool


def _write_all(fd: int, data: bytes | bytearray | memoryview) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def block_checksums(data: bytes | bytearray | memoryview, csum: "Callable[[bytes | memoryview], int]") -> list[int]:
    """Checksum of every 4 KiB block of ``data`` (length a multiple of 4 KiB)."""
    mv = memoryview(data)
    B = F.BLOCK
    return [csum(mv[i : i + B]) for i in range(0, len(mv), B)]


def write_layer_tail(fd: int, hasher: "hashlib._Hash", geometry: F.Geometry, extents: np.ndarray,
                     checksums: np.ndarray) -> F.Geometry:
    """Write index + padding + trailer right after the data area (the header and data already hashed into
    ``hasher``).  Returns the final geometry.  Shared by the writer and seal."""
    index = extents.tobytes() + checksums.tobytes()
    index_offset = F.DATA_OFFSET + geometry.data_length
    padded = F.round_up(len(index))
    g = F.Geometry(
        flags=geometry.flags, virtual_size=geometry.virtual_size, block_size=F.BLOCK,
        group_size=geometry.group_size, data_length=geometry.data_length, stream_length=geometry.stream_length,
        index_offset=index_offset, index_length=len(index), extent_count=len(extents),
        checksum_count=len(checksums), file_size=index_offset + padded + F.TRAILER_SIZE,
        index_crc=F.crc32(index),
    )
    tail = index + bytes(padded - len(index)) + F.pack_trailer(g)
    pwrite_all(fd, tail, index_offset)
    hasher.update(tail)
    return g


def publish_layer(tmp_path: str, dest_dir: str, digest: str) -> str:
    """Give a finished (fsynced) layer file its content address in ``dest_dir``; return the final path."""
    final = os.path.join(dest_dir, digest + LAYER_SUFFIX)
    os.replace(tmp_path, final)  # if it already existed, it has the same content: content addressed
    fsync_dir(dest_dir)
    return final


class LayerWriter:
    """Build a layer from extents given in increasing virtual order, streaming to a temp file.

    ``add_data(offset, data)`` and ``add_zeroed(offset, length)`` take 4 KiB-aligned ranges that do not overlap
    earlier ones; adjacent ranges are merged.  ``zero_blocks`` decides what happens to all-zero data blocks:
    ``keep`` stores them, ``omit`` drops them (a hole: right for a bottom layer), ``zeroed`` records them as
    zeroed extents (no data, still shadow the layers below).  ``finish()`` fsyncs, renames the file to
    ``<sha256>.layer`` in ``dest_dir`` and returns its ``LayerInfo``.  Use as a context manager to remove the
    temp file on error.
    """

    def __init__(self, dest_dir: str | os.PathLike[str], virtual_size: int, *, compression: str | None = None,
                 level: int = 3, group_size: int = 64 * 1024, zero_blocks: ZeroPolicy = "keep",
                 fsync: bool = True) -> None:
        if virtual_size < 0 or virtual_size % F.BLOCK:
            raise LayerFormatError(f"virtual size {virtual_size} must be a multiple of {F.BLOCK}")
        if compression not in (None, "zstd"):
            raise LayerFormatError(f"unknown compression {compression!r} (None or 'zstd')")
        if compression and (_zstd is None):
            raise LayerFormatError("zstd compression needs the 'zstandard' package")
        if compression and (group_size <= 0 or group_size % F.BLOCK):
            raise LayerFormatError(f"group size {group_size} must be a positive multiple of {F.BLOCK}")
        self.dest_dir = os.fspath(dest_dir)
        self.virtual_size = virtual_size
        self.zero_blocks = zero_blocks
        self._fsync = fsync
        self._compressed = compression == "zstd"
        self._group = group_size if self._compressed else 0
        self._cctx = _zstd.ZstdCompressor(level=level) if self._compressed else None
        self._flags = (F.FLAG_COMPRESSED_ZSTD if self._compressed else 0) | F.default_csum_flag()
        self._csum = F.data_checksum(self._flags)
        self.tmp_path = os.path.join(self.dest_dir, f".tmp-{secrets.token_hex(8)}{LAYER_SUFFIX}")
        self._fd = os.open(self.tmp_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        self._done = False
        self._hash = hashlib.sha256()
        header = F.pack_header(F.Geometry(self._flags, virtual_size, F.BLOCK, self._group))
        try:
            self._write(header)
        except BaseException:
            # the constructor raised, so no ``with`` block will abort it: the temporary goes here (a full disk
            # made this leak a ``.tmp-*.layer`` when the header was the write that found no room)
            self.abort()
            raise
        self._ext: list[list[int]] = []  # [voff, length, doff, flags]
        self._end = 0  # virtual end of the last extent
        self._stream = 0  # logical data stream length
        self._data_written = 0  # bytes written to the data area
        self._crcs: list[int] = []
        self._pending = bytearray()  # compressed: stream bytes not yet cut into a group
        self._jump: list[tuple[int, int, int, int]] = []
        self._data_bytes = 0
        self._done = False

    # -- output --------------------------------------------------------------------------------------------
    def _write(self, data: bytes | bytearray | memoryview) -> None:
        _write_all(self._fd, data)
        self._hash.update(data)

    def _emit_group(self, chunk: bytes | memoryview) -> None:
        assert self._cctx is not None
        comp = self._cctx.compress(chunk)
        if len(comp) >= len(chunk):
            stored, flag = bytes(chunk), F.JUMP_RAW
        else:
            stored, flag = comp, 0
        self._jump.append((self._data_written, len(stored) | flag, 0, self._csum(stored)))
        self._write(stored)
        self._data_written += len(stored)

    def _append_stream(self, data: bytes | bytearray | memoryview) -> int:
        doff = self._stream
        if self._compressed:
            self._pending += data
            g = self._group
            if len(self._pending) >= g:
                mv = memoryview(self._pending)
                n = len(mv) // g * g
                for i in range(0, n, g):
                    self._emit_group(mv[i : i + g])
                mv.release()
                del self._pending[:n]
        else:
            self._crcs += block_checksums(data, self._csum)
            self._write(data)
            self._data_written += len(data)
        self._stream += len(data)
        return doff

    # -- input ---------------------------------------------------------------------------------------------
    def _check(self, offset: int, length: int) -> None:
        if self._done:
            raise LayerFormatError("layer writer already finished")
        if offset % F.BLOCK or length % F.BLOCK or length <= 0:
            raise LayerFormatError(f"extent ({offset}, {length}) not {F.BLOCK}-aligned or empty")
        if offset < self._end:
            raise LayerFormatError(f"extent at {offset} overlaps or precedes the previous one (ends {self._end})")
        if offset + length > self.virtual_size:
            raise LayerFormatError(f"extent ({offset}, {length}) beyond virtual size {self.virtual_size}")

    def _add_extent(self, voff: int, length: int, doff: int, flags: int) -> None:
        if self._ext:
            last = self._ext[-1]
            if (last[3] == flags and last[0] + last[1] == voff
                    and (flags & F.EXTENT_ZEROED or last[2] + last[1] == doff)):
                last[1] += length
                self._end = voff + length
                return
        self._ext.append([voff, length, 0 if flags & F.EXTENT_ZEROED else doff, flags])
        self._end = voff + length

    def add_zeroed(self, offset: int, length: int) -> None:
        self._check(offset, length)
        self._add_extent(offset, length, 0, F.EXTENT_ZEROED)

    def add_data(self, offset: int, data: bytes | bytearray | memoryview) -> None:
        length = len(data)
        self._check(offset, length)
        if self.zero_blocks == "keep":
            self._add_extent(offset, length, self._append_stream(data), 0)
            self._data_bytes += length
            return
        nz = np.asarray(np.frombuffer(data, dtype=np.uint64).reshape(-1, F.BLOCK // 8).any(axis=1))
        if nz.all():
            self._add_extent(offset, length, self._append_stream(data), 0)
            self._data_bytes += length
            return
        mv = memoryview(data)
        # runs of equal "non-zero" flags
        edges = np.flatnonzero(np.diff(nz.astype(np.int8))) + 1
        starts = np.concatenate(([0], edges))
        ends = np.concatenate((edges, [len(nz)]))
        for s, e in zip(starts.tolist(), ends.tolist()):
            v, n = offset + s * F.BLOCK, (e - s) * F.BLOCK
            if nz[s]:
                self._add_extent(v, n, self._append_stream(mv[s * F.BLOCK : e * F.BLOCK]), 0)
                self._data_bytes += n
            elif self.zero_blocks == "zeroed":
                self._add_extent(v, n, 0, F.EXTENT_ZEROED)
            else:
                self._end = v + n

    # -- completion ----------------------------------------------------------------------------------------
    def finish(self) -> LayerInfo:
        if self._done:
            raise LayerFormatError("layer writer already finished")
        try:
            if self._compressed:
                if self._pending:
                    self._emit_group(bytes(self._pending))
                    self._pending.clear()
                pad = F.round_up(self._data_written) - self._data_written
                if pad:
                    self._write(bytes(pad))
                checksums = np.array(self._jump, dtype=F.JUMP_DTYPE) if self._jump else np.empty(0, F.JUMP_DTYPE)
                data_length = self._data_written + pad
            else:
                checksums = np.array(self._crcs, dtype=F.CSUM_DTYPE)
                data_length = self._data_written
            extents = np.zeros(len(self._ext), dtype=F.EXTENT_DTYPE)
            if self._ext:
                arr = np.array(self._ext, dtype=np.uint64)
                extents["voff"], extents["length"], extents["doff"] = arr[:, 0], arr[:, 1], arr[:, 2]
                extents["flags"] = arr[:, 3].astype(np.uint32)
            g = F.Geometry(self._flags, self.virtual_size, F.BLOCK, self._group, data_length=data_length,
                           stream_length=self._stream)
            g = write_layer_tail(self._fd, self._hash, g, extents, checksums)
            if self._fsync:
                os.fsync(self._fd)
            os.close(self._fd)
            self._fd = -1
            digest = self._hash.hexdigest()
            path = publish_layer(self.tmp_path, self.dest_dir, digest)
            self._done = True
            return LayerInfo(digest, path, g.file_size, self.virtual_size, len(extents), self._data_bytes,
                             self._compressed)
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        self._done = True
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        try:
            os.unlink(self.tmp_path)
        except FileNotFoundError:
            pass

    def __enter__(self) -> "LayerWriter":
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if not self._done:
            self.abort()


class LayerReader:
    """Read a layer through a ``RandomAccessSource`` (only ever ``pread``), verifying everything it returns.

    Opening reads and checks the header, trailer and index (three preads).  ``extents`` is the index as a numpy
    structured array (fields voff, length, doff, flags).  ``read_stream`` returns verified bytes of the data
    stream; ``read`` is a standalone virtual read (holes as zeros) for tools and tests.
    The reader owns its source: ``close()`` closes it if it can be closed.
    """

    def __init__(self, source: RandomAccessSource, *, name: str | None = None, digest: str | None = None,
                 verify_reads: bool = True, group_cache: int = 32) -> None:
        self.source = source
        self._pread = source.pread
        self.name = name or getattr(source, "path", None) or repr(source)
        self.digest = digest
        self.verify_reads = verify_reads
        size = source.size
        if size < F.HEADER_SIZE + F.TRAILER_SIZE:
            raise LayerCorrupt("file", 0, f"truncated: {size} bytes is smaller than header + trailer", self.name)
        flags, vsize, gsize = F.unpack_header(source.pread(0, F.HEADER_SIZE), self.name)
        g = F.unpack_trailer(source.pread(size - F.TRAILER_SIZE, F.TRAILER_SIZE), size - F.TRAILER_SIZE,
                             self.name)
        if (g.flags, g.virtual_size, g.group_size) != (flags, vsize, gsize):
            raise LayerCorrupt("trailer", size - F.TRAILER_SIZE, "does not match the header", self.name)
        F.validate_geometry(g, size, self.name)
        self.geometry = g
        self.virtual_size = g.virtual_size
        self.compressed = g.compressed
        index = source.pread(g.index_offset, g.index_length)
        if len(index) != g.index_length or F.crc32(index) != g.index_crc:
            raise LayerCorrupt("index", g.index_offset, "checksum mismatch", self.name)
        n = g.extent_count * F.EXTENT_DTYPE.itemsize
        self.extents = np.frombuffer(index, dtype=F.EXTENT_DTYPE, count=g.extent_count)
        # the table the layer does not have is empty: a compressed layer has a jump table and no block
        # checksums (each group has its own), an uncompressed one the reverse
        self._jump: np.ndarray = np.empty(0, F.JUMP_DTYPE)
        self._crcs: array.array[int] = array.array("Q")
        if self.compressed:
            self._jump = np.frombuffer(index, dtype=F.JUMP_DTYPE, offset=n, count=g.checksum_count)
        else:
            # array.array: scalar access is ~5x faster than numpy's on the read path, and 8 bytes per block
            # (a list would cost 40: 100 MiB for a 10 GiB layer)
            self._crcs.frombytes(
                np.frombuffer(index, dtype=F.CSUM_DTYPE, offset=n, count=g.checksum_count).astype("=u8").tobytes())
        self._csum = F.data_checksum(g.flags)
        self._validate_index()
        self._gcache: OrderedDict[int, bytes] = OrderedDict()
        self._gcache_max = group_cache
        self._glock = threading.Lock()
        self._dctx_local = threading.local()

    @classmethod
    def open(cls, path: str | os.PathLike[str], **kw: Any) -> "LayerReader":
        """Open a local layer file (its digest is taken from a ``<digest>.layer`` name)."""
        path = os.fspath(path)
        base = os.path.basename(path)
        digest = base[: -len(LAYER_SUFFIX)] if base.endswith(LAYER_SUFFIX) and len(base) == 64 + 6 else None
        src = FileSource(path)
        try:
            return cls(src, name=path, digest=digest, **kw)
        except BaseException:
            src.close()
            raise

    def _validate_index(self) -> None:
        e, g = self.extents, self.geometry
        if not len(e):
            return
        voff, length, doff, flags = (e[k].astype(np.int64) for k in ("voff", "length", "doff", "flags"))

        def bad(detail: str) -> LayerCorrupt:
            return LayerCorrupt("index", g.index_offset, detail, self.name)

        if ((voff | length) % F.BLOCK).any() or (length <= 0).any():
            raise bad("extent not 4 KiB aligned or empty")
        if (voff[1:] < voff[:-1] + length[:-1]).any():
            raise bad("extents unsorted or overlapping")
        if int(voff[-1] + length[-1]) > g.virtual_size:
            raise bad("extent beyond the virtual size")
        if (flags & ~F.KNOWN_EXTENT_FLAGS).any():
            raise bad("unknown extent flags")
        data = (flags & F.EXTENT_ZEROED) == 0
        if (doff[data] + length[data] > g.stream_length).any():
            raise bad("extent data beyond the data area")
        if not self.compressed and (doff[data] % F.BLOCK).any():
            raise bad("extent data not 4 KiB aligned")
        if self.compressed and len(self._jump):
            j = self._jump
            stored = (j["stored"] & ~np.uint32(F.JUMP_RAW)).astype(np.int64)
            if (j["off"].astype(np.int64) + stored > g.data_length).any():
                raise bad("jump table entry beyond the data area")

    # -- reads ---------------------------------------------------------------------------------------------
    def read_stream(self, doff: int, length: int) -> bytes:
        """``length`` verified bytes of the data stream at ``doff``."""
        if self.compressed:
            return self._read_compressed(doff, length) if length > 0 else b""
        a = doff & ~_BMASK
        b = (doff + length + _BMASK) & ~_BMASK
        n = b - a
        buf = self._pread(_DATA + a, n)
        if len(buf) != n:
            if length <= 0:
                return b""
            raise LayerCorrupt("data", _DATA + a + len(buf), "truncated", self.name)
        if self.verify_reads:
            try:
                self._verify_blocks(buf, a >> _SHIFT)
            except LayerCorrupt:
                if not self._forget(_DATA + a, n):
                    raise
                buf = self._pread(_DATA + a, n)  # fetched again: a second mismatch is final
                if len(buf) != n:
                    raise LayerCorrupt("data", _DATA + a + len(buf), "truncated", self.name) from None
                self._verify_blocks(buf, a >> _SHIFT)
        if a == doff and n == length:
            return buf
        return buf[doff - a : doff - a + length]

    def _forget(self, offset: int, length: int) -> bool:
        """Drop a source's cached copy of a range that failed its checksum, so it can be read again (a layer
        read through the local cache: the repository's copy may have been repaired, or the bytes damaged on
        the way). False for a source that holds no copy of its own (a local file: its bytes are final)."""
        invalidate = getattr(self.source, "invalidate", None)
        if invalidate is None:
            return False
        invalidate(offset, length)
        return True

    def _verify_blocks(self, buf: bytes, first: int) -> None:
        if len(buf) == _B:  # one block: the common case, without the array
            if self._csum(buf) != self._crcs[first]:
                raise LayerCorrupt("data block", _DATA + (first << _SHIFT), "checksum mismatch", self.name)
            return
        mv = memoryview(buf)
        csum = self._csum
        got = array.array("Q", [csum(mv[i : i + _B]) for i in range(0, len(buf), _B)])
        want = self._crcs[first : first + len(got)]
        if got != want:  # one C-level comparison; find the culprit only on failure
            bad = next(i for i in range(len(got)) if got[i] != want[i])
            raise LayerCorrupt("data block", _DATA + ((first + bad) << _SHIFT), "checksum mismatch", self.name)

    def _group(self, gi: int) -> bytes:
        with self._glock:
            hit = self._gcache.get(gi)
            if hit is not None:
                self._gcache.move_to_end(gi)
                return hit
        off, stored, _, csum = self._jump[gi].tolist()
        raw = bool(stored & F.JUMP_RAW)
        stored &= ~F.JUMP_RAW
        pos = F.DATA_OFFSET + off
        buf = self.source.pread(pos, stored)
        if len(buf) != stored:
            raise LayerCorrupt("compressed group", pos + len(buf), "truncated", self.name)
        if self._csum(buf) != csum and self._forget(pos, stored):
            buf = self.source.pread(pos, stored)  # fetched again: a second mismatch is final
        if self._csum(buf) != csum:
            raise LayerCorrupt("compressed group", pos, "checksum mismatch", self.name)
        g = self.geometry
        expect = min(g.group_size, g.stream_length - gi * g.group_size)
        if raw:
            out = buf
        else:
            dctx = getattr(self._dctx_local, "d", None)
            if dctx is None:
                dctx = self._dctx_local.d = _zstd.ZstdDecompressor()
            try:
                out = dctx.decompress(buf, max_output_size=expect)
            except _zstd.ZstdError as e:
                raise LayerCorrupt("compressed group", pos, f"zstd: {e}", self.name) from None
        if len(out) != expect:
            raise LayerCorrupt("compressed group", pos, f"decompressed to {len(out)} bytes, expected {expect}",
                               self.name)
        with self._glock:
            self._gcache[gi] = out
            if len(self._gcache) > self._gcache_max:
                self._gcache.popitem(last=False)
        return out

    def _read_compressed(self, doff: int, length: int) -> bytes:
        gs = self.geometry.group_size
        g0, g1 = doff // gs, (doff + length - 1) // gs
        if g0 == g1:
            start = doff - g0 * gs
            return self._group(g0)[start : start + length]
        parts = []
        pos, end = doff, doff + length
        for gi in range(g0, g1 + 1):
            grp = self._group(gi)
            s = pos - gi * gs
            e = min(end - gi * gs, len(grp))
            parts.append(grp[s:e])
            pos = gi * gs + e
        return b"".join(parts)

    def iter_extents(self) -> Iterator[Extent]:
        for voff, length, doff, flags, _ in self.extents.tolist():
            yield Extent(voff, length, doff, bool(flags & F.EXTENT_ZEROED))

    def read(self, offset: int, length: int) -> bytes:
        """Virtual read of this layer alone: holes and zeroed extents read as zeros."""
        out = bytearray(length)
        e = self.extents
        voff = e["voff"]
        i = max(int(np.searchsorted(voff, offset, side="right")) - 1, 0)
        end = offset + length
        while i < len(e):
            v, n, d, fl, _ = e[i].tolist()
            if v >= end:
                break
            s, t = max(v, offset), min(v + n, end)
            if s < t and not fl & F.EXTENT_ZEROED:
                out[s - offset : t - offset] = self.read_stream(d + s - v, t - s)
            i += 1
        return bytes(out)

    def verify(self) -> None:
        """Check every data block / group (and the sha256 when the digest is known); raise ``LayerCorrupt``."""
        g = self.geometry
        step = 1 << 20
        if self.compressed:
            for gi in range(g.checksum_count):
                with self._glock:
                    self._gcache.pop(gi, None)
                self._group(gi)
        else:
            for pos in range(0, g.stream_length, step):
                self.read_stream(pos, min(step, g.stream_length - pos))
        if self.digest:
            h = hashlib.sha256()
            for pos in range(0, self.source.size, step):
                h.update(self.source.pread(pos, min(step, self.source.size - pos)))
            if h.hexdigest() != self.digest:
                raise LayerCorrupt("file", None, "sha256 does not match the layer's digest", self.name)

    def fileno(self) -> int | None:
        """The local file descriptor when the source is a local file (zero-copy paths), else None."""
        f = getattr(self.source, "fileno", None)
        return f() if f else None

    def close(self) -> None:
        c = getattr(self.source, "close", None)
        if c:
            c()

    def __enter__(self) -> "LayerReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"LayerReader({self.name!r}, extents={self.geometry.extent_count}, compressed={self.compressed})"
