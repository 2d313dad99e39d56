"""``StableLinks``: a VMM process sees fixed paths pointing at this process's own files, in a mount namespace of
its own, while the host and other processes see the directory empty (what makes Firecracker snapshots
restorable with each sandbox's own disk under the path the snapshot recorded)."""

from __future__ import annotations

import os
from pathlib import Path

import trio

from aenv_node.vmm.process import StableLinks, vmm_process


async def _read_through(links: StableLinks, name: str, log: Path) -> str:
    async with vmm_process(["/bin/cat", str(links.path(name))], log_path=log, stable_links=links) as proc:
        with trio.fail_after(10):
            while proc.alive():
                await trio.sleep(0.01)
    return log.read_text()


async def test_each_process_sees_its_own_targets_under_the_same_path(tmp_path: Path) -> None:
    stable = tmp_path / "stable"
    a, b = tmp_path / "disk-a", tmp_path / "disk-b"
    a.write_text("disk of sandbox A\n")
    b.write_text("disk of sandbox B\n")
    out_a = await _read_through(StableLinks(stable, (("vd0", a),)), "vd0", tmp_path / "a.log")
    out_b = await _read_through(StableLinks(stable, (("vd0", b),)), "vd0", tmp_path / "b.log")
    assert out_a == "disk of sandbox A\n" and out_b == "disk of sandbox B\n"
    # the links lived in the processes' namespaces only: nothing is mounted or left on the host
    assert os.listdir(stable) == []
    with open("/proc/self/mounts") as f:
        assert str(stable) not in f.read()
