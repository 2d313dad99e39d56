"""``StableLinks``: a VMM process sees fixed paths pointing at this process's own files, in a mount namespace of
its own, while the host and other processes see the directory empty (what makes Firecracker snapshots
restorable with each sandbox's own disk under the path the snapshot recorded)."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import pytest
import trio

from aenv_node.vmm import CgroupError, Cgroups, VmmLimits
from aenv_node.vmm import process as process_mod
from aenv_node.vmm.process import StableLinks, read_pid_file, vmm_process


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


@pytest.mark.parametrize("via", ["helper", "shell"])
async def test_both_launch_paths_prepare_the_vmm_the_same(tmp_path: Path, netns: Path, via: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """``aenv-vmm-exec`` (scripts/setup.d compiles it) and the shell/nsenter/unshare chain without it: the
    process is in its cgroup, its pid file names it (the pid we hold), it runs in the network namespace and
    sees its stable link, and it is the program started, exec'd in place."""
    if via == "helper":
        assert process_mod.vmm_exec_helper() is not None, "scripts/setup.d did not install aenv-vmm-exec"
    else:
        monkeypatch.setattr(process_mod, "vmm_exec_helper", lambda: None)
    try:
        cgroups = Cgroups.detect("t" + secrets.token_hex(2))
    except CgroupError as exc:
        pytest.skip(f"no usable cgroups here: {exc}")
    cg = VmmLimits(cgroups, memory_overhead_mib=64, pids=50).create("aenv-vm1", vcpus=1, mem_mib=128)
    disk = tmp_path / "disk"
    disk.write_text("the disk\n")
    links = StableLinks(tmp_path / "stable", (("vd0", disk),))
    out, pid_file = tmp_path / "out", tmp_path / "run" / "vmm.pid"
    script = (f"cat /proc/self/cgroup {links.path('vd0')} > {out}.tmp; cat /proc/self/net/dev >> {out}.tmp; "
              f"echo $$ >> {out}.tmp; mv {out}.tmp {out}; exec sleep 60")
    try:
        async with vmm_process(["/bin/sh", "-c", script], log_path=tmp_path / "log", stable_links=links,
                               netns=netns, pid_file=pid_file, cgroup=cg) as proc:
            with trio.fail_after(10):
                while not out.exists():
                    await trio.sleep(0.02)
            seen = out.read_text()
            assert read_pid_file(pid_file) == proc.pid and seen.endswith(f"\n{proc.pid}\n"), (seen, proc.pid)
            assert "the disk\n" in seen and "tap0:" in seen and "eth0:" not in seen, seen  # the link, and the namespace's own tap
            for d in cg.dirs:
                assert f"/{d.parent.name}/{d.name}\n" in seen, (d, seen)
            assert Path(f"/proc/{proc.pid}/cmdline").read_bytes().startswith(b"sleep\0")  # exec'd in place
        assert not pid_file.exists() and not any(d.exists() for d in cg.dirs)
        assert os.listdir(links.dir) == []
    finally:
        for name in cgroups.leftovers():
            cgroups.of(name).remove()
        cgroups.remove_roots()
