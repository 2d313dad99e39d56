"""Import of a raw disk image (e.g. an ext4 filesystem image) as a base layer.

Sparse-aware: only the file's data segments (``SEEK_DATA``/``SEEK_HOLE``) are read, and all-zero blocks inside
them are dropped too, so a 10 GiB image holding 300 MiB of files costs a 300 MiB read and layer.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
from dataclasses import asdict
from typing import Iterator

from . import layer_format as F
from .layer import LAYER_SUFFIX, LayerInfo, LayerWriter

__all__ = ["import_raw", "import_raw_cached", "data_segments"]

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


def import_raw_cached(path: str | os.PathLike[str], dest_dir: str | os.PathLike[str], *, virtual_size: int,
                      cache_dir: str | os.PathLike[str]) -> LayerInfo:
    """``import_raw`` of an image that never changes under its name (a root filesystem cached by content
    hash), remembered in ``cache_dir``: the second import of the same image at the same virtual size, by any
    node sharing that directory, links (or, across filesystems, copies) the layer made by the first instead of
    reading the image again (a base template rebuilt for a new kit or VMM, every fresh node of a test run).

    The cache holds the layer file and its ``LayerInfo`` (JSON), under the image's name and the virtual size;
    both are written whole (temporary, then rename), so a cut import leaves nothing a later one would use."""
    src = os.fspath(path)
    key = f"{os.path.basename(src)}.{virtual_size}"
    cache, dest = os.fspath(cache_dir), os.fspath(dest_dir)
    cached_layer, cached_info = os.path.join(cache, key + ".layer"), os.path.join(cache, key + ".json")
    try:
        with open(cached_info) as f:
            fields = json.load(f)
        if os.stat(cached_layer).st_size == fields["file_size"]:
            final = os.path.join(dest, fields["digest"] + LAYER_SUFFIX)
            _link_or_copy(cached_layer, final)
            return LayerInfo(**{**fields, "path": final})
    except (OSError, ValueError, KeyError, TypeError):
        pass  # nothing usable cached: import, and remember it
    info = import_raw(src, dest, virtual_size=virtual_size)
    os.makedirs(cache, exist_ok=True)
    tmp = os.path.join(cache, f".{key}.{os.getpid()}.tmp")
    try:
        _link_or_copy(info.path, tmp)
        os.replace(tmp, cached_layer)
        with open(tmp, "w") as f:
            json.dump({k: v for k, v in asdict(info).items() if k != "path"}, f)
        os.replace(tmp, cached_info)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    return info


def _link_or_copy(src: str, dst: str) -> None:
    """``dst`` as a hard link to ``src`` (layer files are immutable), else a copy made whole before it appears."""
    if os.path.exists(dst):
        return  # content addressed: what is there is the same
    try:
        os.link(src, dst)
    except OSError:
        tmp = f"{dst}.{os.getpid()}.part"
        shutil.copyfile(src, tmp)
        os.replace(tmp, dst)
