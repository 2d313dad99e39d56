"""Linux inotify through ctypes, read asynchronously on Trio.

Why hand-written: the standard library has no inotify binding, the PyPI ones
are compiled extensions (not allowed on the guest's tools drive) or pull in
threads and polling, and the kernel interface is three syscalls plus a
fixed-layout record. This module offers exactly what ``WatchDir`` needs:
watch a directory (optionally its whole tree, adding watches for directories
created later, as E2B's fsnotify fork does) and yield events with paths.
"""

from __future__ import annotations

import errno
import os
import struct
from dataclasses import dataclass
from typing import Any

import trio

IN_MODIFY = 0x00000002
IN_ATTRIB = 0x00000004
IN_CLOSE_WRITE = 0x00000008
IN_MOVED_FROM = 0x00000040
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_DELETE = 0x00000200
IN_DELETE_SELF = 0x00000400
IN_MOVE_SELF = 0x00000800
IN_Q_OVERFLOW = 0x00004000
IN_IGNORED = 0x00008000
IN_ONLYDIR = 0x01000000
IN_ISDIR = 0x40000000
IN_NONBLOCK = 0o4000
IN_CLOEXEC = 0o2000000

WATCH_MASK = (IN_MODIFY | IN_ATTRIB | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE
              | IN_DELETE | IN_DELETE_SELF | IN_MOVE_SELF)

_HEADER = struct.Struct("iIII")

_libc: Any = None


def _lib() -> Any:
    """libc through ctypes, loaded on first use (ctypes costs start-up time)."""
    global _libc
    if _libc is None:
        import ctypes
        import ctypes.util

        try:
            lib = ctypes.CDLL("libc.so.6", use_errno=True)
        except OSError:  # not glibc: ask the (slow) library search
            lib = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        lib.inotify_init1.argtypes = [ctypes.c_int]
        lib.inotify_init1.restype = ctypes.c_int
        lib.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        lib.inotify_add_watch.restype = ctypes.c_int
        lib.inotify_rm_watch.argtypes = [ctypes.c_int, ctypes.c_int]
        lib.inotify_rm_watch.restype = ctypes.c_int
        _libc = lib
    return _libc


def _errno() -> int:
    import ctypes

    return ctypes.get_errno()


@dataclass(frozen=True)
class Event:
    path: str  # absolute path of the entry the event is about
    mask: int

    @property
    def is_dir(self) -> bool:
        return bool(self.mask & IN_ISDIR)


class Inotify:
    """One inotify instance; close it (or use ``with``) to release the fd."""

    def __init__(self) -> None:
        fd = _lib().inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if fd < 0:
            err = _errno()
            raise OSError(err, f"inotify_init1: {os.strerror(err)}")
        self.fd = fd
        self._paths: dict[int, str] = {}
        self._recursive_roots: set[str] = set()
        self._root = ""  # the first path watched

    def __enter__(self) -> "Inotify":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            trio.lowlevel.notify_closing(fd)
            os.close(fd)

    def add_watch(self, path: str, recursive: bool = False) -> None:
        wd = _lib().inotify_add_watch(self.fd, os.fsencode(path), WATCH_MASK)
        if wd < 0:
            err = _errno()
            raise OSError(err, f"inotify_add_watch {path}: {os.strerror(err)}", path)
        self._paths[wd] = path
        if not self._root:
            self._root = path
        if recursive:
            self._recursive_roots.add(path)
            for root, dirs, _files in os.walk(path):
                for d in dirs:
                    sub = os.path.join(root, d)
                    if os.path.islink(sub):
                        continue
                    self._add_quiet(sub)

    def _add_quiet(self, path: str) -> None:
        wd = _lib().inotify_add_watch(self.fd, os.fsencode(path), WATCH_MASK | IN_ONLYDIR)
        if wd >= 0:
            self._paths[wd] = path

    def _under_recursive(self, path: str) -> bool:
        return any(path == r or path.startswith(r.rstrip("/") + "/") for r in self._recursive_roots)

    async def read(self) -> list[Event]:
        """Wait for the next batch of events (cancel-safe); OSError on overflow."""
        while True:
            await trio.lowlevel.wait_readable(self.fd)
            try:
                data = os.read(self.fd, 64 * 1024)
            except BlockingIOError:
                continue
            events = self._parse(data)
            if events:
                return events

    def _parse(self, data: bytes) -> list[Event]:
        events: list[Event] = []
        offset = 0
        while offset + _HEADER.size <= len(data):
            wd, mask, _cookie, length = _HEADER.unpack_from(data, offset)
            raw_name = data[offset + _HEADER.size: offset + _HEADER.size + length]
            offset += _HEADER.size + length
            if mask & IN_Q_OVERFLOW:
                raise OSError(errno.EOVERFLOW, "inotify event queue overflowed")
            base = self._paths.get(wd)
            if mask & IN_IGNORED:
                self._paths.pop(wd, None)
                continue
            if base is None:
                continue
            name = os.fsdecode(raw_name.rstrip(b"\0"))
            path = os.path.join(base, name) if name else base
            if name == "" and base != self._root:
                # A sub-directory's own deletion/move: its parent reported it.
                continue
            events.append(Event(path, mask))
            if (mask & (IN_CREATE | IN_MOVED_TO)) and (mask & IN_ISDIR) and self._under_recursive(base):
                self._add_quiet(path)
                # Entries made before the new watch existed are reported as created.
                for root, dirs, files in os.walk(path):
                    for d in dirs:
                        self._add_quiet(os.path.join(root, d))
                        events.append(Event(os.path.join(root, d), IN_CREATE | IN_ISDIR))
                    for f in files:
                        events.append(Event(os.path.join(root, f), IN_CREATE))
        return events
