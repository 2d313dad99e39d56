"""What goes into a guest kit: :class:`KitSpec`, the packages and kernel modules it names by default.

Why a module of its own: the spec is the input of both halves of the kit, the build (:mod:`.kit_build`) and
the cache (:mod:`.kit`, whose content hash covers every field), so it sits below both.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["KIT_FORMAT", "OPTIONAL_MODULES", "PYTHON_PACKAGES", "REQUIRED_MODULES", "KitSpec"]

_GUEST_DIR = Path(__file__).resolve().parent.parent / "guest"

KIT_FORMAT = 1  # bump when the kit's layout changes in a way the hash of the code would not show

# Python 3.11 from Debian plus every library package its binary and extension modules link against.
PYTHON_PACKAGES = (
    "python3.11-minimal",
    "libpython3.11-minimal",
    "libpython3.11-stdlib",
    "libc6",
    "zlib1g",
    "libexpat1",
    "libssl3",
    "libffi8",
    "libbz2-1.0",
    "liblzma5",
    "libsqlite3-0",
    "libuuid1",
    "libncursesw6",
    "libtinfo6",
    "libreadline8",
    "libdb5.3",
    "libcrypt1",
    "libnsl2",
    "libtirpc3",
    "libgssapi-krb5-2",
    "libkrb5-3",
    "libk5crypto3",
    "libcom-err2",
    "libkrb5support0",
    "libkeyutils1",
)

REQUIRED_MODULES = ("virtio_ring", "virtio", "virtio_mmio", "virtio_blk", "virtio_net")
# Loaded when the kernel has them: balloon and PCI transport (QEMU non-microvm), entropy (fast crng init),
# vsock (Firecracker), ublk (absent from Debian's 6.1 kernels: CONFIG_BLK_DEV_UBLK is not set).
OPTIONAL_MODULES = (
    "virtio_balloon",
    "virtio_pci",
    "virtio_rng",
    "vmw_vsock_virtio_transport",
    "ublk_drv",
)


@dataclass(frozen=True)
class KitSpec:
    """What goes into a kit. Every field is part of the kit's hash."""

    kernel_package: str = "linux-image-cloud-amd64"
    busybox_package: str = "busybox-static"
    python_packages: tuple[str, ...] = PYTHON_PACKAGES
    modules: tuple[str, ...] = REQUIRED_MODULES
    optional_modules: tuple[str, ...] = OPTIONAL_MODULES
    guest_dir: Path = _GUEST_DIR
    pip_index_url: str | None = None
    zstd_level: int = 10
    require_envd: bool = True  # fail the build when `import envd` fails in the kit's own Python

    @property
    def requirements(self) -> Path:
        return self.guest_dir / "requirements.txt"
