"""Runs INSIDE the KVM host VM (bench/kvmhost.py copies nothing: it is on the project drive): the raw VMM
operations the node's create, pause, resume, snapshot and fork are built on, on the node's own template snapshot.

``raw_ops.py firecracker ROUNDS``: a fresh process per restore, ``PUT /snapshot/load`` (memory file mapped
copy-on-write) and resume; pause = ``PATCH /vm Paused`` + a Diff ``/snapshot/create``; snapshot = pause + Diff +
``Resumed``; fork of N = one Diff capture of the parent + N restores. Only raw API calls over the unix socket,
none of our driver code, so the figures are the floor under the node's.

``raw_ops.py qemu ROUNDS``: QEMU has no one-call diff snapshot (7.2's migration has no dirty log), so its floor is
our VMM driver alone (``aenv_node.vmm``, the layer under everything the node adds), as in bench/lifecycle.py:
restore = QEMU with ``-incoming defer`` + load + ``cont``; pause = stop + device state + the dirty pages copied
into pre-faulted memory; snapshot = that + ``cont``; fork of N = one such capture + N concurrent restores. Disks
are plain files (no NBD server), on a tap in a namespace of its own.

Prints one JSON object (medians, seconds) as its last line.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx

FC = "/opt/aenv/bin/firecracker"
WORK = Path("/var/lib/aenv/bench-raw")
NETNS = "aenvbench"
DRIVE_DIR = "/run/aenv-vm"
LIVE: list["Fc"] = []  # every Firecracker started, killed on the way out whatever happens  # the node's drive paths (vmm/firecracker/driver.py): the snapshot names them


def template_snapshot(db: str) -> tuple[str, str, str]:
    con = sqlite3.connect(db)
    try:
        (vmstate, memory, config), = con.execute(
            "SELECT s.vmstate_location, s.memory_location, s.config FROM snapshots s "
            "JOIN templates t ON t.boot_snapshot_id = s.id WHERE t.id = 'base'").fetchall()
    finally:
        con.close()
    return vmstate, memory, json.loads(config)["shape"]["tools_img"]


class Fc:
    def __init__(self, name: str, disk: Path, tools: str, tap: str = "tap0") -> None:
        self.tap = tap  # one tap per VM: a tap device has one reader
        self.sock = WORK / f"{name}.sock"
        self.sock.unlink(missing_ok=True)
        links = f"mount -t tmpfs none {DRIVE_DIR} && ln -s {disk} {DRIVE_DIR}/vd0 && ln -s {tools} {DRIVE_DIR}/vd1"
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", NETNS, "unshare", "--mount", "--propagation", "private", "--", "/bin/sh", "-c",
             f'{links} && exec {FC} --id {name} --api-sock {self.sock}'],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        LIVE.append(self)
        deadline = time.monotonic() + 30
        while not self.sock.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"firecracker {name} did not open its API socket (exit {self.proc.poll()})")
            time.sleep(0.001)
        self.http = httpx.Client(transport=httpx.HTTPTransport(uds=str(self.sock)), base_url="http://fc", timeout=300)

    def call(self, method: str, path: str, body: dict) -> None:
        r = self.http.request(method, path, json=body)
        if r.status_code >= 300:
            raise RuntimeError(f"{method} {path}: {r.status_code} {r.text}")

    def load(self, vmstate: str, memory: str) -> None:
        self.call("PUT", "/snapshot/load", {"snapshot_path": vmstate, "enable_diff_snapshots": True,
                                            "mem_backend": {"backend_type": "File", "backend_path": memory},
                                            "resume_vm": True,
                                            "network_overrides": [{"iface_id": "eth0", "host_dev_name": self.tap}]})

    def diff(self, out: Path) -> None:
        self.call("PATCH", "/vm", {"state": "Paused"})
        self.call("PUT", "/snapshot/create", {"snapshot_type": "Diff", "snapshot_path": str(out / "vmstate"),
                                               "mem_file_path": str(out / "memory")})

    def kill(self) -> None:
        if self in LIVE:
            LIVE.remove(self)
        self.http.close()
        self.proc.kill()
        self.proc.wait()
        self.sock.unlink(missing_ok=True)


def firecracker(rounds: int) -> None:
    vmstate, memory, tools = template_snapshot("/var/lib/aenv/aenv.db")
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    rootfs = next(Path("/var/lib/aenv/rootfs").glob("base-*.ext4"))
    disk = WORK / "disk.raw"
    subprocess.run(["cp", "--sparse=always", str(rootfs), str(disk)], check=True)
    subprocess.run(["ip", "netns", "add", NETNS], check=True)
    try:
        for tap in ("tap0", "tap1", "tap2"):
            subprocess.run(["ip", "netns", "exec", NETNS, "ip", "tuntap", "add", tap, "mode", "tap"], check=True)
            subprocess.run(["ip", "netns", "exec", NETNS, "ip", "link", "set", tap, "up"], check=True)
        out: dict[str, list[float]] = {"restore": [], "pause": [], "snapshot": [], "fork2": []}
        for i in range(rounds):
            t = time.perf_counter()
            vm = Fc(f"raw-{i}", disk, tools)
            vm.load(vmstate, memory)
            out["restore"].append(time.perf_counter() - t)
            time.sleep(1)
            snap = WORK / f"s{i}"
            snap.mkdir()
            t = time.perf_counter()
            vm.diff(snap)
            vm.call("PATCH", "/vm", {"state": "Resumed"})
            out["snapshot"].append(time.perf_counter() - t)
            time.sleep(0.5)
            t = time.perf_counter()
            pause = WORK / f"p{i}"
            pause.mkdir()
            vm.diff(pause)
            vm.kill()
            out["pause"].append(time.perf_counter() - t)
            # fork of two: one Diff capture of a running parent, then two restores from the template image
            # (a Diff alone is not loadable: the node merges it over its base, which costs a copy here)
            parent = Fc(f"rawp-{i}", disk, tools)
            parent.load(vmstate, memory)
            fork = WORK / f"f{i}"
            fork.mkdir()
            t = time.perf_counter()
            parent.diff(fork)
            parent.call("PATCH", "/vm", {"state": "Resumed"})
            kids = []
            for k in range(2):
                kid = Fc(f"rawc-{i}-{k}", disk, tools, tap=f"tap{k + 1}")
                kid.load(vmstate, memory)
                kids.append(kid)
            out["fork2"].append(time.perf_counter() - t)
            for vmx in (parent, *kids):
                vmx.kill()
            for d in (snap, pause, fork):
                shutil.rmtree(d)
        print(json.dumps({k: sorted(v)[len(v) // 2] for k, v in out.items()} | {"rounds": rounds}))
    finally:
        for fc in list(LIVE):
            fc.kill()
        subprocess.run(["ip", "netns", "del", NETNS], check=False)
        shutil.rmtree(WORK, ignore_errors=True)


async def qemu(rounds: int) -> None:
    import trio

    from _floor import BenchNetns, flat_disk, floor_files, snapshot_files, template_snapshot_id, vm_config
    from aenv_node.vmm import CaptureKind, QemuDriver
    from aenv_node.vmm.capture_buffer import CaptureBuffer

    state = Path("/var/lib/aenv")
    snap = snapshot_files(state, template_snapshot_id(state))
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    driver = QemuDriver()
    flat = WORK / "flat.raw"
    await trio.to_thread.run_sync(flat_disk, snap, flat)
    buf = await trio.to_thread.run_sync(CaptureBuffer, snap["shape"]["mem_mib"] << 20)  # the node keeps one too
    out: dict[str, list[float]] = {"restore": [], "pause": [], "snapshot": [], "fork2": []}

    async def prepared(name: str) -> tuple[object, object]:
        wd = WORK / name
        wd.mkdir()
        await trio.to_thread.run_sync(subprocess.run, ["cp", "--sparse=always", str(flat), str(wd / "disk.raw")])
        files = await trio.to_thread.run_sync(floor_files, snap, wd)  # untimed, like the disk copy
        return wd, files

    try:
        with BenchNetns(0, "aenvraw") as ns0, BenchNetns(1, "aenvraw") as ns1, BenchNetns(2, "aenvraw") as ns2:
            for i in range(rounds):
                wd, files = await prepared(f"r{i}")
                t = time.perf_counter()
                async with driver.restore(vm_config(snap, wd, wd / "disk.raw", ns0.path, "raw"), files) as vm:
                    out["restore"].append(time.perf_counter() - t)
                    await trio.sleep(1)
                    t = time.perf_counter()
                    await vm.capture(wd / "s.vmstate", wd / "s.memory", kind=CaptureKind.DIFF, buffer=buf)
                    await vm.resume()
                    out["snapshot"].append(time.perf_counter() - t)
                    await trio.sleep(0.5)
                    t = time.perf_counter()
                    await vm.capture(wd / "p.vmstate", wd / "p.memory", kind=CaptureKind.DIFF, buffer=buf)
                    await vm.stop()
                out["pause"].append(time.perf_counter() - t)
                # fork of two: one capture of a running parent, then two concurrent restores of the template
                kids = [await prepared(f"r{i}k{k}") for k in range(2)]
                pwd, pfiles = await prepared(f"r{i}p")
                async with driver.restore(vm_config(snap, pwd, pwd / "disk.raw", ns0.path, "rawp"), pfiles) as vm:
                    t = time.perf_counter()
                    await vm.capture(pwd / "f.vmstate", pwd / "f.memory", kind=CaptureKind.DIFF, buffer=buf)
                    await vm.resume()
                    up: list[float] = []
                    both = trio.Event()

                    async def child(wd: Path, files: object, ns: BenchNetns) -> None:
                        async with driver.restore(vm_config(snap, wd, wd / "disk.raw", ns.path, "rawc"), files):
                            up.append(time.perf_counter())
                            if len(up) == 2:
                                both.set()
                            await both.wait()

                    async with trio.open_nursery() as nursery:
                        for (kwd, kfiles), ns in zip(kids, (ns1, ns2)):
                            nursery.start_soon(child, kwd, kfiles, ns)
                    out["fork2"].append(max(up) - t)
                for d in WORK.glob(f"r{i}*"):
                    shutil.rmtree(d, ignore_errors=True)
                print("raw round", i, {k: round(v[-1], 3) for k, v in out.items()}, flush=True)
    finally:
        buf.close()
        shutil.rmtree(WORK, ignore_errors=True)
    print(json.dumps({k: sorted(v)[len(v) // 2] for k, v in out.items()} | {"rounds": rounds}))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    vmm = sys.argv[1] if len(sys.argv) > 1 else "firecracker"
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    if vmm == "qemu":
        import trio

        trio.run(qemu, n)
    else:
        firecracker(n)
