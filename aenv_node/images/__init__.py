"""Templates: the guest kit (kernel, initramfs, tools drive) and template root filesystems.

Builders are blocking and content-hash cached under the node's state directory; call them from a thread.
"""

from .errors import ImageError, KernelImageError, KitBuildError, PackageError, RootfsBuildError, ToolMissingError
from .cmdline import host_tsc_khz, kernel_cmdline
from .kit import ENVD_PORT, ENVD_READY_MARKER, Kit, ensure_kit
from .kit_spec import KitSpec
from .rootfs import RootfsSpec, ensure_base_rootfs, ensure_rootfs

__all__ = [
    "ENVD_PORT",
    "ENVD_READY_MARKER",
    "ImageError",
    "KernelImageError",
    "Kit",
    "KitBuildError",
    "KitSpec",
    "PackageError",
    "RootfsBuildError",
    "RootfsSpec",
    "ToolMissingError",
    "ensure_base_rootfs",
    "ensure_kit",
    "ensure_rootfs",
    "host_tsc_khz",
    "kernel_cmdline",
]
