"""The block-device interface every frontend (NBD, FUSE, ublk) serves, and a flat-file reference device.

Frontends code against ``BlockDevice`` only; the layered ``Image`` implements it for real sandboxes and
``FlatFileDevice`` (a plain file) implements it as the oracle frontends and tests compare against.

Contract (all offsets and lengths in bytes, any alignment; ``offset + length <= size``):
- ``pread`` returns exactly ``length`` bytes; never-written and trimmed ranges read as zeros.
- ``pwrite`` / ``trim`` / ``write_zeroes`` are visible to every later ``pread`` from any thread immediately.
- ``flush`` makes every write acknowledged before it durable: after it returns the data survives kill -9 of the
  serving process (and, for the file-backed implementations, a host crash as far as fsync guarantees).
- All methods are safe to call concurrently from several OS threads.
Out-of-range requests raise ``OutOfRange`` (a ``ValueError``), which frontends map to EINVAL/EIO.
"""

from __future__ import annotations

import os
import threading
from typing import Protocol, runtime_checkable

from .errors import OutOfRange, ReadOnlyDevice
from .fileops import punch_hole

__all__ = ["BlockDevice", "FlatFileDevice", "check_range"]


@runtime_checkable
class BlockDevice(Protocol):
    size: int  # bytes

    def pread(self, offset: int, length: int) -> bytes: ...

    def pwrite(self, offset: int, data: bytes) -> None: ...

    def trim(self, offset: int, length: int) -> None: ...  # reads back as zeros

    def write_zeroes(self, offset: int, length: int) -> None: ...

    def flush(self) -> None: ...  # durable: after return, survives kill -9


def check_range(size: int, offset: int, length: int) -> None:
    """Raise ``OutOfRange`` unless ``[offset, offset+length)`` lies inside a device of ``size`` bytes."""
    if offset < 0 or length < 0 or offset + length > size:
        raise OutOfRange(f"range [{offset}, {offset + length}) outside device of {size} bytes")


class FlatFileDevice:
    """A block device backed by one plain file of fixed size (the reference implementation).

    Created sparse if missing.  ``trim`` punches a hole (falls back to writing zeros), ``flush`` is ``fsync``.
    """

    def __init__(self, path: str | os.PathLike[str], size: int | None = None, *, read_only: bool = False) -> None:
        self.path = os.fspath(path)
        self.read_only = read_only
        flags = (os.O_RDONLY if read_only else os.O_RDWR | os.O_CREAT) | os.O_CLOEXEC
        self._fd = os.open(self.path, flags, 0o644)
        cur = os.fstat(self._fd).st_size
        if size is None:
            size = cur
        elif cur != size:
            if read_only:
                raise OutOfRange(f"{self.path}: file is {cur} bytes, expected {size}")
            os.ftruncate(self._fd, size)
        self.size = size
        self._closed = False
        self._lock = threading.Lock()  # only guards close(); os.pread/os.pwrite are atomic per call

    def fileno(self) -> int:
        return self._fd

    def pread(self, offset: int, length: int) -> bytes:
        check_range(self.size, offset, length)
        out = os.pread(self._fd, length, offset)
        if len(out) < length:  # a file shorter than size (should not happen) reads as zeros past its end
            out += bytes(length - len(out))
        return out

    def _writable(self) -> None:
        if self.read_only:
            raise ReadOnlyDevice(f"{self.path} is open read-only")

    def pwrite(self, offset: int, data: bytes) -> None:
        self._writable()
        check_range(self.size, offset, len(data))
        view = memoryview(data)
        while view:
            n = os.pwrite(self._fd, view, offset)
            view = view[n:]
            offset += n

    def write_zeroes(self, offset: int, length: int) -> None:
        self._writable()
        check_range(self.size, offset, length)
        if length and not punch_hole(self._fd, offset, length):
            self.pwrite(offset, bytes(length))

    def trim(self, offset: int, length: int) -> None:
        self.write_zeroes(offset, length)

    def flush(self) -> None:
        self._writable()
        os.fsync(self._fd)

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                os.close(self._fd)

    def __enter__(self) -> "FlatFileDevice":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
