"""Write a ``newc`` cpio archive (the initramfs format the Linux kernel unpacks) from a directory.

Why hand-written: the archive must contain a ``/dev/console`` character device (the kernel opens it for the
initramfs' init before any devtmpfs is mounted), which ``cpio -o`` can only take from a real device node on
disk (needs mknod in the build directory), and it should be reproducible (owner root, mtime 0, sorted
entries) so the same inputs give the same bytes. The format is 110 ASCII header bytes per entry.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import BinaryIO

__all__ = ["CharDevice", "write_newc"]


class CharDevice:
    """An extra character-device entry (``path`` inside the archive, e.g. ``dev/console``)."""

    def __init__(self, path: str, major: int, minor: int, mode: int = 0o600) -> None:
        self.path, self.major, self.minor, self.mode = path, major, minor, mode


def _entry(out: BinaryIO, ino: int, name: str, mode: int, data: bytes = b"", rdev: tuple[int, int] = (0, 0)) -> None:
    encoded = name.encode() + b"\0"
    fields = [ino, mode, 0, 0, 2 if stat.S_ISDIR(mode) else 1, 0, len(data), 0, 0, rdev[0], rdev[1], len(encoded), 0]
    header = b"070701" + b"".join(b"%08X" % f for f in fields)
    out.write(header + encoded)
    out.write(b"\0" * (-(len(header) + len(encoded)) % 4))
    out.write(data)
    out.write(b"\0" * (-len(data) % 4))


def write_newc(root: Path, out: BinaryIO, extra: Iterable[CharDevice] = ()) -> None:
    """Archive everything under ``root`` (dirs, regular files with their mode bits, symlinks) plus ``extra``."""
    ino = 1
    entries: list[Path] = sorted(root.rglob("*"), key=lambda p: p.relative_to(root).as_posix())
    for path in entries:
        rel = path.relative_to(root).as_posix()
        st = path.lstat()
        perm = stat.S_IMODE(st.st_mode)
        if stat.S_ISLNK(st.st_mode):
            _entry(out, ino, rel, stat.S_IFLNK | 0o777, os.readlink(path).encode())
        elif stat.S_ISDIR(st.st_mode):
            _entry(out, ino, rel, stat.S_IFDIR | perm)
        elif stat.S_ISREG(st.st_mode):
            _entry(out, ino, rel, stat.S_IFREG | perm, path.read_bytes())
        else:
            raise ValueError(f"unsupported file type in initramfs tree: {path}")
        ino += 1
    for dev in extra:
        _entry(out, ino, dev.path, stat.S_IFCHR | dev.mode, rdev=(dev.major, dev.minor))
        ino += 1
    _entry(out, ino, "TRAILER!!!", 0)
