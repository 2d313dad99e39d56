"""What this host's KVM can run, and which VMM/accelerator to use for Linux guests.

/dev/kvm existing is not enough: on a PVM host (`kvm_pvm`, e.g. the development machines) KVM runs only
guests built for PVM; a stock Linux kernel falls into KVM's instruction emulator and dies, while tiny
non-Linux guests (the tests' PVH guest) do run. So the question is "can KVM run a Linux guest here", and
the answer comes from which KVM vendor module is built in (/sys/module/kvm_intel, kvm_amd or kvm_pvm).

The override exists because the probe cannot know everything (a PVM guest kernel given in config makes a
PVM host fine for Linux guests): `detect_accel(override="kvm")`.
"""

from __future__ import annotations

import fcntl
import os
from dataclasses import dataclass
from pathlib import Path

from .driver import Accel
from .errors import VmmConfigError

_KVM_GET_API_VERSION = 0xAE00


@dataclass(frozen=True)
class AccelInfo:
    """kvm: /dev/kvm opens and answers. linux_guests: the accelerator to use for a stock Linux guest."""

    kvm: bool
    kvm_flavour: str  # "intel", "amd", "pvm" or "none"
    linux_guests: Accel
    reason: str


def _kvm_usable(dev: Path) -> bool:
    try:
        fd = os.open(dev, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        return fcntl.ioctl(fd, _KVM_GET_API_VERSION) == 12
    except OSError:
        return False
    finally:
        os.close(fd)


def detect_accel(
    override: str = "auto", *, kvm_device: Path = Path("/dev/kvm"), sys_module: Path = Path("/sys/module")
) -> AccelInfo:
    """Probe the host. override: "auto" (probe), "kvm" or "tcg" (force the answer for Linux guests)."""
    kvm = _kvm_usable(kvm_device)
    flavour = "none"
    if kvm:
        for name, fl in (("kvm_intel", "intel"), ("kvm_amd", "amd"), ("kvm_pvm", "pvm")):
            if (sys_module / name).exists():
                flavour = fl
                break
        else:
            flavour = "unknown"
    if override == "kvm":
        if not kvm:
            raise VmmConfigError(f"accel override 'kvm' but {kvm_device} is not usable (missing or no permission)")
        return AccelInfo(kvm, flavour, Accel.KVM, "override: kvm")
    if override == "tcg":
        return AccelInfo(kvm, flavour, Accel.TCG, "override: tcg")
    if override != "auto":
        raise VmmConfigError(f"accel override must be auto, kvm or tcg, not {override!r}")
    if not kvm:
        return AccelInfo(kvm, flavour, Accel.TCG, f"{kvm_device} not usable: QEMU TCG (software emulation)")
    if flavour == "pvm":
        return AccelInfo(
            kvm, flavour, Accel.TCG,
            "KVM is PVM: stock Linux guests need QEMU TCG (tiny PVH guests and PVM guest kernels can use KVM)",
        )  # fmt: skip
    return AccelInfo(kvm, flavour, Accel.KVM, f"KVM ({flavour})")
