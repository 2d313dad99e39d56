"""Typed errors of the VMM drivers.

Every error says what failed and, where it can, what the caller should do about it. The layers above catch
`VmmError` (anything a driver raises on purpose) and decide the sandbox's truthful state from the subclass.
"""

from __future__ import annotations


class VmmError(Exception):
    """Base class of every error a VMM driver raises on purpose."""


class VmmNotInstalled(VmmError):
    """The VMM binary (qemu-system-x86_64, firecracker, jailer) is missing or not executable."""


class VmmConfigError(VmmError):
    """A VmConfig asks for something this driver cannot do (e.g. an NBD drive on Firecracker)."""


class BalloonNotAllowed(VmmConfigError):
    """Free page reporting was asked for on memory the VM does not own exclusively.

    QEMU 7.2 with `share=off` file-backed RAM punches holes in the backing FILE when the guest reports free
    pages, so a base image shared by other restores would be corrupted. Give the VM a memory file of its own
    (`VmConfig.mem_exclusive=True`), anonymous RAM, or turn free page reporting off.
    """


class VmmStartError(VmmError):
    """The VMM process did not come up (exited early, or its control socket never appeared)."""

    def __init__(self, message: str, *, log_tail: str = "") -> None:
        super().__init__(message + (f"\n--- VMM output (tail) ---\n{log_tail}" if log_tail else ""))
        self.log_tail = log_tail


class VmmExited(VmmError):
    """The VMM process exited while an operation was talking to it."""


class VmmApiError(VmmError):
    """The VMM's control API (QMP or Firecracker's REST API) refused a request."""

    def __init__(self, message: str, *, status: int | None = None, detail: str = "") -> None:
        super().__init__(f"{message}: {detail}" if detail else message)
        self.status = status
        self.detail = detail


class VmmTimeout(VmmError):
    """The VMM did not finish an operation in time."""


class SnapshotError(VmmError):
    """A capture or restore cannot be done (wrong state, missing base, unknown snapshot format)."""


class UnsupportedOperation(VmmError):
    """This driver (or this VM's memory mode) cannot do the operation; the message says which can."""
