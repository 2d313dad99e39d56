"""How to boot the guest kit: the kernel command line its initramfs and init read, and the host's TSC rate.

Why a module of its own: the node, the tests and the benchmarks that boot a kit need these, and none of them
needs the kit's build; the build only records the default command line in the kit's manifest.  The parameters
(``aenv.init``, ``aenv.ip``, ``aenv.gw``, ``aenv.halt``) are the contract with ``data/initramfs-init.sh`` and
``data/aenv-init.sh``: change them together.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

__all__ = ["DEFAULT_GATEWAY_IP", "DEFAULT_GUEST_IP", "host_tsc_khz", "kernel_cmdline"]

DEFAULT_GUEST_IP = "169.254.0.21/30"
DEFAULT_GATEWAY_IP = "169.254.0.22"


def kernel_cmdline(
    *,
    init: str = "minimal",
    console: str | None = "ttyS0",
    quiet: bool = True,
    guest_ip: str = DEFAULT_GUEST_IP,
    gateway_ip: str = DEFAULT_GATEWAY_IP,
    halt: str = "poweroff",
    tsc_khz: int | None = None,
    extra: Sequence[str] = (),
) -> str:
    """The kernel command line the kit's initramfs and init understand.

    ``halt="reboot"`` suits Firecracker (it exits on the guest's reset, not on power-off). ``panic=-1``
    reboots at once on a panic, so a VMM run with ``-no-reboot`` exits instead of hanging.

    ``tsc_khz``: give it under QEMU TCG (use :func:`host_tsc_khz`). A TCG guest's TSC is the host's TSC, but
    the kernel cannot calibrate it against the emulated PIT when the host is busy ("tsc: Unable to calibrate
    against PIT ... Marking TSC unstable") and then hangs early in boot; ``tsc_early_khz`` skips the
    calibration and ``tsc=reliable`` stops the clocksource watchdog from distrusting an emulated TSC.
    Leave it None under KVM, where the hypervisor tells the guest its TSC frequency.
    """
    parts = []
    if console:
        parts.append(f"console={console}")
    if quiet:
        parts.append("quiet")
    if tsc_khz:
        parts += [f"tsc_early_khz={tsc_khz}", "tsc=reliable"]
    parts += ["panic=-1", "root=/dev/vda", "rw", f"aenv.init={init}", f"aenv.ip={guest_ip}", f"aenv.gw={gateway_ip}"]
    if halt != "poweroff":
        parts.append(f"aenv.halt={halt}")
    parts += list(extra)
    return " ".join(parts)


def host_tsc_khz() -> int | None:
    """The host's TSC frequency in kHz (what a QEMU TCG guest's TSC runs at), or None if unknown.

    Read from /proc/cpuinfo when the CPU has a constant TSC (the "cpu MHz" line is then the TSC rate the
    kernel detected at boot).
    """
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    flags, mhz = "", None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "flags" and not flags:
            flags = value
        elif key == "cpu MHz" and mhz is None:
            try:
                mhz = float(value)
            except ValueError:
                pass
    if mhz is None or "constant_tsc" not in flags.split():
        return None
    return round(mhz * 1000)
