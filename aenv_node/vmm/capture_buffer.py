"""Pre-faulted memory that a capture copies a paused guest's dirty pages into.

Why: while a live snapshot copies dirty pages the guest is stopped, so that copy is the guest-visible
pause. Measured here for 306 MiB of dirty pages: `process_vm_readv` into fresh anonymous memory 244 ms,
into a sparse file 160-780 ms (page allocation and ext4 block allocation dominate), into memory that is
already faulted in 62-79 ms: a plain memcpy. So the node keeps a few buffers of guest-memory size faulted
in (transparent huge pages where the host allows) and lends one to each capture; the dirty pages are
written to disk from the buffer after the guest runs again. A capture that finds no free buffer, or more
dirty pages than a buffer holds, falls back to writing a sparse diff file while paused: slower, never
wrong.

The trade-off is resident memory: `count x size` bytes held by the node process for its lifetime (the
config's `snapshot.capture_buffer_mib` and `snapshot.capture_buffers`).

`CaptureBuffer` methods block (faulting in hundreds of MiB): call them through `trio.to_thread`.
"""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio

__all__ = ["CaptureBuffer", "CaptureBufferPool"]

_MADV_HUGEPAGE = 14
_MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault the range in, writable, in one call


class CaptureBuffer:
    """`size` bytes of anonymous memory, faulted in at construction. `view` is a writable memoryview and
    `address` its address in this process (for `process_vm_readv`)."""

    def __init__(self, size: int) -> None:
        if size <= 0 or size % mmap.PAGESIZE:
            raise ValueError(f"capture buffer size must be a positive multiple of {mmap.PAGESIZE}, got {size}")
        self.size = size
        self._map = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        for advice in (_MADV_HUGEPAGE, _MADV_POPULATE_WRITE):
            try:
                self._map.madvise(advice)
            except OSError:
                if advice == _MADV_POPULATE_WRITE:  # older kernels: touch every page instead
                    for off in range(0, size, mmap.PAGESIZE):
                        self._map[off] = 0
        self.view = memoryview(self._map)
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self._map))

    def close(self) -> None:
        self.view.release()
        # ctypes.c_char.from_buffer holds an export of the map until garbage collected; closing can wait
        try:
            self._map.close()
        except BufferError:
            pass


class CaptureBufferPool:
    """Up to `count` buffers of `size` bytes, made on first use and kept. `borrow()` never waits: it yields
    None when every buffer is lent (the capture then takes its slower path)."""

    def __init__(self, size: int, count: int) -> None:
        self.size = size
        self.count = count if size > 0 else 0
        self._free: list[CaptureBuffer] = []
        self._made = 0

    async def warm(self) -> None:
        """Make every buffer now (node start-up) instead of in the first captures."""
        while self._made < self.count:
            self._made += 1
            try:
                self._free.append(await trio.to_thread.run_sync(CaptureBuffer, self.size))
            except BaseException:
                self._made -= 1
                raise

    @asynccontextmanager
    async def borrow(self) -> AsyncIterator[CaptureBuffer | None]:
        buf: CaptureBuffer | None = None
        if self._free:
            buf = self._free.pop()
        elif self._made < self.count:
            self._made += 1
            try:
                buf = await trio.to_thread.run_sync(CaptureBuffer, self.size)
            except BaseException:
                self._made -= 1
                raise
        try:
            yield buf
        finally:
            if buf is not None:
                self._free.append(buf)

    def close(self) -> None:
        for buf in self._free:
            buf.close()
        self._free.clear()
