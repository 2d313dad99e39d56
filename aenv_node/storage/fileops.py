"""Small file-level primitives the storage code shares: in-kernel range copies, hole punching, directory fsync,
positioned writes that do not stop short.

Why hand-written: ``shutil`` copies whole files through user space; these keep bytes in the kernel
(``copy_file_range``, falling back to ``sendfile`` across filesystems where the kernel refuses the former).
"""

from __future__ import annotations

import ctypes
import errno
import os

__all__ = ["copy_range", "punch_hole", "fsync_dir", "pwrite_all"]

_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02
_CFR_FALLBACK = (errno.EXDEV, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOSYS, errno.EBADF)

_libc = ctypes.CDLL(None, use_errno=True)
_fallocate = _libc.fallocate
_fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong]


def copy_range(src: int, src_off: int, length: int, dst: int, dst_off: int) -> None:
    """Copy ``length`` bytes between two file descriptors inside the kernel."""
    try:
        while length:
            n = os.copy_file_range(src, dst, length, src_off, dst_off)
            if n <= 0:
                raise OSError(errno.EIO, f"copy_file_range made no progress at {src_off}")
            src_off += n
            dst_off += n
            length -= n
        return
    except OSError as e:
        if e.errno not in _CFR_FALLBACK:
            raise
    os.lseek(dst, dst_off, os.SEEK_SET)
    while length:
        n = os.sendfile(dst, src, src_off, length)
        if n <= 0:
            raise OSError(errno.EIO, f"sendfile made no progress at {src_off}")
        src_off += n
        length -= n


def punch_hole(fd: int, offset: int, length: int) -> bool:
    """Deallocate a range (reads back as zeros). False where the filesystem cannot."""
    rc: int = _fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, length)
    return rc == 0


def fsync_dir(path: str | os.PathLike[str]) -> None:
    fd = os.open(os.fspath(path), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    """``pwrite`` all of ``data`` at ``offset`` (a single call may write less)."""
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n
