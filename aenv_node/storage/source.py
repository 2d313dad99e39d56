"""Random-access byte sources that layer readers read from.

A layer file may live on local disk (``FileSource``) or be fetched on demand from a repository through the local
cache (which implements the same protocol).  The layer reader only ever calls ``pread`` on its source, so the
same reader works over both; that is why this is a tiny Protocol and not a file object.
"""

from __future__ import annotations

import os
import threading
from typing import Protocol, runtime_checkable

__all__ = ["RandomAccessSource", "FileSource", "BytesSource"]


@runtime_checkable
class RandomAccessSource(Protocol):
    """A read-only, fixed-size byte string readable at any offset.

    ``pread`` returns exactly ``length`` bytes when ``offset + length <= size``; a short result means the source
    is truncated (readers turn that into ``LayerCorrupt``).  Implementations must be safe to call from several
    OS threads at once.
    """

    size: int

    def pread(self, offset: int, length: int) -> bytes: ...


class FileSource:
    """A local file read with ``os.pread`` (thread-safe: no shared file position)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        self.size = os.fstat(self._fd).st_size
        self._lock = threading.Lock()

    def fileno(self) -> int:
        """The open descriptor (used for zero-copy paths such as reflink and copy_file_range)."""
        return self._fd

    def pread(self, offset: int, length: int) -> bytes:
        if length <= 0:
            return b""
        return os.pread(self._fd, length, offset)

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def __del__(self) -> None:  # a layer dropped by an image closes when the last reader lets go of it
        try:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
        except Exception:
            pass

    def __enter__(self) -> "FileSource":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"FileSource({self.path!r}, size={self.size})"


class BytesSource:
    """An in-memory source (tests, and layers small enough to hold in RAM)."""

    def __init__(self, data: bytes) -> None:
        self._data = bytes(data)
        self.size = len(self._data)

    def pread(self, offset: int, length: int) -> bytes:
        if length <= 0 or offset >= self.size:
            return b""
        return self._data[offset : offset + length]
