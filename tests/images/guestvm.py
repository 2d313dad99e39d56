"""Boot the guest kit + a rootfs under QEMU TCG (microvm), its NIC on a tap in a network namespace of its own.

Owns everything it creates (the qcow2 overlay, the netns and its tap, the QEMU process) and removes it on
exit: QEMU is stopped by its PID, the namespace deleted. The rootfs itself is only ever a read-only backing
file of the overlay.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Self

from aenv_node.images import ENVD_READY_MARKER, Kit, host_tsc_khz, kernel_cmdline

HERE = Path(__file__).resolve().parent
QEMU = "qemu-system-x86_64"
GATEWAY_CIDR = "169.254.0.22/30"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


class GuestVM:
    def __init__(self, kit: Kit, rootfs: Path, workdir: Path, *, mem_mib: int = 512, vcpus: int = 2) -> None:
        self.kit, self.rootfs, self.workdir = kit, rootfs, workdir
        self.mem_mib, self.vcpus = mem_mib, vcpus
        self.netns = f"aenvt-{os.getpid()}-{secrets.token_hex(3)}"
        self.console = workdir / "console.log"
        self.overlay = workdir / "root.qcow2"
        self.proc: subprocess.Popen | None = None
        self._netns_made = False
        self.boot_seconds: float | None = None
        self.cmdline = kernel_cmdline(tsc_khz=host_tsc_khz())

    def argv(self) -> list[str]:
        return [
            QEMU, "-M", "microvm,accel=tcg", "-cpu", "max", "-m", str(self.mem_mib), "-smp", str(self.vcpus),
            "-nodefaults", "-no-user-config", "-nographic", "-serial", "stdio", "-no-reboot",
            "-kernel", str(self.kit.vmlinuz), "-initrd", str(self.kit.initramfs), "-append", self.cmdline,
            "-drive", f"id=root,file={self.overlay},format=qcow2,if=none",
            "-device", "virtio-blk-device,drive=root",
            "-drive", f"id=tools,file={self.kit.tools_img},format=raw,if=none,readonly=on",
            "-device", "virtio-blk-device,drive=tools",
            "-netdev", "tap,id=net0,ifname=tap0,script=no,downscript=no,vhost=off",
            "-device", "virtio-net-device,netdev=net0,mac=02:fc:00:00:00:01",
        ]  # fmt: skip

    def __enter__(self) -> Self:
        try:
            subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-F", "raw", "-b", str(self.rootfs),
                            str(self.overlay)], check=True, capture_output=True)  # fmt: skip
            _ip("netns", "add", self.netns)
            self._netns_made = True
            _ip("-n", self.netns, "link", "set", "lo", "up")
            _ip("-n", self.netns, "tuntap", "add", "dev", "tap0", "mode", "tap")
            _ip("-n", self.netns, "addr", "add", GATEWAY_CIDR, "dev", "tap0")
            _ip("-n", self.netns, "link", "set", "tap0", "up")
            with self.console.open("wb") as out:
                self.proc = subprocess.Popen(
                    ["ip", "netns", "exec", self.netns, *self.argv()],  # ip execs QEMU: same PID
                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                )  # fmt: skip
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._netns_made:
            subprocess.run(["ip", "netns", "del", self.netns], check=False, capture_output=True)
            self._netns_made = False
        self.overlay.unlink(missing_ok=True)

    def console_text(self) -> str:
        return self.console.read_text(errors="replace") if self.console.exists() else ""

    def wait_console(self, needle: str = ENVD_READY_MARKER, timeout: float = 300) -> float:
        """Seconds since QEMU started until ``needle`` shows on the console (AssertionError otherwise)."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if needle in self.console_text():
                return time.monotonic() - t0
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"QEMU exited ({self.proc.returncode}) before {needle!r}:\n"
                                     f"{self.console_text()[-4000:]}")  # fmt: skip
            time.sleep(0.1)
        raise AssertionError(f"{needle!r} not on the console within {timeout} s:\n{self.console_text()[-4000:]}")

    def envd(self, *ops: dict) -> list[dict]:
        """Run envd_client.py operations inside the VM's network namespace."""
        proc = subprocess.run(
            ["ip", "netns", "exec", self.netns, sys.executable, str(HERE / "envd_client.py"), json.dumps(list(ops))],
            check=False, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        if proc.returncode != 0:
            raise AssertionError(f"envd client failed: {proc.stderr[-3000:]}\nconsole:\n{self.console_text()[-3000:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])
