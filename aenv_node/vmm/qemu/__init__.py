"""QEMU microvm driver (QMP over a unix socket)."""

from .driver import QemuDriver, QemuVm
from .qmp import QmpClient

__all__ = ["QemuDriver", "QemuVm", "QmpClient"]
