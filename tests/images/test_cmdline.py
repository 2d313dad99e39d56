"""The kernel command line the kit's initramfs and init read, and the host TSC rate used under TCG."""

from __future__ import annotations

from aenv_node.images import host_tsc_khz, kernel_cmdline


def test_default_cmdline_boots_minimal_init_with_the_fixed_guest_address() -> None:
    args = kernel_cmdline().split()
    assert args[:2] == ["console=ttyS0", "quiet"]
    for expected in ("root=/dev/vda", "rw", "panic=-1", "aenv.init=minimal", "aenv.ip=169.254.0.21/30",
                     "aenv.gw=169.254.0.22"):  # fmt: skip
        assert expected in args
    assert not any(a.startswith(("tsc", "aenv.halt")) for a in args)


def test_cmdline_options() -> None:
    args = kernel_cmdline(init="image", console=None, quiet=False, halt="reboot", tsc_khz=2_000_000,
                          guest_ip="10.0.0.2/30", gateway_ip="10.0.0.1", extra=["pci=off"]).split()  # fmt: skip
    assert "aenv.init=image" in args and "aenv.halt=reboot" in args and args[-1] == "pci=off"
    assert "tsc_early_khz=2000000" in args and "tsc=reliable" in args
    assert "aenv.ip=10.0.0.2/30" in args and "aenv.gw=10.0.0.1" in args
    assert not any(a.startswith("console=") or a == "quiet" for a in args)


def test_host_tsc_khz_is_plausible() -> None:
    khz = host_tsc_khz()
    assert khz is None or 100_000 < khz < 10_000_000
