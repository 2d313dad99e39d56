"""A ublk server: presents a ``BlockDevice`` as the kernel block device ``/dev/ublkbN`` (Linux ublk_drv).

This is the production path for Firecracker on hosts whose kernel has ublk (CONFIG_BLK_DEV_UBLK; we use the
ioctl-encoded command numbers of current kernels; tested with Debian's 6.12): the VMM opens a real block
device, and every I/O the kernel queues on it is handed to this process through io_uring passthrough commands.

Why hand-written: the reference server (ublksrv, C) and its Rust/Go ports are libraries for their own
languages; there is no maintained Python ublk server. The protocol (include/uapi/linux/ublk_cmd.h) is small:
- control, on ``/dev/ublk-control`` through an SQE128 ring: ADD_DEV (kernel allocates ``/dev/ublkcN``),
  SET_PARAMS (size, block sizes, discard), START_DEV (creates ``/dev/ublkbN`` once every tag is fetched),
  STOP_DEV, DEL_DEV;
- I/O, on ``/dev/ublkcN`` through one ring per queue owned by one OS thread: FETCH_REQ for every tag, then
  per completed fetch read the ``ublksrv_io_desc`` (op, sectors) from the descriptor array mmapped from the
  char device, do the operation on the tag's buffer, and COMMIT_AND_FETCH_REQ the result.

Shape (structured concurrency): ``serve_ublk(device)`` adds and starts the device and runs the queue thread
in a nursery; on exit it stops the device (STOP_DEV while the queue still serves, so in-flight I/O drains),
stops and joins the queue thread (closing its ring cancels the outstanding fetches), closes the char
device and deletes the device (DEL_DEV). ``queues`` hardware queues (the kernel spreads I/O over them by the
submitting CPU), each with ``queue_depth`` tags, its own ring, descriptor array and buffers, served by its own
thread; a queue that fails ends the whole device (its ``async with`` raises), never another device. So does a
device the kernel ends while we serve it (every fetch completes with ABORT: a STOP_DEV from outside, the driver
going away): the body is cancelled and ``UblkError`` says which device ended, so the sandbox on that disk is
stopped and recorded in error with that reason, and no other sandbox notices.

Tested only inside a QEMU TCG guest whose kernel has ublk_drv (Debian's 6.12 cloud kernel; the 6.1 cloud
kernel has CONFIG_BLK_DEV_UBLK unset), see tests/storage/frontends/test_ublk_guest.py.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import struct
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio

from ..blockdev import BlockDevice
from ._nursery import open_service_nursery
from .errors import UblkError, UblkUnavailable
from .io_uring import OP_URING_CMD, Ring

__all__ = ["UblkServer", "serve_ublk", "stop_device", "CONTROL_PATH"]

log = logging.getLogger(__name__)

CONTROL_PATH = "/dev/ublk-control"


def _iowr(nr: int, size: int) -> int:
    return (3 << 30) | (size << 16) | (ord("u") << 8) | nr


# control commands (ioctl-encoded, struct ublksrv_ctrl_cmd is 32 bytes)
U_CMD_GET_DEV_INFO = _iowr(0x02, 32)
U_CMD_ADD_DEV = _iowr(0x04, 32)
U_CMD_DEL_DEV = _iowr(0x05, 32)
U_CMD_START_DEV = _iowr(0x06, 32)
U_CMD_STOP_DEV = _iowr(0x07, 32)
U_CMD_SET_PARAMS = _iowr(0x08, 32)
# I/O commands (struct ublksrv_io_cmd is 16 bytes)
U_IO_FETCH_REQ = _iowr(0x20, 16)
U_IO_COMMIT_AND_FETCH_REQ = _iowr(0x21, 16)

IO_RES_OK = 0
IO_RES_ABORT = -errno.ENODEV

F_CMD_IOCTL_ENCODE = 1 << 6

OP_READ = 0
OP_WRITE = 1
OP_FLUSH = 2
OP_DISCARD = 3
OP_WRITE_SAME = 4
OP_WRITE_ZEROES = 5
IO_F_FUA = 1 << 13

ATTR_VOLATILE_CACHE = 1 << 2
ATTR_FUA = 1 << 3
PARAM_TYPE_BASIC = 1 << 0
PARAM_TYPE_DISCARD = 1 << 1

CMD_BUF_OFFSET = 0
MAX_QUEUE_DEPTH = 4096
MAX_QUEUES = 64
_IO_DESC = struct.Struct("<IIQQ")  # op_flags, nr_sectors, start_sector, addr
_IO_CMD = struct.Struct("<HHiQ")  # q_id, tag, result, addr
_CTRL_CMD = struct.Struct("<IHHQQQ")  # dev_id, queue_id, len, addr, data[2]
_DEV_INFO = struct.Struct("<HHHHIIiIQQQQQ")  # 64 bytes
_PARAMS = struct.Struct("<II" + "IBBBBIIQQ" + "IIIIHH" + "4x")  # len, types, basic (32), discard (20), pad

_PAGE = mmap.PAGESIZE


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _addr(buf: mmap.mmap | bytearray) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def _wait_for(path: str, timeout: float) -> None:
    """Wait for a device node (devtmpfs creates it; without udev there is nothing else to wait for)."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise UblkError(f"{path} did not appear within {timeout}s (is devtmpfs mounted on /dev?)")
        time.sleep(0.005)


def _open_control(control_path: str) -> int:
    try:
        return os.open(control_path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError as exc:
        raise UblkUnavailable(f"{control_path} does not exist: the kernel has no ublk_drv "
                              "(CONFIG_BLK_DEV_UBLK) or the module is not loaded") from exc


def _control_command(ring: Ring, ctrl_fd: int, cmd_op: int, dev_id: int, *, buf: bytearray | None = None,
                     data0: int = 0) -> int:
    """One control command for ``dev_id`` through ``ring`` (SQE128) on the open ``/dev/ublk-control`` ``ctrl_fd``;
    its result, or ``UblkError``. The caller keeps it to one command in flight on ``ring``."""
    addr = _addr(buf) if buf is not None else 0
    length = len(buf) if buf is not None else 0
    cmd = _CTRL_CMD.pack(dev_id & 0xFFFFFFFF, 0xFFFF, length, addr, data0, 0)
    ring.prep(OP_URING_CMD, ctrl_fd, off=cmd_op, user_data=cmd_op, cmd=cmd)
    while True:  # submit (once), then wait; an interrupted wait just waits again
        ring.submit(wait=1)
        done = ring.completions()
        if done:
            (_ud, res, _flags), = done  # one command in flight at a time
            if res < 0:
                raise UblkError(f"ublk control command {cmd_op & 0xFF:#x} failed: {os.strerror(-res)}", res)
            return res


def stop_device(dev_id: int, control_path: str = CONTROL_PATH) -> None:
    """STOP_DEV for the ublk device ``dev_id`` from outside its server, through a control ring of this call's own
    (blocking; root needed).

    Why from outside: a crash-safety reconcile will reap the ublk devices a crashed node left behind (their server
    is gone, nobody else will end them), and tests use it to simulate the kernel ending a device under a live
    server (that server's ``serve_ublk`` then ends with ``UblkError``, see ``UblkServer.serve_queue``).
    Raises ``UblkUnavailable`` where the kernel has no ublk, ``UblkError`` when the kernel refuses (no such
    device: ENODEV).
    """
    fd = _open_control(control_path)
    try:
        ring = Ring(4, sqe128=True)
        try:
            _control_command(ring, fd, U_CMD_STOP_DEV, dev_id)
        finally:
            ring.close()
    finally:
        os.close(fd)


class UblkServer:
    """One ublk device serving one ``BlockDevice``; use ``serve_ublk``."""

    def __init__(
        self,
        device: BlockDevice,
        *,
        queues: int = 1,
        queue_depth: int = 64,
        max_io_bytes: int = 512 * 1024,
        control_path: str = CONTROL_PATH,
    ) -> None:
        if device.size % 512:
            raise UblkError(f"device size {device.size} is not a multiple of 512 bytes")
        if not 1 <= queue_depth <= MAX_QUEUE_DEPTH:
            raise ValueError(f"queue_depth must be in 1..{MAX_QUEUE_DEPTH}")
        if not 1 <= queues <= MAX_QUEUES:
            raise ValueError(f"queues must be in 1..{MAX_QUEUES}")
        self.device = device
        self.queues = queues
        self.queue_depth = queue_depth
        self.max_io_bytes = max_io_bytes
        self.control_path = control_path
        self.dev_id = -1
        self._ctrl: Ring | None = None
        self._ctrl_fd = -1
        self._ctrl_lock = threading.Lock()
        self._cdev_fd = -1
        self._descs: list[mmap.mmap] = []
        self._bufs: list[mmap.mmap] = []
        self._fetched = [threading.Event() for _ in range(queues)]
        self._stopping = False
        self._ending = False  # we asked for STOP_DEV: aborted fetches from now on are expected
        self._started = False
        self._ios = [0] * queues  # one counter per queue thread (no shared += across threads)

    @property
    def ios(self) -> int:
        """Requests served so far, over all queues."""
        return sum(self._ios)

    @property
    def block_path(self) -> str:
        return f"/dev/ublkb{self.dev_id}"

    @property
    def char_path(self) -> str:
        return f"/dev/ublkc{self.dev_id}"

    # --- control (blocking) ------------------------------------------------------------------------------
    def _control(self, cmd_op: int, *, buf: bytearray | None = None, data0: int = 0, dev_id: int | None = None) -> int:
        assert self._ctrl is not None
        with self._ctrl_lock:  # one command in flight at a time on the server's control ring
            return _control_command(self._ctrl, self._ctrl_fd, cmd_op, self.dev_id if dev_id is None else dev_id,
                                    buf=buf, data0=data0)

    def add(self) -> None:
        """ADD_DEV + SET_PARAMS, open and map the char device (blocking)."""
        self._ctrl_fd = _open_control(self.control_path)
        self._ctrl = Ring(4, sqe128=True)
        info = bytearray(_DEV_INFO.pack(self.queues, self.queue_depth, 0, 0, self.max_io_bytes, 0xFFFFFFFF, os.getpid(), 0,
                                        F_CMD_IOCTL_ENCODE, 0, 0, 0, 0))
        self._control(U_CMD_ADD_DEV, buf=info, dev_id=-1)
        fields = _DEV_INFO.unpack(info)
        self.dev_id = fields[5]
        if not 1 <= fields[0] <= self.queues:
            raise UblkError(f"ublk gave {fields[0]} queues, {self.queues} were asked for")
        if fields[0] < self.queues:  # the kernel caps hardware queues at the number of CPUs
            log.info("ublk device %d: %d queues (of %d asked for: this host has fewer CPUs)",
                     self.dev_id, fields[0], self.queues)
            self.queues = fields[0]
            self._fetched = self._fetched[: self.queues]
            self._ios = self._ios[: self.queues]
        self.max_io_bytes = fields[4] or self.max_io_bytes
        size = self.device.size
        sectors = self.max_io_bytes >> 9
        big = (1 << 30) >> 9
        params = bytearray(_PARAMS.pack(
            _PARAMS.size, PARAM_TYPE_BASIC | PARAM_TYPE_DISCARD,
            ATTR_VOLATILE_CACHE | ATTR_FUA, 9, 12, 12, 9, sectors, 0, size >> 9, 0,
            0, 4096, big, big, 1, 0,
        ))
        self._control(U_CMD_SET_PARAMS, buf=params)
        _wait_for(self.char_path, 5.0)
        self._cdev_fd = os.open(self.char_path, os.O_RDWR | os.O_CLOEXEC)
        # each queue's descriptor array is mapped at its own offset: q * (room for MAX_QUEUE_DEPTH descriptors)
        desc_len = _round_up(self.queue_depth * _IO_DESC.size, _PAGE)
        stride = _round_up(MAX_QUEUE_DEPTH * _IO_DESC.size, _PAGE)
        for q in range(self.queues):
            self._descs.append(mmap.mmap(self._cdev_fd, desc_len, mmap.MAP_SHARED, mmap.PROT_READ,
                                         offset=CMD_BUF_OFFSET + q * stride))
            self._bufs.append(mmap.mmap(-1, self.queue_depth * self.max_io_bytes))

    def start(self) -> None:
        """START_DEV once every queue thread has fetched every tag (blocking)."""
        for q, fetched in enumerate(self._fetched):
            if not fetched.wait(10):
                raise UblkError(f"ublk queue {q} did not fetch its tags")
        self._control(U_CMD_START_DEV, data0=os.getpid())
        self._started = True
        _wait_for(self.block_path, 5.0)  # devtmpfs may publish the node a moment after START_DEV returns

    def stop(self) -> None:
        """STOP_DEV (the queue keeps serving while the disk is removed), then tell the queue thread to end."""
        self._ending = True
        try:
            if self._started and self._ctrl is not None:
                self._control(U_CMD_STOP_DEV)
        except UblkError as exc:  # already stopped (the kernel ended it): nothing left to drain
            log.warning("ublk device %d: STOP_DEV failed: %s", self.dev_id, exc)
        finally:
            self._stopping = True

    def delete(self) -> None:
        """Close the char device and DEL_DEV (after the queue thread returned)."""
        self._stopping = True
        for d in self._descs:
            d.close()
        self._descs = []
        if self._cdev_fd >= 0:
            os.close(self._cdev_fd)
            self._cdev_fd = -1
        try:
            if self.dev_id >= 0 and self._ctrl is not None:
                self._control(U_CMD_DEL_DEV)
        except UblkError as exc:
            if exc.errno != -errno.ENODEV:  # ENODEV: deleted already, by whoever ended it
                raise
        finally:
            if self._ctrl is not None:
                self._ctrl.close()
                self._ctrl = None
            if self._ctrl_fd >= 0:
                os.close(self._ctrl_fd)
                self._ctrl_fd = -1
            for b in self._bufs:
                try:
                    b.close()
                except BufferError:
                    pass
            self._bufs = []

    # --- the queue (runs in its own OS thread) -----------------------------------------------------------
    def serve_queue(self, q: int = 0) -> None:
        bufs, descs = self._bufs[q], self._descs[q]
        base = _addr(bufs)
        maxio = self.max_io_bytes
        ring = Ring(self.queue_depth)
        fd = self._cdev_fd
        try:
            for tag in range(self.queue_depth):
                ring.prep(OP_URING_CMD, fd, off=U_IO_FETCH_REQ, user_data=tag,
                          cmd=_IO_CMD.pack(q, tag, 0, base + tag * maxio))
            ring.submit()
            self._fetched[q].set()
            active = self.queue_depth
            while active and not self._stopping:
                ring.submit(wait=1, timeout=0.2)
                for tag, res, _flags in ring.completions():
                    if res == IO_RES_OK:
                        result = self._do_io(descs, tag, bufs, maxio)
                        self._ios[q] += 1
                        ring.prep(OP_URING_CMD, fd, off=U_IO_COMMIT_AND_FETCH_REQ, user_data=tag,
                                  cmd=_IO_CMD.pack(q, tag, result, base + tag * maxio))
                    else:
                        if res != IO_RES_ABORT:
                            log.warning("ublk queue %d: fetch for tag %d completed with %d", q, tag, res)
                        active -= 1
        finally:
            ring.close()  # cancels any outstanding fetch
        if not active and not self._ending:
            raise UblkError(f"ublk device {self.dev_id} ended under its server (queue {q}: the kernel aborted "
                            "every request; was it stopped from outside?): its disk is gone", IO_RES_ABORT)

    def _do_io(self, descs: mmap.mmap, tag: int, bufs: mmap.mmap, maxio: int) -> int:
        op_flags, nr_sectors, start_sector, _addr_ = _IO_DESC.unpack_from(descs, tag * _IO_DESC.size)
        op: int = op_flags & 0xFF
        offset: int = start_sector << 9
        length: int = nr_sectors << 9
        dev = self.device
        try:
            if op == OP_READ:
                if length > maxio:
                    return -errno.EINVAL
                start = tag * maxio
                bufs[start : start + length] = dev.pread(offset, length)
                return length
            if op == OP_WRITE:
                if length > maxio:
                    return -errno.EINVAL
                start = tag * maxio
                dev.pwrite(offset, bufs[start : start + length])
                if op_flags & IO_F_FUA:
                    dev.flush()
                return length
            if op == OP_FLUSH:
                dev.flush()
                return 0
            if op == OP_DISCARD:
                dev.trim(offset, length)
                return 0
            if op == OP_WRITE_ZEROES:
                dev.write_zeroes(offset, length)
                return 0
            return -errno.EOPNOTSUPP
        except ValueError as exc:
            log.warning("ublk op %d [%d,+%d) refused: %s", op, offset, length, exc)
            return -errno.EINVAL
        except OSError as exc:
            return -(exc.errno or errno.EIO)
        except Exception:  # noqa: BLE001
            log.exception("ublk op %d [%d,+%d) failed", op, offset, length)
            return -errno.EIO


@asynccontextmanager
async def serve_ublk(
    device: BlockDevice,
    *,
    queues: int = 1,
    queue_depth: int = 64,
    max_io_bytes: int = 512 * 1024,
    control_path: str = CONTROL_PATH,
) -> AsyncIterator[UblkServer]:
    """Serve ``device`` as ``/dev/ublkbN`` for the duration of the ``async with`` (root needed).

    Raises ``UblkUnavailable`` where the kernel has no ublk. The yielded server's ``block_path`` is the disk.
    """
    if not os.path.exists(control_path):
        raise UblkUnavailable(f"{control_path} does not exist: the kernel has no ublk_drv (CONFIG_BLK_DEV_UBLK)")
    srv = UblkServer(device, queues=queues, queue_depth=queue_depth, max_io_bytes=max_io_bytes,
                     control_path=control_path)
    try:
        await trio.to_thread.run_sync(srv.add)
        async with open_service_nursery() as nursery:
            for q in range(srv.queues):
                nursery.start_soon(_run_queue, srv, q)
            try:
                await trio.to_thread.run_sync(srv.start)
                yield srv
            finally:
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(srv.stop)
    finally:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(srv.delete)


async def _run_queue(srv: UblkServer, q: int) -> None:
    await trio.to_thread.run_sync(srv.serve_queue, q, abandon_on_cancel=False)
