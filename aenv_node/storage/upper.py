"""The per-sandbox writable upper layer: a sparse data file, an append-only mapping log, an in-memory block map.

Files in the upper's directory, for generation N (bumped by every seal):
- ``data.N``: 4 KiB reserved (becomes the layer header at seal) + data blocks, allocated append-only at 4 KiB
  granularity.  A virtual block gets a physical block on its first write and is overwritten *in place*
  afterwards, so rewrites do not grow the file (large writes over fragmented ranges are the exception: they
  are reallocated contiguously).  Freed blocks (trimmed, reallocated) are never reused: reuse could let an
  unflushed trim expose another block's data after a crash.  Because data blocks
  are 4 KiB-aligned at offset 4 KiB, sealing turns this file into a layer by writing a header, an index and a
  trailer around it: no data copy.
- ``stack.N`` (optional): the digests of the layers the upper sits on, bottom first (``UpperStack``, JSON
  ``{"version": 1, "layers": [...]}``, read and written only by this module).  Written before
  the log header of its generation (so a seal commits the new layer list and the fresh upper at once) and
  replaced atomically by a compaction, it lets a crashed node reopen every image exactly as it was.
- ``log.N``: a 64-byte header, then 32-byte records (map a run of virtual blocks to physical blocks, or mark a
  run zeroed), each with a sequence number and crc32.  Records are buffered in memory and appended at
  ``flush()``, closed by a commit record, after the data file is fdatasync'ed; then the log is fdatasync'ed:
  every write acknowledged by a flush survives kill -9 and power loss.  On open the log is replayed through the
  last intact commit; what follows (a torn tail: a flush that never returned) is cut off.  A damaged record
  *before* an intact commit is not a torn tail: it raises ``UpperCorrupt`` instead of silently losing data.

The in-memory map is chunked (1024 blocks = 4 MiB of virtual space per 4 KiB int32 numpy chunk, allocated on
first touch), so an upper costs memory in proportion to what was written, not to the disk size: thousands of
sandboxes with 10 GiB disks stay cheap (at most 10 MiB for a 10 GiB disk written all over).  int32 physical
block numbers cap one upper's data file at 8 TiB.

Thread safety: mutations (``write_blocks``, ``zero_blocks``, ``flush``) must be serialised by the caller (the
image's write lock).  ``runs``/``read_blocks`` may run concurrently with them: a physical block is published in
the map only after its data is written, and never reused.
"""

from __future__ import annotations

import os
import re
import struct
from typing import Iterator, Literal, Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict

from . import layer_format as F
from .errors import UpperCorrupt, UpperFull
from .fileops import fsync_dir

__all__ = ["Upper", "UpperStack", "ABSENT", "ZEROED"]

ABSENT = -1  # not written in this upper: read through to the layers below
ZEROED = -2  # trimmed / write-zeroed in this upper: reads as zeros

CHUNK_SHIFT = 10
CHUNK = 1 << CHUNK_SHIFT

_LOG_MAGIC = b"AENVUPL\x01"
_LOG_HDR = struct.Struct("<8sIIQQ")  # magic, version, block size, virtual size, generation
_LOG_HDR_SIZE = 64
_REC = struct.Struct("<IIQQI")  # type, count, vblock, pblock, seq (+ crc32)
_REC_SIZE = 32
_MAX_PBLOCKS = 2**31 - 1
_DEFRAG_MIN_BLOCKS = 16  # writes this large over a fragmented range get a fresh contiguous allocation
REC_MAP = 1
REC_ZERO = 2
REC_COMMIT = 3  # ends the records of one flush (count = how many)

_GEN_RE = re.compile(r"^(log|data|stack)\.(\d+)$")


class UpperStack(BaseModel):
    """``stack.N``: the layers an upper of generation N sits on, bottom first (their digests).

    Version 1 is the only format so far; a file without a version is one.  A file of a newer version is not
    read (``UpperCorrupt``): its upper's writes are not to be reopened over a stack this code may misread."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    version: Literal[1] = 1
    layers: list[str]

    @classmethod
    def decode(cls, data: bytes) -> UpperStack:
        """``ValueError`` if ``data`` is not a stack file this code reads."""
        return cls.model_validate_json(data)

    def encode(self) -> bytes:
        return self.model_dump_json().encode()


def _pack_rec(kind: int, count: int, vb: int, pb: int, seq: int) -> bytes:
    body = _REC.pack(kind, count, vb, pb, seq)
    return body + struct.pack("<I", F.crc32(body)) + bytes(_REC_SIZE - _REC.size - 4)


class Upper:
    """A writable upper in directory ``path`` for a device of ``virtual_size`` bytes (created if missing)."""

    def __init__(self, path: str | os.PathLike[str], virtual_size: int, *, fsync: bool = True,
                 stack: Sequence[str] | None = None) -> None:
        if virtual_size % F.BLOCK:
            raise ValueError(f"virtual size {virtual_size} must be a multiple of {F.BLOCK}")
        self.path = os.fspath(path)
        self.virtual_size = virtual_size
        self.nblocks = virtual_size >> F.BLOCK_SHIFT
        self._fsync = fsync
        os.makedirs(self.path, exist_ok=True)
        self._chunks: dict[int, np.ndarray] = {}
        self._pending = bytearray()
        self._seq = 0
        self._closed = False
        self.data_fd = -1
        self.log_fd = -1
        self.stack: list[str] | None = None
        gen = self._find_generation()
        if gen is None:
            self._create(0, stack)
        else:
            self._open(gen)
            self.stack = self._read_stack(gen)

    # -- files ---------------------------------------------------------------------------------------------
    def _paths(self, gen: int) -> tuple[str, str]:
        return os.path.join(self.path, f"data.{gen}"), os.path.join(self.path, f"log.{gen}")

    def _find_generation(self) -> int | None:
        """Newest generation whose log header is complete; stale files of other generations are removed."""
        gens: dict[int, set[str]] = {}
        for name in os.listdir(self.path):
            if name.endswith(".tmp"):  # a generation whose creation did not finish
                os.unlink(os.path.join(self.path, name))
                continue
            m = _GEN_RE.match(name)
            if m:
                gens.setdefault(int(m.group(2)), set()).add(m.group(1))
        chosen = None
        for gen in sorted(gens, reverse=True):
            if "log" in gens[gen] and "data" in gens[gen] and self._log_header_ok(gen):
                chosen = gen
                break
        for gen, kinds in gens.items():
            if gen != chosen:
                for kind in kinds:
                    os.unlink(os.path.join(self.path, f"{kind}.{gen}"))
        return chosen

    def _log_header_ok(self, gen: int) -> bool:
        with open(self._paths(gen)[1], "rb") as f:
            raw = f.read(_LOG_HDR_SIZE)
        if len(raw) < _LOG_HDR_SIZE:
            return False
        (crc,) = struct.unpack_from("<I", raw, _LOG_HDR.size)
        if F.crc32(raw[: _LOG_HDR.size]) != crc:
            return False
        magic, version, bs, vsize, g = _LOG_HDR.unpack_from(raw)
        if magic != _LOG_MAGIC or version != 1 or bs != F.BLOCK or g != gen:
            return False
        if vsize != self.virtual_size:
            raise UpperCorrupt(f"{self.path}: upper was made for a {vsize}-byte device, not {self.virtual_size}")
        return True

    @staticmethod
    def peek(path: str | os.PathLike[str]) -> tuple[int, list[str] | None] | None:
        """(virtual size, recorded layer stack) of the upper in ``path`` without opening or repairing it;
        None if there is no committed upper there."""
        path = os.fspath(path)
        try:
            names = os.listdir(path)
        except FileNotFoundError:
            return None
        gens = sorted({int(m.group(2)) for n in names if (m := _GEN_RE.match(n)) and m.group(1) == "log"},
                      reverse=True)
        for gen in gens:
            if f"data.{gen}" not in names:
                continue
            with open(os.path.join(path, f"log.{gen}"), "rb") as f:
                raw = f.read(_LOG_HDR_SIZE)
            if len(raw) < _LOG_HDR_SIZE or F.crc32(raw[: _LOG_HDR.size]) != struct.unpack_from("<I", raw,
                                                                                               _LOG_HDR.size)[0]:
                continue
            magic, version, bs, vsize, g = _LOG_HDR.unpack_from(raw)
            if magic != _LOG_MAGIC or version != 1 or bs != F.BLOCK or g != gen:
                continue
            probe = object.__new__(Upper)
            probe.path = path
            return vsize, probe._read_stack(gen)
        return None

    # -- recorded stack ------------------------------------------------------------------------------------
    def _stack_path(self, gen: int) -> str:
        return os.path.join(self.path, f"stack.{gen}")

    def _read_stack(self, gen: int) -> list[str] | None:
        try:
            with open(self._stack_path(gen), "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        try:
            return list(UpperStack.decode(data).layers)
        except ValueError as e:
            raise UpperCorrupt(f"{self._stack_path(gen)}: not a layer stack ({e})") from None

    def _write_stack(self, gen: int, stack: Sequence[str] | None) -> None:
        path = self._stack_path(gen)
        if stack is None:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            return
        with open(path + ".tmp", "wb") as f:
            f.write(UpperStack(layers=list(stack)).encode())
            f.flush()
            if self._fsync:
                os.fsync(f.fileno())
        os.rename(path + ".tmp", path)

    def set_stack(self, stack: Sequence[str] | None) -> None:
        """Record (atomically, durably) the digests of the layers this upper sits on, bottom first."""
        self._write_stack(self.generation, stack)
        self._sync_dir()
        self.stack = None if stack is None else list(stack)

    def _create(self, gen: int, stack: Sequence[str] | None = None, *, sync: bool = True) -> None:
        """Create empty files for ``gen``; the log header, written and synced last, is the commit point.
        ``sync`` False: nothing is fsynced here (the first flush's fdatasync of the log makes the header
        durable; the caller syncs the directory later)."""
        self._write_stack(gen, stack)
        self.stack = None if stack is None else list(stack)
        data_path, log_path = self._paths(gen)
        dfd = os.open(data_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        os.ftruncate(dfd, F.DATA_OFFSET)
        lfd = os.open(log_path + ".tmp", os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        hdr = _LOG_HDR.pack(_LOG_MAGIC, 1, F.BLOCK, self.virtual_size, gen)
        hdr += struct.pack("<I", F.crc32(hdr))
        os.write(lfd, hdr + bytes(_LOG_HDR_SIZE - len(hdr)))
        if self._fsync and sync:
            os.fsync(dfd)
            os.fsync(lfd)
        os.rename(log_path + ".tmp", log_path)
        if sync:
            self._sync_dir()
        self._set_files(gen, dfd, lfd)
        self.next_pblock = 0
        self._log_size = _LOG_HDR_SIZE

    def _set_files(self, gen: int, dfd: int, lfd: int) -> None:
        self.generation = gen
        self.data_path, self.log_path = self._paths(gen)
        self.data_fd, self.log_fd = dfd, lfd

    def _sync_dir(self) -> None:
        if self._fsync:
            fsync_dir(self.path)

    def _open(self, gen: int) -> None:
        data_path, log_path = self._paths(gen)
        dfd = os.open(data_path, os.O_RDWR | os.O_CLOEXEC)
        lfd = os.open(log_path, os.O_RDWR | os.O_CLOEXEC)
        self._set_files(gen, dfd, lfd)
        data_blocks = max(0, (os.fstat(dfd).st_size - F.DATA_OFFSET + F.BLOCK - 1) >> F.BLOCK_SHIFT)
        log = os.pread(lfd, os.fstat(lfd).st_size, 0)
        pos, seq, top = _LOG_HDR_SIZE, 0, 0
        committed = pos  # end of the last COMMIT record: everything before it was acknowledged by a flush
        batch: list[tuple[int, int, int, int]] = []
        while pos + _REC_SIZE <= len(log):
            rec = self._parse_rec(log, pos, seq)
            if rec is None:
                break
            kind, count, vb, pb = rec
            seq += 1
            pos += _REC_SIZE
            if kind != REC_COMMIT:
                batch.append(rec)
                continue
            if count != len(batch):
                raise UpperCorrupt(f"{self.log_path}: commit record at {pos - _REC_SIZE} covers {count} records, "
                                   f"log holds {len(batch)}")
            for kind, count, vb, pb in batch:
                if kind == REC_MAP:
                    top = max(top, pb + count)
                    self._set_map(vb, count, pb)
                else:
                    self._set_map(vb, count, ZEROED)
            batch.clear()
            committed = pos
        # a bad record followed by a valid commit is damage, not a torn tail: refuse rather than lose flushed data
        for later in range(pos + _REC_SIZE, len(log) - _REC_SIZE + 1, _REC_SIZE):
            body = log[later : later + _REC.size]
            (crc,) = struct.unpack_from("<I", log, later + _REC.size)
            if F.crc32(body) == crc and _REC.unpack(body)[0] == REC_COMMIT and _REC.unpack(body)[4] > seq:
                raise UpperCorrupt(f"{self.log_path}: damaged record at offset {pos} before committed records")
        seq -= len(batch)  # records of an unfinished flush are dropped with the torn tail
        pos = committed
        if pos != len(log):  # torn tail: drop it so new records follow the last committed one
            os.ftruncate(lfd, pos)
        if top > data_blocks:
            raise UpperCorrupt(f"{self.log_path}: maps block {top - 1} but {self.data_path} has {data_blocks}")
        self._seq = seq
        self._log_size = pos
        self.next_pblock = data_blocks

    def _parse_rec(self, log: bytes, pos: int, seq: int) -> tuple[int, int, int, int] | None:
        body = log[pos : pos + _REC.size]
        (crc,) = struct.unpack_from("<I", log, pos + _REC.size)
        if F.crc32(body) != crc:
            return None
        kind, count, vb, pb, s = _REC.unpack(body)
        if s != seq:
            return None
        if kind == REC_COMMIT:
            return kind, count, vb, pb
        if kind not in (REC_MAP, REC_ZERO) or count == 0 or vb + count > self.nblocks:
            return None
        return kind, count, vb, pb

    # -- map -----------------------------------------------------------------------------------------------
    def _set_map(self, vb: int, count: int, value: int) -> None:
        """Map blocks [vb, vb+count) to pblocks value.. (value >= 0) or to ZEROED/ABSENT."""
        end = vb + count
        b = vb
        while b < end:
            ci = b >> CHUNK_SHIFT
            base = ci << CHUNK_SHIFT
            ce = min(end, base + CHUNK)
            arr = self._chunks.get(ci)
            if arr is None:
                arr = np.full(CHUNK, ABSENT, np.int32)
            if value >= 0:
                arr[b - base : ce - base] = np.arange(value + (b - vb), value + (ce - vb), dtype=np.int32)
            else:
                arr[b - base : ce - base] = value
            self._chunks[ci] = arr  # published after it is filled
            b = ce

    def runs(self, b0: int, b1: int) -> list[tuple[int, int, int]]:
        """Runs ``(vblock, count, state)`` covering blocks [b0, b1): state is ABSENT, ZEROED or the physical
        block of ``vblock`` (the run is contiguous in the data file)."""
        out: list[tuple[int, int, int]] = []
        b = b0
        chunks = self._chunks
        while b < b1:
            ci = b >> CHUNK_SHIFT
            base = ci << CHUNK_SHIFT
            ce = min(b1, base + CHUNK)
            arr = chunks.get(ci)
            if arr is None:
                pieces = [(b, ce - b, ABSENT)]
            elif ce - b == 1:
                pieces = [(b, 1, int(arr[b - base]))]
            else:
                seg = arr[b - base : ce - base]
                prev, nxt = seg[:-1], seg[1:]
                cont = ((prev >= 0) & (nxt == prev + 1)) | ((prev < 0) & (nxt == prev))
                cuts = (np.flatnonzero(~cont) + 1).tolist()
                starts = [0] + cuts
                ends = cuts + [len(seg)]
                vals = seg[starts].tolist()
                pieces = [(b + s, e - s, v) for s, e, v in zip(starts, ends, vals)]
            for vb, n, st in pieces:
                if out:
                    pvb, pn, pst = out[-1]
                    if (pst < 0 and pst == st) or (pst >= 0 and st == pst + pn):
                        out[-1] = (pvb, pn + n, pst)
                        continue
                out.append((vb, n, st))
            b = ce
        return out

    def touches(self, b0: int, b1: int) -> bool:
        """False when no block in [b0, b1) has ever been written or zeroed here (the fast read path)."""
        chunks = self._chunks
        if not chunks:
            return False
        c0, c1 = b0 >> CHUNK_SHIFT, (b1 - 1) >> CHUNK_SHIFT
        if c0 == c1:
            return c0 in chunks
        return any(c in chunks for c in range(c0, c1 + 1))

    def all_runs(self) -> Iterator[tuple[int, int, int]]:
        """Every written or zeroed run, in virtual order (ABSENT runs omitted)."""
        for ci in sorted(self._chunks):
            base = ci << CHUNK_SHIFT
            for vb, n, st in self.runs(base, min(base + CHUNK, self.nblocks)):
                if st != ABSENT:
                    yield vb, n, st

    def dirty_bitmap(self) -> np.ndarray:
        """Packed bitmap (numpy uint8, little bit order), one bit per 4 KiB block written or zeroed here."""
        bits = np.zeros(self.nblocks, bool)
        for ci, arr in self._chunks.items():
            base = ci << CHUNK_SHIFT
            n = min(CHUNK, self.nblocks - base)
            bits[base : base + n] = arr[:n] != ABSENT
        return np.packbits(bits, bitorder="little")

    @property
    def empty(self) -> bool:
        return not self._chunks

    # -- data ----------------------------------------------------------------------------------------------
    def read_pblocks(self, pblock: int, skip: int, length: int) -> bytes:
        """``length`` bytes starting ``skip`` bytes into physical block ``pblock``."""
        pos = F.DATA_OFFSET + (pblock << F.BLOCK_SHIFT) + skip
        out = os.pread(self.data_fd, length, pos)
        if len(out) != length:
            raise UpperCorrupt(f"{self.data_path}: short read at {pos}")
        return out

    def _pwrite(self, data: bytes | memoryview, pos: int) -> None:
        view = memoryview(data)
        while view:
            n = os.pwrite(self.data_fd, view, pos)
            view = view[n:]
            pos += n

    def write_blocks(self, vb: int, data: bytes | bytearray | memoryview) -> None:
        """Write whole blocks at virtual block ``vb`` (len(data) a multiple of 4 KiB). Caller serialises.

        Blocks already in the upper are overwritten in place, except that a write of >= 64 KiB over a range
        fragmented into several runs goes to a fresh contiguous allocation instead (one pwrite now, one pread
        for every later read of the range; the scattered old blocks become garbage, never reused)."""
        mv = memoryview(data)
        count = len(mv) >> F.BLOCK_SHIFT
        runs = self.runs(vb, vb + count)
        if len(runs) > 1 and count >= _DEFRAG_MIN_BLOCKS:
            runs = [(vb, count, ABSENT)]
        for rvb, n, st in runs:
            piece = mv[(rvb - vb) << F.BLOCK_SHIFT : (rvb - vb + n) << F.BLOCK_SHIFT]
            if st >= 0:
                self._pwrite(piece, F.DATA_OFFSET + (st << F.BLOCK_SHIFT))
            else:
                pb = self.next_pblock
                if pb + n >= _MAX_PBLOCKS:
                    raise UpperFull(f"{self.data_path}: upper data file full (8 TiB of allocations); seal it")
                self.next_pblock += n
                self._pwrite(piece, F.DATA_OFFSET + (pb << F.BLOCK_SHIFT))
                self._set_map(rvb, n, pb)
                self._record(REC_MAP, n, rvb, pb)

    def zero_blocks(self, vb: int, count: int) -> None:
        """Mark blocks zeroed (trim / write-zeroes): they read as zeros and shadow the layers below."""
        if count <= 0:
            return
        self._set_map(vb, count, ZEROED)
        self._record(REC_ZERO, count, vb, 0)

    def _record(self, kind: int, count: int, vb: int, pb: int) -> None:
        self._pending += _pack_rec(kind, count, vb, pb, self._seq)
        self._seq += 1

    @property
    def pending_bytes(self) -> int:
        """Size of the log records waiting for a flush (the image flushes on its own past a threshold)."""
        return len(self._pending)

    def flush(self) -> None:
        """Make every completed write durable: data first, then the records that map it."""
        self.commit(self.take_pending())

    def take_pending(self) -> bytes:
        """Detach the records of the writes completed so far, closed by a commit record (under the caller's
        write lock)."""
        if not self._pending:
            return b""
        n = len(self._pending) // _REC_SIZE
        self._pending += _pack_rec(REC_COMMIT, n, 0, 0, self._seq)
        self._seq += 1
        pending = bytes(self._pending)
        self._pending.clear()
        return pending

    def commit(self, pending: bytes) -> None:
        """Make durable the data and then the records from ``take_pending`` (may run outside the write lock,
        serialised with other commits by the caller)."""
        if self._closed:
            return
        if self._fsync:
            os.fdatasync(self.data_fd)
        if pending:
            view = memoryview(pending)
            pos = self._log_size
            while view:
                n = os.pwrite(self.log_fd, view, pos)
                view = view[n:]
                pos += n
            self._log_size = pos
            if self._fsync:
                os.fdatasync(self.log_fd)

    # -- lifecycle -----------------------------------------------------------------------------------------
    def reset(self, stack: Sequence[str] | None = None, *, keep_files: bool = False,
              sync: bool = True) -> "Upper":
        """Start the next generation: a fresh, empty upper in the same directory (used after a seal), sitting
        on ``stack`` (layer digests, recorded in the same commit).

        The old files are unlinked; this object keeps its descriptors open so reads already in flight finish.
        ``keep_files`` (a freeze, sealed later): the old data and log files are renamed ``frozen-data.N`` /
        ``frozen-log.N`` instead, out of the generation scheme, so this object can still be sealed (its
        ``data_path`` follows the rename); ``remove_files()`` deletes them once sealed.
        ``sync`` False: no fsync at all (a freeze inside a paused VM's capture: under heavy writes each fsync
        waits for an ext4 journal commit); the next ``set_stack`` or flush makes the new generation durable.
        Returns the new ``Upper``."""
        new = object.__new__(Upper)
        new.path, new.virtual_size, new.nblocks, new._fsync = self.path, self.virtual_size, self.nblocks, self._fsync
        new._chunks, new._pending, new._seq, new._closed = {}, bytearray(), 0, False
        new._create(self.generation + 1, stack, sync=sync)
        doomed = [self._stack_path(self.generation)]
        if keep_files:
            frozen_data = os.path.join(self.path, f"frozen-data.{self.generation}")
            frozen_log = os.path.join(self.path, f"frozen-log.{self.generation}")
            os.rename(self.data_path, frozen_data)
            os.rename(self.log_path, frozen_log)
            self.data_path, self.log_path = frozen_data, frozen_log
        else:
            doomed += [self.data_path, self.log_path]
        for p in doomed:
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass
        if sync:
            new._sync_dir()
        return new

    def remove_files(self) -> None:
        """Unlink this (retired) upper's files; open descriptors stay valid for reads in flight."""
        for p in (self.data_path, self.log_path):
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass

    def abandon(self) -> None:
        """Drop the upper without flushing (what kill -9 does): close descriptors, lose pending records."""
        self._pending.clear()
        self._close_fds()

    def _close_fds(self) -> None:
        if not self._closed:
            self._closed = True
            for fd in (self.data_fd, self.log_fd):
                if fd >= 0:
                    os.close(fd)

    def close(self) -> None:
        """Flush and close."""
        if not self._closed:
            self.flush()
            self._close_fds()

    def __del__(self) -> None:  # retired uppers (after a seal) close when the last in-flight read drops them
        try:
            self._close_fds()
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"Upper({self.path!r}, gen={self.generation}, blocks={self.next_pblock})"
