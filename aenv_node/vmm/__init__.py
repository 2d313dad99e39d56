"""VMM drivers behind one interface: QEMU microvm (QMP) and Firecracker (REST), chosen by config.

Public face: the interface and its data (`VmmDriver`, `Vm`, `VmConfig`, ...), the two drivers, host
detection (`detect_accel`, `make_driver`), memory-image helpers (`memfile`) and the errors. Nothing above
this package needs to know which VMM runs a VM.
"""

from . import memfile
from .accel import AccelInfo, detect_accel
from .driver import (
    Accel,
    BalloonConfig,
    CaptureKind,
    CaptureResult,
    Drive,
    KernelFormat,
    MemoryMode,
    NetIf,
    SnapshotFiles,
    SnapshotFormat,
    Vm,
    VmConfig,
    VmmDriver,
    VmState,
    VmStats,
)
from .memory import PAGE_SIZE, MemoryRange
from .errors import (
    BalloonNotAllowed,
    SnapshotError,
    UnsupportedOperation,
    VmmApiError,
    VmmConfigError,
    VmmError,
    VmmExited,
    VmmNotInstalled,
    VmmStartError,
    VmmTimeout,
)
from .cgroup import CgroupError, Cgroups, ResourceLimits, VmmLimits
from .firecracker import FirecrackerDriver, JailerConfig
from .qemu import QemuDriver
from .process import kill_recorded
from .select import DriverChoice, make_driver

__all__ = [
    "CgroupError",
    "Cgroups",
    "ResourceLimits",
    "VmmLimits",
    "PAGE_SIZE",
    "Accel",
    "KernelFormat",
    "AccelInfo",
    "BalloonConfig",
    "BalloonNotAllowed",
    "CaptureKind",
    "CaptureResult",
    "Drive",
    "DriverChoice",
    "FirecrackerDriver",
    "JailerConfig",
    "MemoryMode",
    "MemoryRange",
    "NetIf",
    "QemuDriver",
    "SnapshotError",
    "SnapshotFiles",
    "SnapshotFormat",
    "UnsupportedOperation",
    "Vm",
    "VmConfig",
    "VmState",
    "VmStats",
    "VmmApiError",
    "VmmConfigError",
    "VmmDriver",
    "VmmError",
    "VmmExited",
    "VmmNotInstalled",
    "VmmStartError",
    "VmmTimeout",
    "detect_accel",
    "kill_recorded",
    "make_driver",
    "memfile",
]
