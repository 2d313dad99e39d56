"""Typed errors of the block-device frontends (NBD, FUSE, ublk)."""

from __future__ import annotations

from ..errors import StorageError

__all__ = [
    "FrontendError",
    "SocketPathInUse",
    "NbdProtocolError",
    "FuseMountError",
    "UblkError",
    "UblkUnavailable",
]


class FrontendError(StorageError):
    """Base class of every frontend error."""


class SocketPathInUse(FrontendError):
    """The unix socket path for a server exists and is not a stale socket we may replace."""


class NbdProtocolError(FrontendError):
    """A client broke the NBD protocol (bad magic, oversized payload, malformed option); its connection is
    closed, the server keeps serving others."""


class FuseMountError(FrontendError):
    """Mounting or unmounting the FUSE export failed (is /dev/fuse present, fusermount3 installed, the
    mountpoint an empty directory?)."""


class UblkError(FrontendError):
    """A ublk control or I/O command failed; ``errno`` is the negative result the kernel returned."""

    def __init__(self, message: str, errno: int | None = None) -> None:
        super().__init__(message)
        self.errno = errno


class UblkUnavailable(UblkError):
    """The kernel offers no ublk (no /dev/ublk-control: CONFIG_BLK_DEV_UBLK unset or ublk_drv not loaded)."""
