#!/usr/bin/env python3
"""Cold boot of a sandbox guest under QEMU TCG: QEMU start to envd answering ``/health``, against the floor.

- full:  the guest kit (cloud kernel, initramfs loading the virtio modules, tools drive) + the ``base`` rootfs
         through a qcow2 overlay, NIC on a tap in a network namespace made for the run; timed from QEMU's
         start to the first successful ``GET /health`` from inside that namespace (a thread of this process
         joins it with setns(2), so no client process start is counted), plus the time the init prints
         ``aenv: envd ready`` on the console.
- floor: the same kernel and QEMU command, no disks, no NIC, an initramfs whose /init only prints a marker
         and powers off: what any Linux guest pays under TCG here before our initramfs, init or envd run.
The ratio full/floor is what our boot path costs on top of the kernel. Medians of N runs each (default 3),
run alternately so both see the same machine load (the 2-core machine is shared: absolute numbers move).

Usage: .venv/bin/python bench/guest_boot.py [--runs 3] [--state-dir /var/lib/aenv] [--tb-size MiB]
Writes bench/results/guest_boot.json; the last line printed is a one-line summary.
"""

from __future__ import annotations

import argparse
import ctypes
import io
import json
import os
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from aenv_node.images import ENVD_PORT, ENVD_READY_MARKER, ensure_base_rootfs, ensure_kit
from aenv_node.images.cmdline import host_tsc_khz, kernel_cmdline
from aenv_node.images.cpio import CharDevice, write_newc
from _results import result_path  # noqa: E402

FLOOR_MARKER = "aenv-floor: init reached"
GUEST_IP = "169.254.0.21"
CLONE_NEWNET = 0x40000000


def qemu_base(kit, cmdline: str, initrd: Path, tb_size: int | None) -> list[str]:
    accel = ["-M", "microvm,accel=tcg"] if tb_size is None else ["-M", "microvm", "-accel", f"tcg,tb-size={tb_size}"]
    return ["qemu-system-x86_64", *accel, "-cpu", "max", "-m", "512", "-smp", "2", "-nodefaults",
            "-no-user-config", "-nographic", "-serial", "stdio", "-no-reboot",
            "-kernel", str(kit.vmlinuz), "-initrd", str(initrd), "-append", cmdline]  # fmt: skip


def floor_initramfs(dest: Path) -> None:
    busybox = shutil.which("busybox") or "/bin/busybox"
    tree = dest.with_suffix(".d")
    (tree / "bin").mkdir(parents=True)
    shutil.copy2(busybox, tree / "bin" / "busybox")
    init = tree / "init"
    init.write_text(f"#!/bin/busybox sh\n/bin/busybox echo '{FLOOR_MARKER}'\n/bin/busybox poweroff -f\n")
    init.chmod(0o755)
    buf = io.BytesIO()
    write_newc(tree, buf, extra=[CharDevice("dev/console", 5, 1)])
    dest.write_bytes(buf.getvalue())  # uncompressed: the floor should not pay for decompression either


class ConsoleWatch:
    """Reads QEMU's serial output (its stdout) in a thread, noting when each wanted marker first appears."""

    def __init__(self, proc: subprocess.Popen, t0: float, markers: list[str]) -> None:
        self.proc, self.t0, self.markers = proc, t0, markers
        self.seen: dict[str, float] = {}
        self.text = bytearray()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            now = time.monotonic()
            self.text += line
            decoded = line.decode(errors="replace")
            for m in self.markers:
                if m not in self.seen and m in decoded:
                    self.seen[m] = now - self.t0


def health_in_netns(netns: str, t0: float, deadline: float, result: dict) -> None:
    """Poll envd's /health from a thread moved into ``netns`` (setns affects only the calling thread)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{netns}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            result["error"] = f"setns: errno {ctypes.get_errno()}"
            return
    finally:
        os.close(fd)
    request = f"GET /health HTTP/1.1\r\nHost: {GUEST_IP}\r\nConnection: close\r\n\r\n".encode()
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((GUEST_IP, ENVD_PORT), timeout=1) as s:
                s.sendall(request)
                status = s.recv(64).split(b" ", 2)
                if len(status) > 1 and status[1].startswith(b"2"):
                    result["seconds"] = time.monotonic() - t0
                    return
        except OSError:
            pass
        time.sleep(0.02)
    result["error"] = "timeout"


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_full(kit, rootfs: Path, work: Path, tb_size: int | None, timeout: float) -> dict:
    netns = f"aenvb-{os.getpid()}-{secrets.token_hex(3)}"
    overlay = work / f"root-{netns}.qcow2"
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-F", "raw", "-b", str(rootfs), str(overlay)],
                   check=True)  # fmt: skip
    subprocess.run(["ip", "netns", "add", netns], check=True)
    proc = None
    try:
        for cmd in (["link", "set", "lo", "up"], ["tuntap", "add", "dev", "tap0", "mode", "tap"],
                    ["addr", "add", "169.254.0.22/30", "dev", "tap0"], ["link", "set", "tap0", "up"]):  # fmt: skip
            subprocess.run(["ip", "-n", netns, *cmd], check=True)
        cmdline = kernel_cmdline(tsc_khz=host_tsc_khz())
        argv = qemu_base(kit, cmdline, kit.initramfs, tb_size) + [
            "-drive", f"id=root,file={overlay},format=qcow2,if=none", "-device", "virtio-blk-device,drive=root",
            "-drive", f"id=tools,file={kit.tools_img},format=raw,if=none,readonly=on",
            "-device", "virtio-blk-device,drive=tools",
            "-netdev", "tap,id=net0,ifname=tap0,script=no,downscript=no,vhost=off",
            "-device", "virtio-net-device,netdev=net0",
        ]  # fmt: skip
        t0 = time.monotonic()
        proc = subprocess.Popen(["ip", "netns", "exec", netns, *argv], stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
        watch = ConsoleWatch(proc, t0, [ENVD_READY_MARKER])
        result: dict = {}
        poller = threading.Thread(target=health_in_netns, args=(netns, t0, t0 + timeout, result))
        poller.start()
        poller.join()
        if "seconds" not in result:
            raise RuntimeError(f"envd /health never answered ({result.get('error')}):\n"
                               f"{watch.text.decode(errors='replace')[-3000:]}")  # fmt: skip
        end = time.monotonic() + 5  # the init notices envd a poll interval later than a client may
        while ENVD_READY_MARKER not in watch.seen and time.monotonic() < end:
            time.sleep(0.05)
        return {"health_s": result["seconds"], "marker_s": watch.seen.get(ENVD_READY_MARKER)}
    finally:
        if proc is not None:
            stop(proc)
        subprocess.run(["ip", "netns", "del", netns], check=False)
        overlay.unlink(missing_ok=True)


def run_floor(kit, initrd: Path, tb_size: int | None, timeout: float) -> dict:
    cmdline = kernel_cmdline(tsc_khz=host_tsc_khz())
    t0 = time.monotonic()
    proc = subprocess.Popen(qemu_base(kit, cmdline, initrd, tb_size), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        watch = ConsoleWatch(proc, t0, [FLOOR_MARKER])
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        watch.thread.join(timeout=5)
        exited = time.monotonic() - t0
        if FLOOR_MARKER not in watch.seen:
            raise RuntimeError(f"floor marker never printed:\n{watch.text.decode(errors='replace')[-3000:]}")
        return {"marker_s": watch.seen[FLOOR_MARKER], "qemu_exit_s": exited}
    finally:
        stop(proc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--state-dir", type=Path, default=Path(os.environ.get("AENV_STATE_DIR", "/var/lib/aenv")))
    ap.add_argument("--tb-size", type=int, default=None, help="QEMU TCG translation cache size in MiB")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--out", type=Path, default=result_path("guest_boot"))
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root (network namespace, tap device)")

    t = time.monotonic()
    kit = ensure_kit(args.state_dir, progress=lambda m: print(f"  kit: {m}", file=sys.stderr))
    kit_s = time.monotonic() - t
    t = time.monotonic()
    rootfs = ensure_base_rootfs(args.state_dir, progress=lambda m: print(f"  rootfs: {m}", file=sys.stderr))
    rootfs_s = time.monotonic() - t
    print(f"kit {kit.hash} ({kit_s:.1f} s), rootfs {rootfs.name} ({rootfs_s:.1f} s)")

    full: list[dict] = []
    floor: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="aenv-guest-boot-") as tmp:
        work = Path(tmp)
        initrd = work / "floor.cpio"
        floor_initramfs(initrd)
        for i in range(args.runs):
            floor.append(run_floor(kit, initrd, args.tb_size, args.timeout))
            print(f"run {i + 1}: floor marker {floor[-1]['marker_s']:.2f} s", flush=True)
            full.append(run_full(kit, rootfs, work, args.tb_size, args.timeout))
            marker = full[-1]["marker_s"]
            print(f"run {i + 1}: envd /health {full[-1]['health_s']:.2f} s "
                  f"(console marker {marker if marker is None else round(marker, 2)} s)", flush=True)  # fmt: skip

    health = statistics.median(r["health_s"] for r in full)
    markers = [r["marker_s"] for r in full if r["marker_s"] is not None]
    floor_s = statistics.median(r["marker_s"] for r in floor)
    load = os.getloadavg()
    result = {
        "bench": "guest_boot",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "runs": args.runs,
        "tb_size_mib": args.tb_size,
        "kit": {"hash": kit.hash, "kernel": kit.kernel_version, "sizes": kit.manifest.get("sizes"),
                "build_seconds": kit.manifest.get("build_seconds")},
        "rootfs": {"path": str(rootfs), "apparent_bytes": rootfs.stat().st_size,
                   "allocated_bytes": rootfs.stat().st_blocks * 512},
        "cmdline": kernel_cmdline(tsc_khz=host_tsc_khz()),
        "full_boot_to_envd_health_s": {"median": round(health, 3), "all": [round(r["health_s"], 3) for r in full]},
        "full_boot_to_console_marker_s": {"median": round(statistics.median(markers), 3) if markers else None,
                                          "all": [None if m is None else round(m, 3) for m in markers]},
        "floor_kernel_initramfs_marker_s": {"median": round(floor_s, 3),
                                            "all": [round(r["marker_s"], 3) for r in floor]},
        "ratio_full_over_floor": round(health / floor_s, 2),
        "loadavg_at_end": [round(x, 2) for x in load],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"guest_boot (QEMU TCG, median of {args.runs}): cold boot to envd /health {health:.2f} s vs floor "
          f"(kernel+trivial initramfs) {floor_s:.2f} s = {health / floor_s:.2f}x; load {load[0]:.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
