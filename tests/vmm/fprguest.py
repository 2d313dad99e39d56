"""A Linux guest (the guest kit's kernel) that fills and frees memory on command: for free page reporting.

No network and no envd: the guest's PID 1 is a busybox script on its own root filesystem (`aenv.init=image`).
At boot it fills `/tmp/keep` (tmpfs, `KEEP_MIB` MiB of a non-zero pattern) and prints its md5. Then it polls a
read-only "command drive" (/dev/vdc, read with O_DIRECT so the host's rewrites are seen) and runs each new
command once, printing `fpr: <seq> <cmd> ...` on the console:

* `dirty`: overwrite /tmp/keep in place (the same guest pages: in a restored VM, private copies of all of them);
* `free`:  delete /tmp/keep (the guest frees those pages; page reporting hands them to the host);
* `sum`:   print /tmp/keep's md5 (in another VM restored from the same image it must be the boot's md5:
  a hole punched in the image reads as zeros);
* `ping`:  answer `pong`.

Every drive is read-only, as the punch-hole guard requires (see `aenv_node.vmm.qemu.driver`). Shared by
tests/vmm/test_free_page_reporting.py and bench/free_page_reporting.py.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import trio

from aenv_node.vmm import Accel, BalloonConfig, Drive, MemoryMode, VmConfig

KEEP_MIB = 200
MEM_MIB = 512
CONSOLE_PREFIX = "fpr: "

GUEST_INIT = f"""#!/opt/aenv/bin/busybox sh
PATH=/opt/aenv/bb
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t tmpfs -o size=300m tmpfs /tmp
echo 2 > /proc/sys/kernel/printk
drv=$(ls /sys/bus/virtio/drivers/virtio_balloon 2>/dev/null | grep -c virtio)
echo "fpr: balloon-driver $drv"
yes abcdefghijklmno | dd of=/tmp/keep bs=1M count={KEEP_MIB} iflag=fullblock 2>/dev/null
set -- $(md5sum /tmp/keep)
echo "fpr: keep $1"
echo "fpr: ready"
last=""
while :; do
    cmd=$(dd if=/dev/vdc bs=4096 count=1 iflag=direct 2>/dev/null | tr -d '\\000\\n')
    if [ -n "$cmd" ] && [ "$cmd" != "$last" ]; then
        last="$cmd"
        case "$cmd" in
            *" dirty") dd if=/dev/zero of=/tmp/keep bs=1M count={KEEP_MIB} conv=notrunc 2>/dev/null
                       sync; echo "fpr: $cmd done" ;;
            *" free") rm -f /tmp/keep; echo "fpr: $cmd done" ;;
            *" sum") set -- $(md5sum /tmp/keep); echo "fpr: $cmd $1" ;;
            *" ping") echo "fpr: $cmd pong" ;;
        esac
    fi
    sleep 0.3
done
"""


def make_rootfs(path: Path) -> None:
    """An ext4 image holding the init script and the mount points (mounted read-only by the guest)."""
    tree = path.with_suffix(".d")
    for d in ("opt/aenv", "dev", "proc", "sys", "tmp", "run"):
        (tree / d).mkdir(parents=True, exist_ok=True)
    init = tree / "fpr-init"
    init.write_text(GUEST_INIT)
    init.chmod(0o755)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-d", str(tree), str(path), "16M"], check=True)


def host_tsc_khz() -> int | None:
    from aenv_node.images.kit import host_tsc_khz as khz

    return khz()


def guest_config(
    kit, workdir: Path, rootfs: Path, command_drive: Path, *, mem_mode: MemoryMode = MemoryMode.SHARED
) -> VmConfig:  # type: ignore[no-untyped-def]
    from aenv_node.images.kit import kernel_cmdline

    command_drive.write_bytes(bytes(4096))
    return VmConfig(
        workdir=workdir,
        kernel=kit.vmlinuz,
        initrd=kit.initramfs,
        cmdline=kernel_cmdline(
            init="image", tsc_khz=host_tsc_khz(), extra=["ro", "aenv.image_init=/fpr-init", "aenv.net=off"]
        ),
        vcpus=1,
        mem_mib=MEM_MIB,
        drives=(
            Drive(str(rootfs), read_only=True),
            Drive(str(kit.tools_img), read_only=True),
            Drive(str(command_drive), read_only=True),
        ),
        mem_mode=mem_mode,
        balloon=BalloonConfig(free_page_reporting=True),
        accel=Accel.TCG,
    )


@dataclass
class Guest:
    """Sends commands to one running guest through its command drive and reads the answers off its console."""

    config: VmConfig
    seq: int = 0

    @property
    def command_drive(self) -> Path:
        return Path(self.config.drives[2].source)

    def console(self) -> str:
        p = self.config.console_path
        return p.read_text(errors="replace") if p.exists() else ""

    async def wait_line(self, pattern: str, timeout: float) -> re.Match[str]:
        rx = re.compile(pattern, re.MULTILINE)
        with trio.move_on_after(timeout):
            while True:
                m = rx.search(self.console())
                if m:
                    return m
                await trio.sleep(0.1)
        raise AssertionError(f"{pattern!r} not on the console within {timeout} s:\n{self.console()[-3000:]}")

    async def run(self, cmd: str, timeout: float = 120) -> str:
        """Send `cmd`; returns what the guest printed after `fpr: <seq> <cmd>`."""
        self.seq += 1
        text = f"{self.seq} {cmd}\n".encode()
        fd = os.open(self.command_drive, os.O_WRONLY)
        try:
            os.pwrite(fd, text.ljust(4096, b"\0"), 0)
        finally:
            os.close(fd)
        m = await self.wait_line(rf"^fpr: {self.seq} {cmd} (.*?)\r?$", timeout)
        return m.group(1)


def image_anon_bytes(pid: int, image: Path) -> int:
    """Private (copy-on-write) memory of `pid` in its mappings of `image`: the Anonymous of those VMAs."""
    st = os.stat(image)
    total, inside = 0, False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            first = line.split(None, 1)[0]
            if "-" in first and not first.endswith(":"):  # a VMA header: "lo-hi perms offset dev inode path"
                parts = line.split()
                inside = len(parts) >= 5 and int(parts[4]) == st.st_ino
            elif inside and first == "Anonymous:":
                total += int(line.split()[1]) * 1024
    return total


def rollup(pid: int) -> dict[str, int]:
    """/proc/PID/smaps_rollup in bytes (Rss, Pss, Anonymous, Private_Dirty, ...)."""
    out = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                out[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return out


async def wait_anon_below(pid: int, image: Path | None, limit: int, timeout: float) -> tuple[float, int]:
    """Poll until the VM's private memory (in `image`'s mapping, or the whole process's Anonymous if None)
    falls to `limit` bytes or below; returns (seconds it took, the value then). Raises on timeout."""
    t0 = time.monotonic()
    value = 0
    with trio.move_on_after(timeout):
        while True:
            value = image_anon_bytes(pid, image) if image is not None else rollup(pid)["Anonymous"]
            if value <= limit:
                return time.monotonic() - t0, value
            await trio.sleep(0.1)
    raise AssertionError(f"private memory still {value >> 20} MiB after {timeout} s (waiting for <= {limit >> 20})")
