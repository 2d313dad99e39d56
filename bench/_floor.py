"""Raw-QEMU floors for the benchmarks: restore a snapshot the node recorded with the driver alone, disks as
plain files, on a tap addressed like a node slot's guest side.

One copy for `lifecycle.py` and `sandbox_create.py`, which measure the node against the same floor.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import time
from pathlib import Path
from typing import Any

from aenv_node.storage import LayerReader, materialize
from aenv_node.vmm import (
    Accel,
    BalloonConfig,
    Drive,
    MemoryMode,
    NetIf,
    SnapshotFiles,
    SnapshotFormat,
    VmConfig,
    memfile,
)

__all__ = ["GUEST_IP", "GUEST_MAC", "TAP", "TAP_CIDR", "TAP_MAC", "BenchNetns", "flat_disk", "floor_files",
           "run_cmd", "snapshot_files", "template_snapshot_id", "vm_config"]

# A node slot's guest side (net.NetworkConfig defaults): identical in every slot, baked into the snapshot
GUEST_MAC = "02:ae:00:00:00:21"
GUEST_IP = "169.254.0.21"
TAP = "tap0"
TAP_MAC = "02:ae:00:00:00:22"
TAP_CIDR = "169.254.0.22/30"


def _connect(state_dir: Path) -> sqlite3.Connection:
    return sqlite3.connect(f"file:{state_dir / 'aenv.db'}?mode=ro", uri=True, timeout=10)


def template_snapshot_id(state_dir: Path, template: str = "base") -> str:
    """The boot snapshot of a template (by id or alias)."""
    con = _connect(state_dir)
    try:
        row = con.execute("SELECT boot_snapshot_id FROM templates WHERE id = ? OR alias = ?",
                          (template, template)).fetchone()
    finally:
        con.close()
    if row is None or row[0] is None:
        raise RuntimeError(f"no boot snapshot recorded for template {template!r} in {state_dir}")
    return str(row[0])


def snapshot_files(state_dir: Path, snapshot_id: str) -> dict[str, Any]:
    """A snapshot as the node recorded it: vmstate, memory image, format, shape, disk layers."""
    con = _connect(state_dir)
    try:
        row = con.execute("SELECT config, vmstate_location, vmstate_format, memory_location FROM snapshots WHERE id = ?",
                          (snapshot_id,)).fetchone()
        if row is None:
            raise RuntimeError(f"snapshot {snapshot_id} not recorded in {state_dir}")
        layers = con.execute(
            "SELECT l.local_path, l.virtual_size_bytes FROM snapshot_layers sl JOIN layers l"
            " ON l.digest = sl.layer_digest WHERE sl.snapshot_id = ? AND sl.kind = 'disk' ORDER BY sl.position",
            (snapshot_id,)).fetchall()
    finally:
        con.close()
    cfg = json.loads(row[0]) if isinstance(row[0], str) else row[0]
    # a user snapshot's flat memory image is made a moment after its answer (capture.py defer_flat_image)
    deadline = time.monotonic() + 120
    while not Path(row[3]).exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"the memory image of snapshot {snapshot_id} ({row[3]}) was not made")
        time.sleep(0.2)
    return {"id": snapshot_id, "shape": cfg["shape"], "format": row[2], "memory": row[3],
            "vmstate": row[1], "disk_layers": [loc for loc, _ in layers],
            "disk_size": max(v or 0 for _, v in layers)}  # fmt: skip


def run_cmd(*argv: str) -> None:
    p = subprocess.run(argv, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {p.stderr.strip()}")


class BenchNetns:
    """A network namespace with a tap `tap0` addressed like a node slot's guest side (no veth: only the
    bench, from inside the namespace, talks to the guest). Created and removed here."""

    def __init__(self, index: int = 0, prefix: str = "aenvbench") -> None:
        self.name = f"{prefix}-{os.getpid()}-{index}"
        self.path = Path("/run/netns") / self.name

    def __enter__(self) -> "BenchNetns":
        run_cmd("ip", "netns", "add", self.name)
        try:
            run_cmd("ip", "-n", self.name, "tuntap", "add", "dev", TAP, "mode", "tap")
            run_cmd("ip", "-n", self.name, "link", "set", TAP, "address", TAP_MAC)
            run_cmd("ip", "-n", self.name, "addr", "add", TAP_CIDR, "dev", TAP)
            run_cmd("ip", "-n", self.name, "link", "set", TAP, "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)


def flat_disk(snap: dict[str, Any], dest: Path) -> float:
    """The snapshot's disk layers flattened into one raw file (the floor VM's disk); seconds taken."""
    t = time.perf_counter()
    readers = [LayerReader.open(p) for p in snap["disk_layers"]]
    try:
        materialize(readers, dest, size=snap["disk_size"], fsync=False)
    finally:
        for r in readers:
            r.close()
    return time.perf_counter() - t


def vm_config(snap: dict[str, Any], wd: Path, disk: Path, netns: Path, name: str) -> VmConfig:
    """The snapshot's VM shape with a plain-file disk, on the tap in `netns`."""
    shape = snap["shape"]
    return VmConfig(
        workdir=wd, kernel=Path(shape["kernel"]), vcpus=shape["vcpus"], mem_mib=shape["mem_mib"],
        initrd=Path(shape["initrd"]) if shape["initrd"] else None, cmdline=shape["cmdline"],
        # (a VM imported without the guest kit has no initrd and no tools image)
        drives=(Drive(str(disk)),) + ((Drive(shape["tools_img"], read_only=True),) if shape["tools_img"] else ()),
        net=NetIf(tap=TAP, mac=GUEST_MAC), mem_mode=MemoryMode.PRIVATE,
        api_socket=wd / "qmp.sock", console_log=wd / "console.log", netns=netns,
        accel=Accel(shape["accel"]), name=name,
        # the same devices as the snapshot; with free page reporting each floor VM maps its own copy of the
        # image (floor_files), which is what makes reporting safe without the node's seccomp guard
        balloon=BalloonConfig(free_page_reporting=True) if shape.get("free_page_reporting") else None,
        mem_exclusive=bool(shape.get("free_page_reporting")),
    )  # fmt: skip


def floor_files(snap: dict[str, Any], wd: Path) -> SnapshotFiles:
    """The snapshot's files for one floor VM: its own copy of the memory image when the VM reports free
    pages (untimed; a raw QEMU VM would punch holes in a shared one)."""
    memory = Path(snap["memory"])
    if snap["shape"].get("free_page_reporting"):
        own = wd / "memory.img"
        memfile.copy_image(memory, own)
        memory = own
    return SnapshotFiles(Path(snap["vmstate"]), memory, SnapshotFormat(snap["format"]))
