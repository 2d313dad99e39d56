"""A FUSE filesystem that exports each ``BlockDevice`` as one regular file (a VMM's raw drive path).

Where neither ublk nor a VMM-side NBD client exists (Firecracker only opens files), the image is presented as
``MOUNTPOINT/NAME``: reads/writes become ``pread``/``pwrite``, ``fsync`` becomes ``flush``, and
``fallocate(PUNCH_HOLE)`` / ``fallocate(ZERO_RANGE)`` become ``trim`` / ``write_zeroes``.

Why hand-written over ``/dev/fuse`` instead of pyfuse3 (which builds here, 3.5.0): pyfuse3 has no
``fallocate`` handler, so a guest's discard could never reach ``trim``; it keeps one global session per
process (the node serves many sandboxes); and it dispatches every request on the calling Trio loop, where
each device call would need a ``to_thread`` hop. The subset of the kernel protocol a flat directory of
fixed-size files needs is small (INIT, LOOKUP, GETATTR, SETATTR, OPEN/RELEASE, READ, WRITE, FSYNC,
FALLOCATE, OPENDIR/READDIR, STATFS, FORGET), see ``fuse_protocol``.

Shape (structured concurrency): ``mount_fuse(devices, mountpoint)`` opens /dev/fuse, mounts it with
mount(2) (the node runs as root; no fusermount3 helper is needed), and starts ``threads`` OS threads that each
read requests from the non-blocking /dev/fuse fd and answer them inline (``poll`` only when idle, on the fuse
fd and a stop pipe). On exit it always lazily unmounts (``umount2(MNT_DETACH)``, i.e. ``umount -l``), stops
and joins the threads, and closes /dev/fuse, which aborts the connection so a VMM still holding the file gets
errors rather than a hang.

Files are opened with FOPEN_DIRECT_IO by default: the kernel does not keep a second page cache of the image
(the guest has its own), every read reaches the device, and O_DIRECT opens work.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import select
import stat
import threading
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import trio

from ..blockdev import BlockDevice
from ..errors import ReadOnlyDevice
from . import fuse_protocol as F
from ._nursery import open_service_nursery
from .errors import FuseMountError

__all__ = ["FuseExport", "mount_fuse"]

log = logging.getLogger(__name__)

ROOT_INO = 1
MAX_IO = 1024 * 1024  # max_write and max read per request (max_pages = 256)
_BUFSIZE = MAX_IO + 64 * 1024
_ATTR_TTL = 1.0
_MS_NOSUID = 2
_MS_NODEV = 4
_MNT_DETACH = 2

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


@dataclass(frozen=True, slots=True)
class _File:
    ino: int
    name: str
    device: BlockDevice
    size: int


class _Reply(Exception):
    """Raised inside a handler to answer the request with ``-errno``."""

    def __init__(self, err: int) -> None:
        self.err = err


def _is_mountpoint(path: str) -> str | None:
    """The filesystem type mounted exactly at ``path``, or None."""
    real = os.path.realpath(path)
    with open("/proc/self/mounts") as f:
        found = None
        for line in f:
            parts = line.split()
            if len(parts) >= 3 and parts[1].replace("\\040", " ") == real:
                found = parts[2]
        return found


def _is_dead(path: str) -> bool:
    """True when the FUSE mount at ``path`` has lost its server (ENOTCONN)."""
    try:
        os.listdir(path)  # OPENDIR always reaches the server (a stat may be answered from cached attributes)
    except OSError as exc:
        return exc.errno == errno.ENOTCONN
    return False


def _check_name(name: str) -> None:
    if not name or name in (".", "..") or "/" in name or "\0" in name or len(name.encode()) > 255:
        raise ValueError(f"invalid file name for a FUSE export: {name!r}")


class FuseExport:
    """A mounted FUSE filesystem with one regular file per device; use ``mount_fuse`` to create one."""

    def __init__(
        self,
        devices: Mapping[str, BlockDevice],
        mountpoint: str | os.PathLike[str],
        *,
        threads: int = 2,
        direct_io: bool = True,
        uid: int | None = None,
        gid: int | None = None,
        mode: int = 0o600,
        allow_other: bool = True,
        fsname: str = "aenv",
    ) -> None:
        self.mountpoint = Path(mountpoint)
        self.threads = threads
        self.direct_io = direct_io
        self.uid = os.geteuid() if uid is None else uid
        self.gid = os.getegid() if gid is None else gid
        self.mode = mode
        self.allow_other = allow_other
        self.fsname = fsname
        self._lock = threading.Lock()
        self._by_name: dict[str, _File] = {}
        self._by_ino: dict[int, _File] = {}
        self._handles: dict[int, _File] = {}
        self._next_ino = ROOT_INO + 1
        self._next_fh = 1
        self._mtime = int(time.time())
        self._fd = -1
        self._stop_r = -1
        self._stop_w = -1
        self._stopping = False
        self._mounted = False
        self.initialized = threading.Event()
        self.kernel_minor = 0
        for name, dev in devices.items():
            self.add(name, dev)

    # --- public face -------------------------------------------------------------------------------------
    def path(self, name: str) -> Path:
        """The file a VMM opens for the device exported as ``name``."""
        if name not in self._by_name:
            raise KeyError(name)
        return self.mountpoint / name

    def add(self, name: str, device: BlockDevice) -> Path:
        """Export another device (visible within the attribute TTL, about a second, to cached lookups)."""
        _check_name(name)
        with self._lock:
            if name in self._by_name:
                raise ValueError(f"{name!r} is already exported")
            f = _File(self._next_ino, name, device, device.size)
            self._next_ino += 1
            self._by_name[name] = f
            self._by_ino[f.ino] = f
        return self.mountpoint / name

    def remove(self, name: str) -> None:
        """Stop exporting ``name``; files already open keep working until closed."""
        with self._lock:
            f = self._by_name.pop(name)
            self._by_ino.pop(f.ino, None)

    @property
    def names(self) -> list[str]:
        return sorted(self._by_name)

    # --- mount / unmount (blocking; called through trio.to_thread) -------------------------------------
    def _mount(self) -> None:
        mp = os.fspath(self.mountpoint)
        if not os.path.isdir(mp):
            raise FuseMountError(f"mountpoint {mp} is not a directory")
        existing = _is_mountpoint(mp)
        if existing is not None:
            if existing == f"fuse.{self.fsname}" and _is_dead(mp):  # left behind by a crashed process of ours
                _libc.umount2(os.fsencode(mp), _MNT_DETACH)
            else:
                raise FuseMountError(f"{mp} already has a {existing} filesystem mounted on it")
        try:
            self._fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError as exc:
            raise FuseMountError(f"cannot open /dev/fuse: {exc.strerror} (is the fuse module present?)") from exc
        self._stop_r, self._stop_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        opts = f"fd={self._fd},rootmode=40000,user_id={self.uid},group_id={self.gid},default_permissions"
        if self.allow_other:
            opts += ",allow_other"
        rc = _libc.mount(os.fsencode(self.fsname), os.fsencode(mp), f"fuse.{self.fsname}".encode(),
                         _MS_NOSUID | _MS_NODEV, opts.encode())
        if rc != 0:
            err = ctypes.get_errno()
            self._close()
            raise FuseMountError(f"mount of FUSE at {mp} failed: {os.strerror(err)} (root or CAP_SYS_ADMIN needed)")
        self._mounted = True

    def _unmount(self) -> None:
        if self._mounted:
            self._mounted = False
            if _libc.umount2(os.fsencode(os.fspath(self.mountpoint)), _MNT_DETACH) != 0:
                err = ctypes.get_errno()
                if err not in (errno.EINVAL, errno.ENOENT):
                    log.warning("umount -l %s failed: %s", self.mountpoint, os.strerror(err))

    def _stop(self) -> None:
        self._stopping = True
        if self._stop_w >= 0:
            os.write(self._stop_w, b"x")  # stays readable: wakes every thread's poll

    def _close(self) -> None:
        for attr in ("_fd", "_stop_r", "_stop_w"):
            fd = getattr(self, attr)
            if fd >= 0:
                os.close(fd)
                setattr(self, attr, -1)

    # --- request loop (one per thread) -------------------------------------------------------------------
    def _serve(self) -> None:
        fd = self._fd
        buf = bytearray(_BUFSIZE)
        view = memoryview(buf)
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        poller.register(self._stop_r, select.POLLIN)
        readv = os.readv
        bufs = [buf]
        while not self._stopping:
            try:
                n = readv(fd, bufs)
            except BlockingIOError:
                poller.poll()
                continue
            except InterruptedError:
                continue
            except OSError as exc:
                if exc.errno == errno.ENOENT:  # the request was interrupted before we read it
                    continue
                if exc.errno == errno.ENODEV:  # unmounted and the connection is gone
                    return
                raise
            try:
                self._dispatch(fd, view, n)
            except Exception:  # noqa: BLE001 -- a bug in one request must not kill the export
                log.exception("FUSE request handling failed")

    def _send(self, fd: int, unique: int, payload: bytes | list[bytes] = b"", err: int = 0) -> None:
        parts = payload if isinstance(payload, list) else [payload]
        total = F.OUT_HEADER.size + sum(len(p) for p in parts)
        try:
            os.writev(fd, [F.OUT_HEADER.pack(total, -err, unique), *parts])
        except OSError as exc:
            if exc.errno not in (errno.ENOENT, errno.ENODEV):  # ENOENT: request was interrupted meanwhile
                raise

    def _attr(self, f: _File | None) -> bytes:
        t = self._mtime
        if f is None:
            return F.ATTR.pack(ROOT_INO, 0, 0, t, t, t, 0, 0, 0, stat.S_IFDIR | 0o755, 2, self.uid, self.gid, 0,
                               4096, 0)
        return F.ATTR.pack(f.ino, f.size, (f.size + 511) // 512, t, t, t, 0, 0, 0, stat.S_IFREG | self.mode, 1,
                           self.uid, self.gid, 0, 4096, 0)

    def _node(self, ino: int) -> _File | None:
        if ino == ROOT_INO:
            return None
        f = self._by_ino.get(ino)
        if f is None:
            for h in list(self._handles.values()):  # removed from the directory but still open
                if h.ino == ino:
                    return h
            raise _Reply(errno.ENOENT)
        return f

    def _attr_out(self, f: _File | None) -> bytes:
        return F.ATTR_OUT_HEAD.pack(int(_ATTR_TTL), 0, 0) + self._attr(f)

    def _dispatch(self, fd: int, view: memoryview, n: int) -> None:
        length, opcode, unique, nodeid, _uid, _gid, _pid, _ext, _pad = F.IN_HEADER.unpack_from(view, 0)
        body = F.IN_HEADER.size
        try:
            if opcode == F.READ:
                fh, offset, size = F.READ_IN.unpack_from(view, body)[:3]
                h = self._handles.get(fh)
                if h is None:
                    raise _Reply(errno.EBADF)
                if offset >= h.size:
                    self._send(fd, unique)
                    return
                size = min(size, h.size - offset)
                self._send(fd, unique, h.device.pread(offset, size))
                return
            if opcode == F.WRITE:
                fh, offset, size = F.WRITE_IN.unpack_from(view, body)[:3]
                h = self._handles.get(fh)
                if h is None:
                    raise _Reply(errno.EBADF)
                if offset + size > h.size:
                    raise _Reply(errno.ENOSPC)  # the file has the device's fixed size
                start = body + F.WRITE_IN.size
                h.device.pwrite(offset, bytes(view[start : start + size]))
                self._send(fd, unique, F.WRITE_OUT.pack(size, 0))
                return
            if opcode == F.FORGET or opcode == F.BATCH_FORGET or opcode == F.INTERRUPT:
                return  # no reply; inodes are not reference counted, requests are not interruptible
            if opcode == F.INIT:
                self._init(fd, view, unique)
                return
            if opcode == F.LOOKUP:
                if nodeid != ROOT_INO:
                    raise _Reply(errno.ENOTDIR)
                name = bytes(view[body:length]).split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
                f = self._by_name.get(name)
                if f is None:
                    raise _Reply(errno.ENOENT)
                self._send(fd, unique, F.ENTRY_OUT_HEAD.pack(f.ino, 0, int(_ATTR_TTL), int(_ATTR_TTL), 0, 0)
                           + self._attr(f))
                return
            if opcode == F.GETATTR:
                self._send(fd, unique, self._attr_out(self._node(nodeid)))
                return
            if opcode == F.SETATTR:
                self._setattr(fd, view, body, unique, nodeid)
                return
            if opcode == F.OPEN:
                f = self._node(nodeid)
                if f is None:
                    raise _Reply(errno.EISDIR)
                with self._lock:
                    fh = self._next_fh
                    self._next_fh += 1
                    self._handles[fh] = f
                flags = F.FOPEN_DIRECT_IO | F.FOPEN_PARALLEL_DIRECT_WRITES if self.direct_io else F.FOPEN_KEEP_CACHE
                self._send(fd, unique, F.OPEN_OUT.pack(fh, flags, 0))
                return
            if opcode == F.RELEASE:
                (fh,) = F.RELEASE_IN.unpack_from(view, body)[:1]
                with self._lock:
                    self._handles.pop(fh, None)
                self._send(fd, unique)
                return
            if opcode == F.FSYNC:
                (fh,) = F.FSYNC_IN.unpack_from(view, body)[:1]
                h = self._handles.get(fh)
                if h is None:
                    raise _Reply(errno.EBADF)
                h.device.flush()
                self._send(fd, unique)
                return
            if opcode == F.FALLOCATE:
                self._fallocate(fd, view, body, unique)
                return
            if opcode == F.FLUSH or opcode == F.FSYNCDIR or opcode == F.RELEASEDIR:
                self._send(fd, unique)
                return
            if opcode == F.OPENDIR:
                if nodeid != ROOT_INO:
                    raise _Reply(errno.ENOTDIR)
                self._send(fd, unique, F.OPEN_OUT.pack(0, 0, 0))
                return
            if opcode == F.READDIR:
                _fh, offset, size = F.READ_IN.unpack_from(view, body)[:3]
                self._send(fd, unique, self._readdir(offset, size))
                return
            if opcode == F.STATFS:
                total = sum(f.size for f in self._by_name.values()) // 4096
                self._send(fd, unique, F.KSTATFS.pack(total, 0, 0, len(self._by_name), 0, 4096, 255, 4096, 0,
                                                      0, 0, 0, 0, 0, 0))
                return
            if opcode == F.DESTROY:
                self._send(fd, unique)
                return
            raise _Reply(errno.ENOSYS)  # GETXATTR, ACCESS, CREATE, ... : the kernel copes
        except _Reply as r:
            self._send(fd, unique, err=r.err)
        except ReadOnlyDevice:
            self._send(fd, unique, err=errno.EROFS)
        except ValueError as exc:  # OutOfRange and friends from the device
            log.warning("FUSE opcode %d refused: %s", opcode, exc)
            self._send(fd, unique, err=errno.EINVAL)
        except OSError as exc:
            log.warning("FUSE opcode %d failed: %r", opcode, exc)
            self._send(fd, unique, err=exc.errno or errno.EIO)
        except Exception as exc:  # noqa: BLE001
            log.exception("FUSE opcode %d failed", opcode)
            self._send(fd, unique, err=errno.EIO)
            del exc

    def _init(self, fd: int, view: memoryview, unique: int) -> None:
        major, minor, max_readahead, kflags = F.INIT_IN.unpack_from(view, F.IN_HEADER.size)
        if major != F.KERNEL_VERSION:
            log.error("FUSE kernel protocol %d.%d is not supported", major, minor)
            raise _Reply(errno.EPROTO)
        self.kernel_minor = minor
        want = F.ASYNC_READ | F.BIG_WRITES | F.ASYNC_DIO | F.PARALLEL_DIROPS | F.MAX_PAGES
        out = F.INIT_OUT.pack(
            F.KERNEL_VERSION, min(minor, F.KERNEL_MINOR_VERSION), max_readahead, kflags & want,
            64, 48, MAX_IO, 1, MAX_IO // 4096, 0, 0, *([0] * 7),
        )
        self._send(fd, unique, out)
        self.initialized.set()

    def _setattr(self, fd: int, view: memoryview, body: int, unique: int, nodeid: int) -> None:
        f = self._node(nodeid)
        valid, _pad, _fh, size, _lo, _a, _m, _c, _an, _mn, _cn, mode, _u4, uid, gid, _u5 = F.SETATTR_IN.unpack_from(
            view, body
        )
        if f is not None and valid & F.FATTR_SIZE and size != f.size:
            raise _Reply(errno.EPERM)  # the file mirrors a fixed-size device
        if valid & F.FATTR_MODE and stat.S_IMODE(mode) != (self.mode if f is not None else 0o755):
            raise _Reply(errno.EPERM)
        if valid & F.FATTR_UID and uid != self.uid or valid & F.FATTR_GID and gid != self.gid:
            raise _Reply(errno.EPERM)
        self._send(fd, unique, self._attr_out(f))  # time updates are accepted and ignored

    def _fallocate(self, fd: int, view: memoryview, body: int, unique: int) -> None:
        fh, offset, length, mode, _pad = F.FALLOCATE_IN.unpack_from(view, body)
        h = self._handles.get(fh)
        if h is None:
            raise _Reply(errno.EBADF)
        end = min(offset + length, h.size)
        if mode & F.FALLOC_FL_PUNCH_HOLE:
            if mode & ~(F.FALLOC_FL_PUNCH_HOLE | F.FALLOC_FL_KEEP_SIZE) or not mode & F.FALLOC_FL_KEEP_SIZE:
                raise _Reply(errno.EOPNOTSUPP)
            if offset < end:
                h.device.trim(offset, end - offset)
        elif mode & F.FALLOC_FL_ZERO_RANGE:
            if mode & ~(F.FALLOC_FL_ZERO_RANGE | F.FALLOC_FL_KEEP_SIZE):
                raise _Reply(errno.EOPNOTSUPP)
            if offset + length > h.size and not mode & F.FALLOC_FL_KEEP_SIZE:
                raise _Reply(errno.EFBIG)
            if offset < end:
                h.device.write_zeroes(offset, end - offset)
        elif mode & ~F.FALLOC_FL_KEEP_SIZE:
            raise _Reply(errno.EOPNOTSUPP)
        elif offset + length > h.size and not mode & F.FALLOC_FL_KEEP_SIZE:
            raise _Reply(errno.EFBIG)  # plain allocation inside the device is a no-op: it is all there
        self._send(fd, unique)

    def _readdir(self, offset: int, size: int) -> bytes:
        entries = [(ROOT_INO, ".", stat.S_IFDIR), (ROOT_INO, "..", stat.S_IFDIR)]
        entries += [(f.ino, f.name, stat.S_IFREG) for f in sorted(self._by_name.values(), key=lambda f: f.name)]
        out = bytearray()
        for i in range(offset, len(entries)):
            ino, name, kind = entries[i]
            raw = name.encode("utf-8", "surrogateescape")
            rec = F.DIRENT_HEAD.pack(ino, i + 1, len(raw), kind >> 12) + raw
            rec += bytes(-len(rec) % 8)
            if len(out) + len(rec) > size:
                break
            out += rec
        return bytes(out)


@asynccontextmanager
async def mount_fuse(
    devices: Mapping[str, BlockDevice],
    mountpoint: str | os.PathLike[str],
    *,
    threads: int = 2,
    direct_io: bool = True,
    uid: int | None = None,
    gid: int | None = None,
    mode: int = 0o600,
    allow_other: bool = True,
    init_timeout: float = 10.0,
) -> AsyncIterator[FuseExport]:
    """Mount a FUSE filesystem at ``mountpoint`` (an existing empty directory) exporting each device as the
    regular file ``mountpoint/name``, for the duration of the ``async with``. Always unmounts on exit."""
    if threads < 1:
        raise ValueError("threads must be >= 1")
    fs = FuseExport(devices, mountpoint, threads=threads, direct_io=direct_io, uid=uid, gid=gid, mode=mode,
                    allow_other=allow_other)
    limiter = trio.CapacityLimiter(threads)
    await trio.to_thread.run_sync(fs._mount)
    try:
        async with open_service_nursery() as nursery:
            for _ in range(threads):
                nursery.start_soon(_run_thread, fs, limiter)
            try:
                if not await trio.to_thread.run_sync(fs.initialized.wait, init_timeout):
                    raise FuseMountError(f"the kernel did not initialise the FUSE mount at {mountpoint}")
                yield fs
            finally:
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(fs._unmount)
                    fs._stop()
    finally:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(fs._unmount)  # after a failed start, too
        fs._close()


async def _run_thread(fs: FuseExport, limiter: trio.CapacityLimiter) -> None:
    await trio.to_thread.run_sync(fs._serve, limiter=limiter, abandon_on_cancel=False)
