"""A minimal io_uring ring over raw syscalls (ctypes), enough to drive ublk's IORING_OP_URING_CMD.

Why hand-written: ublk is driven exclusively through io_uring passthrough commands (URING_CMD with 80-byte
SQE128 payloads for control commands). The Python io_uring bindings on PyPI are either unmaintained or
wrap liburing via a compiled extension without URING_CMD/SQE128 support, and liburing itself is not a
dependency we want for ~150 lines of ring bookkeeping. This module knows nothing about ublk.

A ``Ring`` is owned by exactly one OS thread (ublk requires the thread that issued a queue's commands to
keep driving that queue's ring). Memory ordering: the rings are shared with the kernel through mmap; on
x86-64 (TSO), plain stores made in program order -- SQE contents, then the array slot, then the tail --
are observed in that order by the kernel, and a load of the CQ tail is followed by loads of the CQEs, which
is the acquire ordering io_uring needs. This module refuses to run elsewhere.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import struct

__all__ = ["Ring", "IoUringError", "OP_NOP", "OP_READ", "OP_WRITE", "OP_URING_CMD"]

_SYS_IO_URING_SETUP = 425
_SYS_IO_URING_ENTER = 426

OP_NOP = 0
OP_READ = 22
OP_WRITE = 23
OP_URING_CMD = 46

SETUP_SQE128 = 1 << 10
ENTER_GETEVENTS = 1 << 0
ENTER_EXT_ARG = 1 << 3
FEAT_SINGLE_MMAP = 1 << 0
FEAT_EXT_ARG = 1 << 8

_OFF_SQ_RING = 0
_OFF_CQ_RING = 0x8000000
_OFF_SQES = 0x10000000

_PARAMS = struct.Struct("<10I" + "7IIQ" + "8IQ")  # io_uring_params: 40 + sq_off 40 + cq_off 40 bytes
_CQE = struct.Struct("<QiI")
_SQE_HEAD = struct.Struct("<BBHiQQIIQHHi")  # opcode flags ioprio fd off/cmd_op addr len op_flags user_data ...
_EXT_ARG = struct.Struct("<QIIQ")  # sigmask, sigmask_sz, pad, ts pointer
_TIMESPEC = struct.Struct("<qq")

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class IoUringError(OSError):
    pass


def _check_platform() -> None:
    if platform.machine() not in ("x86_64", "AMD64"):
        raise IoUringError(0, "the ctypes io_uring ring relies on x86-64 memory ordering")


class Ring:
    """One io_uring instance: ``prep(...)`` fills the next SQE, ``submit(wait=n)`` enters the kernel,
    ``completions()`` drains the CQ ring. Not thread-safe by design (one owner thread)."""

    def __init__(self, entries: int, *, sqe128: bool = False) -> None:
        _check_platform()
        params = bytearray(_PARAMS.size)
        struct.pack_into("<I", params, 8, SETUP_SQE128 if sqe128 else 0)
        buf = (ctypes.c_char * len(params)).from_buffer(params)
        fd = _libc.syscall(_SYS_IO_URING_SETUP, ctypes.c_uint(entries), buf)
        if fd < 0:
            err = ctypes.get_errno()
            raise IoUringError(err, f"io_uring_setup: {os.strerror(err)}")
        self.fd = fd
        v = _PARAMS.unpack(params)
        self.sq_entries: int
        self.cq_entries: int
        self.sq_entries, self.cq_entries, _flags, _cpu, _idle, self.features = v[0:6]
        sq_head, sq_tail, sq_mask, _sq_ent, _sq_flags, _dropped, sq_array = v[10:17]
        cq_head, cq_tail, cq_mask, _cq_ent, _overflow, cq_cqes = v[19:25]
        self.sqe_size = 128 if sqe128 else 64
        try:
            if not self.features & FEAT_SINGLE_MMAP:
                raise IoUringError(0, "kernel without IORING_FEAT_SINGLE_MMAP (< 5.4) is not supported")
            ring_size = max(sq_array + self.sq_entries * 4, cq_cqes + self.cq_entries * _CQE.size)
            self._ring = mmap.mmap(fd, ring_size, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                                   mmap.PROT_READ | mmap.PROT_WRITE, offset=_OFF_SQ_RING)
            self._sqes = mmap.mmap(fd, self.sq_entries * self.sqe_size, mmap.MAP_SHARED,
                                   mmap.PROT_READ | mmap.PROT_WRITE, offset=_OFF_SQES)
        except BaseException:
            os.close(fd)
            raise
        self._sq_head, self._sq_tail, self._sq_array = sq_head, sq_tail, sq_array
        self._cq_head, self._cq_tail, self._cqes = cq_head, cq_tail, cq_cqes
        self._sq_mask = struct.unpack_from("<I", self._ring, sq_mask)[0]
        self._cq_mask = struct.unpack_from("<I", self._ring, cq_mask)[0]
        self._tail: int = struct.unpack_from("<I", self._ring, sq_tail)[0]
        self._pending = 0
        self._ext = bytearray(_EXT_ARG.size)
        self._ts = bytearray(_TIMESPEC.size)
        self._ts_buf = (ctypes.c_char * len(self._ts)).from_buffer(self._ts)
        self._ext_buf = (ctypes.c_char * len(self._ext)).from_buffer(self._ext)

    def close(self) -> None:
        if self.fd >= 0:
            self._sqes.close()
            self._ring.close()
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "Ring":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def space(self) -> int:
        head: int = struct.unpack_from("<I", self._ring, self._sq_head)[0]
        return self.sq_entries - ((self._tail - head) & 0xFFFFFFFF)

    def prep(self, opcode: int, fd: int, *, off: int = 0, addr: int = 0, length: int = 0, op_flags: int = 0,
             user_data: int = 0, cmd: bytes = b"") -> None:
        """Queue one SQE (``off`` doubles as ``cmd_op`` for URING_CMD; ``cmd`` goes to the command area)."""
        if self.space <= 0:
            raise IoUringError(0, "submission queue full; submit first")
        idx = self._tail & self._sq_mask
        base = idx * self.sqe_size
        sqes = self._sqes
        sqes[base : base + self.sqe_size] = bytes(self.sqe_size)
        _SQE_HEAD.pack_into(sqes, base, opcode, 0, 0, fd, off, addr, length, op_flags, user_data, 0, 0, 0)
        if cmd:
            if len(cmd) > self.sqe_size - 48:
                raise ValueError("command payload too large for this SQE size")
            sqes[base + 48 : base + 48 + len(cmd)] = cmd
        struct.pack_into("<I", self._ring, self._sq_array + 4 * idx, idx)
        self._tail = (self._tail + 1) & 0xFFFFFFFF
        struct.pack_into("<I", self._ring, self._sq_tail, self._tail)
        self._pending += 1

    def submit(self, wait: int = 0, timeout: float | None = None) -> int:
        """Submit queued SQEs and wait for at least ``wait`` completions (at most ``timeout`` seconds).
        Returns the number submitted. A timeout or signal just returns (check ``completions()``)."""
        flags = ENTER_GETEVENTS if wait else 0
        arg, argsz = None, 0
        if wait and timeout is not None:
            sec = int(timeout)
            _TIMESPEC.pack_into(self._ts, 0, sec, int((timeout - sec) * 1e9))
            _EXT_ARG.pack_into(self._ext, 0, 0, 0, 0, ctypes.addressof(self._ts_buf))
            arg, argsz = self._ext_buf, _EXT_ARG.size
            flags |= ENTER_EXT_ARG
        to_submit = self._pending
        rc: int = _libc.syscall(_SYS_IO_URING_ENTER, ctypes.c_int(self.fd), ctypes.c_uint(to_submit),
                           ctypes.c_uint(wait), ctypes.c_uint(flags), arg, ctypes.c_size_t(argsz))
        if rc < 0:
            err = ctypes.get_errno()
            if err in (4, 62, 16):  # EINTR, ETIME, EBUSY (CQ full: reap and retry)
                return 0
            raise IoUringError(err, f"io_uring_enter: {os.strerror(err)}")
        self._pending -= rc
        return rc

    def completions(self) -> list[tuple[int, int, int]]:
        """Reap every available CQE: (user_data, res, flags) in completion order. The CQ head is advanced
        before returning, so no entry is seen twice however the caller consumes the list."""
        ring = self._ring
        head = struct.unpack_from("<I", ring, self._cq_head)[0]
        out: list[tuple[int, int, int]] = []
        while True:
            tail = struct.unpack_from("<I", ring, self._cq_tail)[0]
            if head == tail:
                break
            while head != tail:
                out.append(_CQE.unpack_from(ring, self._cqes + (head & self._cq_mask) * _CQE.size))
                head = (head + 1) & 0xFFFFFFFF
            struct.pack_into("<I", ring, self._cq_head, head)
        return out
