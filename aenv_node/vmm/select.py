"""Choosing a driver from node config.

`make_driver("auto")` picks Firecracker when KVM can run Linux guests and Firecracker is installed (the
production path), else QEMU (with TCG when KVM cannot run the guest). The accelerator a VM uses is part of
its `VmConfig` (`accel`); `choose()` returns both so the caller builds configs consistently.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .accel import AccelInfo, detect_accel
from .driver import Accel, VmmDriver
from .errors import VmmConfigError, VmmNotInstalled
from .firecracker import FirecrackerDriver, JailerConfig
from .firecracker.driver import DEFAULT_FIRECRACKER
from .qemu import QemuDriver
from .qemu.driver import DEFAULT_QEMU


@dataclass(frozen=True)
class DriverChoice:
    driver: VmmDriver
    accel: Accel
    info: AccelInfo


def make_driver(
    kind: str = "auto",
    *,
    accel_override: str = "auto",
    qemu_binary: Path = DEFAULT_QEMU,
    firecracker_binary: Path = DEFAULT_FIRECRACKER,
    jailer: JailerConfig | None = None,
    tcg_tb_size_mib: int = 16,
    qemu_cpu_model: str | None = None,
    track_dirty_pages: bool = True,
    qemu_mem_merge: bool = False,
    tcg_restore_tb_size_mib: int | None = None,
    qemu_cow_discard: bool = False,
) -> DriverChoice:
    """kind: "auto", "qemu" or "firecracker". accel_override: "auto", "kvm" or "tcg" (see detect_accel).

    jailer: run Firecracker under the jailer (None: not). The rest are the drivers' options.
    """
    info = detect_accel(accel_override)
    accel = info.linux_guests
    if kind == "auto":
        kind = "firecracker" if accel is Accel.KVM and firecracker_binary.is_file() else "qemu"
    if kind == "firecracker":
        if accel is not Accel.KVM:
            raise VmmConfigError(f"Firecracker needs KVM that runs the guest; {info.reason}")
        if not firecracker_binary.is_file():
            raise VmmNotInstalled(f"firecracker not found at {firecracker_binary} (scripts/setup.d/30-firecracker.sh)")
        if jailer is not None and not jailer.binary.is_file():
            raise VmmNotInstalled(f"jailer not found at {jailer.binary} (scripts/setup.d/30-firecracker.sh)")
        fc = FirecrackerDriver(binary=firecracker_binary, jailer=jailer, track_dirty_pages=track_dirty_pages)
        return DriverChoice(fc, accel, info)
    if kind == "qemu":
        if not qemu_binary.is_file():
            raise VmmNotInstalled(f"QEMU not found at {qemu_binary} (apt: qemu-system-x86)")
        if qemu_cpu_model is None and accel is Accel.KVM and info.kvm_flavour in ("intel", "amd"):
            # a real KVM host: the guest sees the host's CPU as it is (the driver's default drops
            # arch-capabilities, which PVM's KVM cannot set)
            qemu_cpu_model = "host"
        qemu = QemuDriver(binary=qemu_binary, cpu_model=qemu_cpu_model, tcg_tb_size_mib=tcg_tb_size_mib,
                           mem_merge=qemu_mem_merge, restore_tb_size_mib=tcg_restore_tb_size_mib,
                           cow_discard=qemu_cow_discard)
        return DriverChoice(qemu, accel, info)
    raise VmmConfigError(f"VMM kind must be auto, qemu or firecracker, not {kind!r}")
