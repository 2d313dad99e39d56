"""Memory-image files: sparse-aware copies, data ranges of sparse files, layering diffs over a base.

Guest memory images are mostly holes (a guest touches a fraction of its RAM), and diff captures are sparse
files holding only dirty pages at their own offsets. Both VMMs produce and consume the same layout (byte
offset in the file = offset in guest memory), so one set of helpers serves both:

* `copy_image` clones a file with a reflink (FICLONE) where the filesystem can, else copies only its data
  extents (SEEK_DATA/SEEK_HOLE) with copy_file_range, keeping holes as holes.
* `data_ranges` lists the data extents of a sparse file: the dirty ranges of a Firecracker Diff snapshot.
* `materialize_packed` = the same with the dirty pages in memory (a capture buffer), packed in range order.
* `materialize` = copy the base image, then patch each diff's ranges over it, oldest first. The storage
  layer does this for real (layers, reflinks, caches); this is the minimal correct version, used by tests
  and benchmarks and by `capture` of a restored QEMU VM.

All functions block: call them through `trio.to_thread.run_sync`.
"""

from __future__ import annotations

import errno
import fcntl
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from .memory import MemoryRange

_FICLONE = 0x40049409  # _IOW(0x94, 9, int)
_CHUNK = 8 << 20


def data_ranges(path: Path, *, granularity: int = 4096) -> tuple[MemoryRange, ...]:
    """The data extents of a (sparse) file, rounded out to `granularity`, merged when adjacent."""
    out: list[MemoryRange] = []
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        pos = 0
        while pos < size:
            try:
                start = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError as e:
                if e.errno == errno.ENXIO:  # no data after pos
                    break
                raise
            end = os.lseek(fd, start, os.SEEK_HOLE)
            s = start - start % granularity
            e_ = min(size, -(-end // granularity) * granularity)
            if out and out[-1].end >= s:
                prev = out.pop()
                out.append(MemoryRange(prev.offset, max(prev.end, e_) - prev.offset))
            else:
                out.append(MemoryRange(s, e_ - s))
            pos = end
    finally:
        os.close(fd)
    return tuple(out)


def _copy_range(src_fd: int, dst_fd: int, offset: int, length: int) -> None:
    done = 0
    while done < length:
        n = min(_CHUNK, length - done)
        try:
            copied = os.copy_file_range(src_fd, dst_fd, n, offset + done, offset + done)
        except OSError as e:
            if e.errno not in (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                raise
            copied = os.pwrite(dst_fd, os.pread(src_fd, n, offset + done), offset + done)
        if copied == 0:
            raise OSError(errno.EIO, f"short copy at offset {offset + done}")
        done += copied


def copy_image(src: Path, dst: Path) -> None:
    """Copy a memory image: reflink if possible, else its data extents only (holes stay holes)."""
    tmp = dst.with_name(dst.name + ".part")
    tmp.unlink(missing_ok=True)
    src_fd = os.open(src, os.O_RDONLY)
    try:
        dst_fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                fcntl.ioctl(dst_fd, _FICLONE, src_fd)
            except OSError:
                size = os.fstat(src_fd).st_size
                os.ftruncate(dst_fd, size)
                for r in data_ranges(src):
                    _copy_range(src_fd, dst_fd, r.offset, r.length)
        finally:
            os.close(dst_fd)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        os.close(src_fd)
    os.replace(tmp, dst)


def apply_ranges(target: Path, diff: Path, ranges: Iterable[MemoryRange]) -> None:
    """Copy `ranges` of `diff` over the same offsets of `target` (in place)."""
    src_fd = os.open(diff, os.O_RDONLY)
    try:
        dst_fd = os.open(target, os.O_WRONLY)
        try:
            for r in ranges:
                _copy_range(src_fd, dst_fd, r.offset, r.length)
        finally:
            os.close(dst_fd)
    finally:
        os.close(src_fd)


def _start(base: Path, dst: Path, in_place: bool) -> None:
    if in_place:  # base is consumed: it becomes dst (a rename, no copy)
        os.replace(base, dst)
    else:
        copy_image(base, dst)


def materialize(base: Path, diffs: Sequence[tuple[Path, Sequence[MemoryRange] | None]], dst: Path, *,
                in_place: bool = False) -> None:
    """dst = base with every diff laid over it, oldest first. Ranges None = the diff file's data extents.
    `in_place`: base itself becomes dst (renamed, then patched) instead of being copied."""
    _start(base, dst, in_place)
    for diff, ranges in diffs:
        apply_ranges(dst, diff, data_ranges(diff) if ranges is None else ranges)


def materialize_packed(base: Path, ranges: Sequence[MemoryRange], data: memoryview, dst: Path, *,
                       in_place: bool = False) -> None:
    """dst = base with `ranges` overwritten by `data` (their bytes back to back, in range order).
    `in_place`: base itself becomes dst (renamed, then patched) instead of being copied."""
    _start(base, dst, in_place)
    fd = os.open(dst, os.O_WRONLY)
    try:
        pos = 0
        for r in ranges:
            done = 0
            while done < r.length:
                n = min(_CHUNK, r.length - done)
                done += os.pwrite(fd, data[pos + done : pos + done + n], r.offset + done)
            pos += r.length
    finally:
        os.close(fd)
