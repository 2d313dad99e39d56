"""VMM resource limits (``aenv_node/vmm/cgroup.py``) on this host's real cgroups, with plain processes standing in
for a VMM (``vmm_process`` starts them as it starts a VMM):

* the process is in its cgroup from its first instruction (it reads its own /proc/self/cgroup), with the
  limits written, and the cgroup goes when the process is reaped;
* the kernel enforces them: a memory hog past the limit is OOM-killed alone, a fork bomb runs into the task
  limit, a busy loop gets its CPU quota and no more;
* a cgroup left by a node that crashed (no process in it) is swept, one with its VMM still running is kept;
  the node's roots exist only while they hold a VMM.
"""

from __future__ import annotations

import os
import secrets
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from aenv_node.vmm import CgroupError, Cgroups, ResourceLimits, VmmLimits
from aenv_node.vmm.process import vmm_process


@pytest.fixture
def cgroups() -> Iterator[Cgroups]:
    try:
        cg = Cgroups.detect("t" + secrets.token_hex(2))
    except CgroupError as exc:
        pytest.skip(f"no usable cgroups here: {exc}")
    yield cg
    for name in cg.leftovers():
        cg.of(name).remove()
    assert cg.remove_roots()


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def test_a_process_starts_in_its_cgroup_with_its_limits_and_it_goes_with_it(cgroups: Cgroups,
                                                                                   tmp_path: Path) -> None:
    limits = VmmLimits(cgroups, memory_overhead_mib=64, pids=50)
    cg = limits.create("aenv-vm1", vcpus=1, mem_mib=128)
    out = tmp_path / "cgroup.txt"
    async with vmm_process([sys.executable, "-c", f"import time; open({str(out)!r}, 'w').write("
                            "open('/proc/self/cgroup').read()); time.sleep(60)"],
                           log_path=tmp_path / "log", cgroup=cg) as proc:
        with trio.fail_after(10):
            while not out.exists() or not out.read_text():
                await trio.sleep(0.02)
        mine = out.read_text()  # what the process saw of itself before it did anything else
        for d in cg.dirs:
            assert f"/{d.parent.name}/{d.name}\n" in mine, (d, mine)
        assert cg.members() == {proc.pid}
        if cgroups.version == 1:  # dirs: cpu, memory, pids
            assert (cg.dirs[1] / "memory.limit_in_bytes").read_text().strip() == str((128 + 64) << 20)
            assert (cg.dirs[0] / "cpu.cfs_quota_us").read_text().strip() == "200000"  # vcpus + 1 CPUs
            assert (cg.dirs[2] / "pids.max").read_text().strip() == "50"
    assert not any(d.exists() for d in cg.dirs)


async def test_the_kernel_holds_a_process_to_its_limits(cgroups: Cgroups, tmp_path: Path) -> None:
    limits = VmmLimits(cgroups, memory_overhead_mib=0, pids=20)
    # memory: 64 MiB, and a process that touches 256 MiB is killed (it alone)
    hog = "b = bytearray(256 << 20)\nfor i in range(0, len(b), 4096): b[i] = 1\nprint('survived')"
    async with vmm_process([sys.executable, "-c", hog], log_path=tmp_path / "hog.log",
                           cgroup=limits.create("aenv-hog", vcpus=1, mem_mib=64)) as proc:
        with trio.fail_after(60):
            status = await proc.wait()
    assert status == -signal.SIGKILL and "survived" not in (tmp_path / "hog.log").read_text()
    # tasks: 20, and a process that starts 100 short-lived children gets EAGAIN before the 20th
    bomb = ("import os, time\nn = 0\ntry:\n    for _ in range(100):\n        if os.fork() == 0:\n"
            "            time.sleep(2); os._exit(0)\n        n += 1\nexcept BlockingIOError:\n    print('limited at', n)\n"
            "print('forked', n, flush=True)\nwhile True:\n    try:\n        os.wait()\n    except ChildProcessError:\n"
            "        break\n")
    async with vmm_process([sys.executable, "-c", bomb], log_path=tmp_path / "bomb.log",
                           cgroup=limits.create("aenv-bomb", vcpus=1, mem_mib=256)) as proc:
        with trio.fail_after(60):
            assert await proc.wait() == 0
    log = (tmp_path / "bomb.log").read_text()
    assert "limited at" in log and int(log.split("forked")[1].split()[0]) < 20, log
    # CPU: a busy loop under a quota of 0.3 CPU (less than a VM's vcpus + 1: the limits set directly)
    cg = cgroups.create("aenv-busy", ResourceLimits(cpus=0.3, memory_bytes=256 << 20, pids=20))
    async with vmm_process([sys.executable, "-c", "while True: pass"], log_path=tmp_path / "busy.log",
                           cgroup=cg) as proc:
        await trio.sleep(0.5)
        t0, c0 = time.monotonic(), _cpu_seconds(proc.pid)
        await trio.sleep(2)
        share = (_cpu_seconds(proc.pid) - c0) / (time.monotonic() - t0)
    assert share < 0.45, share  # 0.3 CPU, with slack for the tick accounting
    assert cgroups.leftovers() == []


async def test_cgroups_left_by_a_crashed_node_are_swept_unless_their_vmm_runs(cgroups: Cgroups,
                                                                              tmp_path: Path) -> None:
    limits = VmmLimits(cgroups, memory_overhead_mib=64, pids=50)
    limits.create("aenv-gone", vcpus=1, mem_mib=64)  # its VMM died with the node: nothing in it
    async with vmm_process([sys.executable, "-c", "import time; time.sleep(60)"], log_path=tmp_path / "log",
                           cgroup=limits.create("aenv-alive", vcpus=1, mem_mib=64)):
        with trio.fail_after(10):
            while not cgroups.of("aenv-alive").members():
                await trio.sleep(0.02)
        assert limits.sweep() == ["aenv-gone"]
        assert cgroups.leftovers() == ["aenv-alive"]
        assert not cgroups.remove_roots()  # a VMM is still in one: the roots stay
    assert cgroups.leftovers() == []
    assert not any(root.exists() for root in cgroups.roots)  # the last VMM took them along


def test_the_node_gives_its_vmms_limits_from_its_config(tmp_path: Path) -> None:
    """``vmm.cgroups`` on: the node's driver puts each VMM in a cgroup sized by ``vmm.memory_overhead_mib`` and
    ``vmm.pids_max``; off: no limits."""
    from aenv_node.config import load_config
    from aenv_node.runtime.parts import NodeParts
    from aenv_node.state import Database
    from aenv_node.vmm import ResourceLimits

    for on in (True, False):
        cfg = load_config(environ={}, overrides={
            "node": {"state_dir": str(tmp_path / f"node-{on}")}, "net": {"egress": False},
            "vmm": {"cgroups": on, "memory_overhead_mib": 100, "pids_max": 77}})
        cfg.state_dir.mkdir(parents=True)
        db = Database(cfg.database_path)
        try:
            limits = NodeParts.build(cfg, db, "n1").driver.limits
        finally:
            db.close()
        if not on:
            assert limits is None
            continue
        assert limits is not None
        assert limits.for_vm(2, 512) == ResourceLimits(cpus=3, memory_bytes=612 << 20, pids=77)
        # the node's roots exist only while it holds VMMs: made by the first, taken along by the last
        assert not any(root.exists() for root in limits.cgroups.roots)
        cg = limits.create("aenv-only", vcpus=1, mem_mib=64)
        assert all(root.is_dir() for root in limits.cgroups.roots)
        cg.remove()
        assert not any(root.exists() for root in limits.cgroups.roots)
