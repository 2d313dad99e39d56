"""Quiescing the guest's filesystem for a capture: ``POST /quiesce`` and ``POST /thaw``.

A pause captures memory and disk at one instant, so the guest itself never loses a write; but the disk layer
it seals also stands alone (a compaction's, any reader of the repository's layers, a resume without its
memory), and there dirty page cache and an unreplayed ext4 journal are a torn filesystem: files written and
acknowledged before the pause but still in the guest's page cache are missing or empty (E2B #1104). So before
a pause's capture the node asks envd to ``sync()`` and freeze the root filesystem (``FIFREEZE``: ext4 flushes
its journal, the image on disk is clean, and writers block until the thaw). The guest stops frozen, and the
``/init`` every resume and fork sends thaws it first thing (``FITHAW``); a pause whose capture failed thaws it
with ``/thaw``. If the node never thaws (it died mid-capture), envd thaws by itself after
:data:`AUTO_THAW_S` of guest time, which does not pass while the VM is paused.

Why hand-written: two ioctls have no library; the ``fsfreeze`` tool is not on every image.
"""

from __future__ import annotations

import fcntl
import logging
import os
from typing import Optional

import trio

__all__ = ["AUTO_THAW_S", "Quiescer"]

log = logging.getLogger("envd.quiesce")

FIFREEZE = 0xC0045877  # _IOWR('X', 119, int)
FITHAW = 0xC0045878  # _IOWR('X', 120, int)
AUTO_THAW_S = 30.0


class Quiescer:
    """Freezes and thaws the root filesystem, at most one freeze at a time."""

    def __init__(self, nursery: trio.Nursery, path: Optional[str]) -> None:
        self.nursery = nursery
        self.path = path
        self.fd: Optional[int] = None
        self._auto_thaw: Optional[trio.CancelScope] = None
        self._lock = trio.Lock()

    async def freeze(self) -> tuple[bool, str]:
        """sync(), then freeze; (frozen, why not) — a filesystem that cannot freeze is still synced."""
        async with self._lock:
            await trio.to_thread.run_sync(os.sync)
            if self.fd is not None:
                return True, ""
            if self.path is None:
                return False, "this envd freezes nothing (no --quiesce-path)"
            fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
            try:
                await trio.to_thread.run_sync(fcntl.ioctl, fd, FIFREEZE, 0)
            except OSError as exc:
                os.close(fd)
                return False, f"{self.path}: {exc.strerror or exc}"
            self.fd = fd
            self._auto_thaw = trio.CancelScope()
            self.nursery.start_soon(self._thaw_later, self._auto_thaw)
            log.info("froze %s for a capture", self.path)
            return True, ""

    async def thaw(self, why: str = "the capture is done") -> bool:
        """Thaw if frozen; True if it was."""
        async with self._lock:
            fd, self.fd = self.fd, None
            if fd is None:
                return False
            if self._auto_thaw is not None:
                self._auto_thaw.cancel()
                self._auto_thaw = None
            try:
                await trio.to_thread.run_sync(fcntl.ioctl, fd, FITHAW, 0)
            except OSError as exc:  # EINVAL: thawed already (by hand, fsfreeze -u)
                log.warning("thawing %s: %s", self.path, exc)
            finally:
                os.close(fd)
            log.info("thawed %s (%s)", self.path, why)
            return True

    async def _thaw_later(self, scope: trio.CancelScope) -> None:
        with scope:
            await trio.sleep(AUTO_THAW_S)
            log.warning("no thaw within %.0f s of a freeze: thawing %s", AUTO_THAW_S, self.path)
            self._auto_thaw = None
            await self.thaw("auto-thaw")
