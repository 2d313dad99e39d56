"""Sealing: a writable upper becomes an immutable layer without copying its data.

The upper's data file already has the layer's shape up to the end of the data area (4 KiB reserved at the
front, 4 KiB-aligned blocks after it), so sealing writes the header into the reserved space, appends the index
(built from the in-memory block map) and the trailer, fsyncs, and hard-links the file under its content
address.  The only pass over the data is a read through an mmap to compute the per-block checksums and the file's
sha256, both of which the format requires; no data byte is written again.  Blocks freed by trims stay in the
data area as unreferenced garbage; when they exceed ``max_garbage`` of the data file (a guest that trims a lot),
the seal copies the live blocks into a compact layer instead (through ``LayerWriter``).

If the layer directory is on another filesystem (no hard link possible), the finished file is copied with
``copy_file_range``/``sendfile`` (in the kernel, not through Python).
"""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
import secrets

import numpy as np

from . import layer_format as F
from .fileops import copy_range, fsync_dir
from .layer import LAYER_SUFFIX, LayerInfo, LayerWriter, write_layer_tail
from .upper import ZEROED, Upper

__all__ = ["seal_upper", "upper_extents"]


def upper_extents(upper: Upper) -> np.ndarray:
    """The upper's block map as a layer index (EXTENT_DTYPE), data offsets = physical block offsets."""
    rows = [(vb, n, st) for vb, n, st in upper.all_runs()]
    ext = np.zeros(len(rows), dtype=F.EXTENT_DTYPE)
    if rows:
        a = np.array(rows, dtype=np.int64)
        zeroed = a[:, 2] == ZEROED
        ext["voff"] = a[:, 0] << F.BLOCK_SHIFT
        ext["length"] = a[:, 1] << F.BLOCK_SHIFT
        ext["doff"] = np.where(zeroed, 0, a[:, 2] << F.BLOCK_SHIFT)
        ext["flags"] = zeroed.astype(np.uint32) * F.EXTENT_ZEROED
    return ext


def _checksum_and_hash(fd: int, length: int, hasher: "hashlib._Hash", flags: int) -> np.ndarray:
    """Checksum per 4 KiB block of the data area [4096, 4096+length), feeding the same bytes to ``hasher``."""
    if not length:
        return np.empty(0, dtype=F.CSUM_DTYPE)
    csum = F.data_checksum(flags)
    out: list[int] = []
    step = 16 << 20
    with mmap.mmap(fd, F.DATA_OFFSET + length, prot=mmap.PROT_READ) as mm:
        mv = memoryview(mm)
        try:
            B = F.BLOCK
            for pos in range(0, length, step):
                chunk = mv[F.DATA_OFFSET + pos : F.DATA_OFFSET + min(pos + step, length)]
                hasher.update(chunk)
                out += [csum(chunk[b : b + B]) for b in range(0, len(chunk), B)]
                chunk.release()
        finally:
            mv.release()
    return np.array(out, dtype=F.CSUM_DTYPE)


def seal_upper(upper: Upper, layers_dir: str | os.PathLike[str], *, max_garbage: float = 0.25,
               min_garbage_bytes: int = 1 << 20) -> LayerInfo:
    """Turn ``upper`` (flushed here) into the layer ``<digest>.layer`` in ``layers_dir``.

    The upper must not be written meanwhile (the image holds its write lock) and is left in place: the caller
    then ``reset()``s it.  If the process dies midway the upper is still intact and reopenable."""
    layers_dir = os.fspath(layers_dir)
    upper.flush()
    live = sum(n for _, n, st in upper.all_runs() if st >= 0)
    garbage = upper.next_pblock - live
    if garbage > 0 and garbage >= max_garbage * upper.next_pblock and garbage << F.BLOCK_SHIFT >= min_garbage_bytes:
        return _seal_by_copy(upper, layers_dir)
    fd = upper.data_fd
    data_length = upper.next_pblock << F.BLOCK_SHIFT
    os.ftruncate(fd, F.DATA_OFFSET + data_length)  # drop any index a crashed earlier seal appended
    flags = F.default_csum_flag()
    g = F.Geometry(flags, upper.virtual_size, F.BLOCK, 0, data_length=data_length, stream_length=data_length)
    header = F.pack_header(g)
    os.pwrite(fd, header, 0)
    hasher = hashlib.sha256(header)
    crcs = _checksum_and_hash(fd, data_length, hasher, flags)
    extents = upper_extents(upper)
    g = write_layer_tail(fd, hasher, g, extents, crcs)
    os.fsync(fd)
    digest = hasher.hexdigest()
    final = os.path.join(layers_dir, digest + LAYER_SUFFIX)
    try:
        os.link(upper.data_path, final)
    except FileExistsError:
        pass
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
            raise
        _copy_into(fd, g.file_size, layers_dir, final)
    fsync_dir(layers_dir)
    data_bytes = int(extents["length"][(extents["flags"] & F.EXTENT_ZEROED) == 0].sum()) if len(extents) else 0
    return LayerInfo(digest, final, g.file_size, upper.virtual_size, len(extents), data_bytes, False)


def _copy_into(src_fd: int, size: int, layers_dir: str, final: str) -> None:
    tmp = os.path.join(layers_dir, f".tmp-{secrets.token_hex(8)}{LAYER_SUFFIX}")
    dst = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        copy_range(src_fd, 0, size, dst, 0)
        os.fsync(dst)
    except BaseException:
        os.close(dst)
        os.unlink(tmp)
        raise
    os.close(dst)
    os.replace(tmp, final)


def _seal_by_copy(upper: Upper, layers_dir: str) -> LayerInfo:
    step = 256  # blocks per read
    with LayerWriter(layers_dir, upper.virtual_size) as w:
        for vb, n, st in upper.all_runs():
            if st == ZEROED:
                w.add_zeroed(vb << F.BLOCK_SHIFT, n << F.BLOCK_SHIFT)
                continue
            for i in range(0, n, step):
                m = min(step, n - i)
                w.add_data((vb + i) << F.BLOCK_SHIFT, upper.read_pblocks(st + i, 0, m << F.BLOCK_SHIFT))
        return w.finish()
