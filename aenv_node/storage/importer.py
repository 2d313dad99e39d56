"""Import of a raw disk image (e.g. an ext4 filesystem image) as a base layer.

Sparse-aware: only the file's data segments (``SEEK_DATA``/``SEEK_HOLE``) are read, and all-zero blocks inside
them are dropped too, so a 10 GiB image holding 300 MiB of files costs a 300 MiB read and layer.
"""

from __future__ import annotations

import errno
import os
from typing import Iterator

from . import layer_format as F
from .layer import LayerInfo, LayerWriter

__all__ = ["import_raw", "data_segments"]

_CHUNK = 4 << 20


def data_segments(fd: int, size: int) -> Iterator[tuple[int, int]]:
    """(offset, end) of the regions of the file that hold data, 4 KiB-aligned outward."""
    pos = 0
    while pos < size:
        try:
            start = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError as e:
            if e.errno == errno.ENXIO:  # only a hole remains
                return
            if e.errno in (errno.EINVAL, errno.EOPNOTSUPP):  # no sparse support: everything is data
                yield pos, size
                return
            raise
        end = os.lseek(fd, start, os.SEEK_HOLE)
        a = start & ~(F.BLOCK - 1)
        b = min(F.round_up(end), F.round_up(size))
        yield a, b
        pos = b


def import_raw(path: str | os.PathLike[str], dest_dir: str | os.PathLike[str], *,
               compression: str | None = None, virtual_size: int | None = None) -> LayerInfo:
    """Write a base layer holding the contents of the raw image at ``path`` (size rounded up to 4 KiB unless
    ``virtual_size`` is given)."""
    fd = os.open(os.fspath(path), os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        vsize = virtual_size if virtual_size is not None else F.round_up(size)
        if vsize < size:
            raise ValueError(f"virtual size {vsize} is smaller than the image ({size} bytes)")
        with LayerWriter(dest_dir, vsize, compression=compression, zero_blocks="omit") as w:
            for a, b in data_segments(fd, size):
                for pos in range(a, b, _CHUNK):
                    n = min(_CHUNK, b - pos)
                    data = os.pread(fd, n, pos)
                    if len(data) < n:  # last partial block of a file whose size is not 4 KiB-aligned
                        data += bytes(n - len(data))
                    w.add_data(pos, data)
            return w.finish()
    finally:
        os.close(fd)
