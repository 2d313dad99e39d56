"""Runs INSIDE the KVM host VM (bench/kvmhost.py copies nothing: it is on the project drive): the raw VMM
operations the node's create, pause, resume, snapshot and fork are built on, on the node's own template snapshot.

Firecracker: a fresh process per restore, ``PUT /snapshot/load`` (memory file mapped copy-on-write) and resume;
pause = ``PATCH /vm Paused`` + a Diff ``/snapshot/create``; snapshot = pause + Diff + ``Resumed``; fork of N = one
Diff capture of the parent + N restores. Only raw API calls over the unix socket, none of our driver code, so the
figures are the floor under the node's. Prints one JSON object.
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


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
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


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
