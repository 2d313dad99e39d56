"""Firecracker under its jailer (``aenv_node/vmm/firecracker/jail.py``): real Firecracker 1.12.1 + jailer and the tiny
guest under this host's KVM.

* boot: the VMM runs as the jail's uid and gid (no supplementary groups, no capabilities), chrooted
  (``/proc/PID/root`` is the jail's root and holds only what was put there) in a mount namespace of its own, in
  the slot's network namespace with the slot's tap (handed to its uid first), with a read-only and a writable
  file drive (hard links; only the writable one is given to the jail's uid) and a block device (a node of the
  jail's own: the host's keeps its owner);
* capture and restore: capture files come out of the chroot owned by the node; a restore in a new jail continues
  where the guest was, its dirty pages readable; a Diff of it, merged, restores unjailed too (drives at the
  same paths either way);
* its cgroup is joined before the jailer runs, which makes none of its own; a second VM of the same name is
  refused without touching the first;
* a kill, and starts that fail before or in the jailer or in Firecracker, leave no chroot, process, mount,
  cgroup or socket;
* take-over: a VM its owner detached runs on in its jail in a data plane (its disk a FUSE export owned by the
  jail's uid, bind-mounted into the chroot in the VMM's own mount namespace); a sweep keeps it; the next owner
  attaches and captures it, and leaving removes everything; the jail of a VMM that died unowned is swept;
* the node's config: ``vmm.jailer*`` reach the driver and the disk frontend, and a VM of that driver runs as
  configured; a jailer that could not work is refused when the node's parts are built.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import trio

from aenv_node.dataplane import DataPlaneClient
from aenv_node.storage import LayerRef
from aenv_node.storage.frontends import DiskFrontend, FrontendKind
from aenv_node.storage.importer import import_raw
from aenv_node.vmm import (
    Accel,
    CaptureKind,
    CgroupError,
    Cgroups,
    Drive,
    FirecrackerDriver,
    JailerConfig,
    NetIf,
    SnapshotFiles,
    SnapshotFormat,
    VmmConfigError,
    VmmLimits,
    VmmStartError,
    VmState,
    detect_accel,
    memfile,
)
from aenv_node.vmm.firecracker.driver import DEFAULT_FIRECRACKER
from aenv_node.vmm.firecracker.jail import DEFAULT_JAILER

from .test_devices import tap_flags
from .test_vm_lifecycle import alive
from .tinyguest import PAGE, console_ticks, image_status, last_tick, tiny_config, wait_for_tick

pytestmark = pytest.mark.vm

UID, GID = 4242, 4343  # not nobody, and not each other: a swap or a default shows
MAC = "06:00:ac:10:00:02"


@pytest.fixture
def jailer(workroot: Path) -> JailerConfig:
    if not detect_accel().kvm:
        pytest.skip("/dev/kvm is not usable on this host")
    if not (DEFAULT_FIRECRACKER.is_file() and DEFAULT_JAILER.is_file()):
        pytest.skip("firecracker/jailer not installed (scripts/setup.d/30-firecracker.sh)")
    return JailerConfig(chroot_base=workroot / "jail", uid=UID, gid=GID)


@pytest.fixture
def kernel(tiny_kernel: Path, workroot: Path) -> Path:
    """The tiny guest on the jail's filesystem, root's and readable by all, as a guest kit's kernel is."""
    k = workroot / "tiny.elf"
    shutil.copyfile(tiny_kernel, k)
    k.chmod(0o644)
    return k


@pytest.fixture
def loop_device(workroot: Path) -> Iterator[Path]:
    """A block device (a loop device over a 1 MiB file), as a ublk disk is one."""
    backing = workroot / "loop.img"
    with open(backing, "wb") as f:
        f.truncate(1 << 20)
    out = subprocess.run(["losetup", "-f", "--show", str(backing)], capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip(f"no loop device: {out.stderr.strip()}")
    dev = Path(out.stdout.strip())
    try:
        yield dev
    finally:
        subprocess.run(["losetup", "-d", str(dev)], check=False)


def jail_dir(j: JailerConfig, name: str) -> Path:
    return j.chroot_base / "firecracker" / name


def same_file(a: str | Path, b: str | Path) -> bool:
    sa, sb = os.stat(a), os.stat(b)
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def status(pid: int) -> dict[str, list[str]]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        out[key] = value.split()
    return out


def assert_jailed(pid: int, j: JailerConfig, name: str) -> None:
    """``pid`` is a Firecracker running as the jail's uid and gid, with no privileges, in its own chroot."""
    st = status(pid)
    assert st["Uid"] == [str(j.uid)] * 4 and st["Gid"] == [str(j.gid)] * 4, (st["Uid"], st["Gid"])
    assert st["Groups"] == [] and st["CapEff"] == ["0000000000000000"], (st["Groups"], st["CapEff"])
    root = jail_dir(j, name) / "root"
    assert same_file(f"/proc/{pid}/root", root), "its / must be the jail's root"
    assert os.stat(f"/proc/{pid}/ns/mnt").st_ino != os.stat("/proc/self/ns/mnt").st_ino
    seen = set(os.listdir(f"/proc/{pid}/root"))
    assert {"firecracker", "dev", "run"} <= seen and not seen & {"etc", "proc", "usr", "bin", "sys", "home"}, seen
    assert same_file(f"/proc/{pid}/exe", root / "firecracker"), "it runs the jail's copy of Firecracker"


def host_mounts_under(path: Path) -> list[str]:
    return [ln.split()[4] for ln in Path("/proc/self/mountinfo").read_text().splitlines()
            if ln.split()[4].startswith(str(path))]


def assert_nothing_left(j: JailerConfig, name: str, pid: int | None, socket: Path) -> None:
    if pid is not None:
        assert not alive(pid), f"VMM {pid} still runs"
    assert not jail_dir(j, name).exists(), f"the jail {jail_dir(j, name)} is left"
    assert not os.path.lexists(socket), f"the API socket link {socket} is left"
    assert host_mounts_under(j.chroot_base) == []


async def test_a_jailed_vm_boots_captures_and_restores(jailer: JailerConfig, kernel: Path, workroot: Path,
                                                      netns: Path, loop_device: Path) -> None:
    fc = FirecrackerDriver(jailer=jailer)
    ro, rw = workroot / "ro.img", workroot / "rw.img"
    for f in (ro, rw):
        with open(f, "wb") as fh:
            fh.truncate(1 << 20)
    drives = (Drive(str(ro), read_only=True), Drive(str(rw)), Drive(str(loop_device)))
    cfg = tiny_config(workroot / "vm", kernel, name="aenv-jail-1", net=NetIf(tap="tap0", mac=MAC), netns=netns,
                      drives=drives)
    snap = workroot / "snap"
    snap.mkdir()
    async with fc.boot(cfg) as vm:
        pid = vm.pid
        await wait_for_tick(cfg.console_path, 2)
        assert_jailed(pid, jailer, cfg.name)
        # the slot's network namespace and tap, the tap handed to the jail's uid/gid (it has no CAP_NET_ADMIN)
        assert same_file(f"/proc/{pid}/ns/net", netns)
        assert "LOWER_UP" in tap_flags(netns)
        owner = subprocess.run(["ip", "netns", "exec", netns.name, "cat", "/sys/class/net/tap0/owner",
                                "/sys/class/net/tap0/group"], capture_output=True, text=True, check=True).stdout
        assert owner.split() == [str(UID), str(GID)]
        # the drives it holds open: the files themselves (hard links) and a node of the loop device
        held = [os.stat(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()]
        for f in (ro, rw):
            assert (f.stat().st_dev, f.stat().st_ino) in {(s.st_dev, s.st_ino) for s in held}, f
        assert loop_device.stat().st_rdev in {s.st_rdev for s in held if stat.S_ISBLK(s.st_mode)}
        node = jail_dir(jailer, cfg.name) / "root" / "run" / "aenv-vm" / "vd2"
        assert stat.S_ISBLK(node.stat().st_mode) and (node.stat().st_uid, node.stat().st_gid) == (UID, GID)
        assert loop_device.stat().st_uid == 0, "the host's device node keeps its owner"
        assert (rw.stat().st_uid, ro.stat().st_uid, kernel.stat().st_uid) == (UID, 0, 0), \
            "only what it writes is given to the jail's uid"
        full = await vm.capture(snap / "vmstate", snap / "memory")
        assert vm.state is VmState.PAUSED
    assert_nothing_left(jailer, cfg.name, pid, cfg.socket_path)
    assert "LOWER_UP" not in tap_flags(netns)
    assert (cfg.workdir / "firecracker.log").exists(), "its log is kept for a post-mortem"
    for f in (full.vmstate, full.memory):  # out of the chroot, and no jailed VMM may write what others map
        assert f.stat().st_uid == os.geteuid() and not f.stat().st_mode & 0o022
    assert full.memory.stat().st_size == cfg.mem_bytes

    _, tick = image_status(full.memory)
    cfg2 = tiny_config(workroot / "r", kernel, name="aenv-jail-2", net=cfg.net, netns=netns, drives=drives)
    async with fc.restore(cfg2, full.snapshot_files()) as vm2:
        pid2 = vm2.pid
        await wait_for_tick(cfg2.console_path, tick + 20)
        assert console_ticks(cfg2.console_path)[0] in (tick, tick + 1), "it continues where it was captured"
        assert_jailed(pid2, jailer, cfg2.name)
        dirty = await vm2.dirty_memory_ranges()  # the pagemap of its (hard-linked) image
        assert 0 < sum(r.length for r in dirty) < 64 * PAGE
        diff = await vm2.capture(workroot / "d.vmstate", workroot / "d.memory", kind=CaptureKind.DIFF)
    assert_nothing_left(jailer, cfg2.name, pid2, cfg2.socket_path)
    assert diff.kind is CaptureKind.DIFF and 0 < diff.dirty_bytes < 32 * PAGE
    assert diff.memory.stat().st_uid == os.geteuid()

    # the merged image restores without the jailer: its drives are at the same paths in both
    merged = workroot / "merged.memory"
    await trio.to_thread.run_sync(memfile.materialize, full.memory, [(diff.memory, diff.dirty_ranges)], merged)
    _, at = image_status(merged)
    cfg3 = tiny_config(workroot / "u", kernel, name="aenv-plain", net=cfg.net, netns=netns, drives=drives)
    async with FirecrackerDriver().restore(cfg3, diff.snapshot_files(merged)) as vm3:
        await wait_for_tick(cfg3.console_path, at + 3)
        assert console_ticks(cfg3.console_path)[0] in (at, at + 1)
        assert status(vm3.pid)["Uid"][0] == "0"

    # a snapshot on another filesystem (a tmpfs here) cannot be linked into the jail: it is bind-mounted, in the
    # VMM's own mount namespace
    shm = Path(tempfile.mkdtemp(prefix="aenv-jail-", dir="/dev/shm"))
    try:
        if os.stat(shm).st_dev == os.stat(workroot).st_dev:
            pytest.skip("/dev/shm is on the work directory's filesystem")
        far = SnapshotFiles(shm / "vmstate", shm / "memory", SnapshotFormat.FIRECRACKER)
        shutil.copyfile(diff.vmstate, far.vmstate)
        shutil.copyfile(merged, far.memory)
        cfg4 = tiny_config(workroot / "x", kernel, name="aenv-jail-4", net=cfg.net, netns=netns, drives=drives)
        async with fc.restore(cfg4, far) as vm4:
            pid4 = vm4.pid
            await wait_for_tick(cfg4.console_path, at + 3)
            assert console_ticks(cfg4.console_path)[0] in (at, at + 1)
            assert_jailed(pid4, jailer, cfg4.name)
            assert f" /files{shm}/memory " in Path(f"/proc/{pid4}/mountinfo").read_text()
        assert_nothing_left(jailer, cfg4.name, pid4, cfg4.socket_path)
    finally:
        shutil.rmtree(shm, ignore_errors=True)


async def test_cgroup_kill_and_failed_starts_leave_nothing(jailer: JailerConfig, kernel: Path,
                                                           workroot: Path) -> None:
    try:
        cgroups = Cgroups.detect("t" + secrets.token_hex(2))
    except CgroupError as exc:
        pytest.skip(f"no usable cgroups here: {exc}")
    jailer_own = [root.parent / "firecracker" for root in cgroups.roots]  # where the jailer's cgroups would go
    before = [p.exists() for p in jailer_own]
    fc = FirecrackerDriver(jailer=jailer)
    fc.limits = VmmLimits(cgroups, memory_overhead_mib=64, pids=64)
    cfg = tiny_config(workroot / "vm", kernel, name="aenv-jail-cg")
    cg = cgroups.of(cfg.name)
    try:
        async with fc.boot(cfg) as vm:
            pid = vm.pid
            await wait_for_tick(cfg.console_path, 2)
            assert_jailed(pid, jailer, cfg.name)
            mine = Path(f"/proc/{pid}/cgroup").read_text()
            for d in cg.dirs:
                assert f"/{d.parent.name}/{d.name}\n" in mine, (d, mine)
            assert cg.members() == {pid}
            assert [p.exists() for p in jailer_own] == before, "the jailer made cgroups of its own"
            # a second VM of the name is refused, by this driver and by another (a next run of the node), and
            # the first keeps its jail
            again = tiny_config(workroot / "again", kernel, name=cfg.name)
            for driver in (fc, FirecrackerDriver(jailer=jailer)):
                with pytest.raises(VmmConfigError, match="unique"):
                    async with driver.boot(again):
                        pass
            assert (jail_dir(jailer, cfg.name) / "root" / "firecracker").exists()
            seen = last_tick(cfg.console_path)
            assert seen is not None
            await wait_for_tick(cfg.console_path, seen + 2)
            await vm.stop()  # SIGKILL
            assert not alive(pid)
        assert_nothing_left(jailer, cfg.name, pid, cfg.socket_path)
        assert not any(d.exists() for d in cg.dirs)

        # starts that fail: before the jailer (an input the jail's uid cannot read), in the jailer (a network
        # namespace that does not exist), in Firecracker (a kernel that is no ELF)
        secret = workroot / "secret.elf"
        shutil.copyfile(kernel, secret)
        secret.chmod(0o600)
        junk = workroot / "junk.elf"
        junk.write_bytes(b"not a kernel" * 100)
        junk.chmod(0o644)
        failing = [
            (tiny_config(workroot / "f1", secret, name="aenv-jail-f1"), VmmConfigError, "not readable by the jail"),
            (tiny_config(workroot / "f2", kernel, name="aenv-jail-f2", netns=workroot / "no-such-netns"),
             VmmStartError, "exited"),
            (tiny_config(workroot / "f3", junk, name="aenv-jail-f3"), VmmStartError, "booting the VM"),
        ]
        for bad, error, message in failing:
            with pytest.raises(error, match=message):
                async with fc.boot(bad):
                    pass
            assert_nothing_left(jailer, bad.name, None, bad.socket_path)
            assert not any(d.exists() for d in cgroups.of(bad.name).dirs)
        assert cgroups.leftovers() == [] and not any(root.exists() for root in cgroups.roots)
        assert [p.exists() for p in jailer_own] == before
    finally:
        for name in cgroups.leftovers():
            cgroups.of(name).remove()
        cgroups.remove_roots()


@pytest.fixture
async def dataplane(workroot: Path) -> AsyncIterator[Path]:
    """A data plane in a process of its own, as a node runs it (one in this Trio run could not answer the blocking
    call a client makes for the exit status of a VMM that ended: a failure would hang instead of failing); its
    run directory."""
    run_dir = workroot / "dp"
    code = ("import sys, trio; from pathlib import Path; from aenv_node.dataplane import serve_dataplane; "
            "trio.run(serve_dataplane, Path(sys.argv[1]))")
    with open(workroot / "dataplane.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-c", code, str(run_dir)], stdin=subprocess.DEVNULL, stdout=log,
                                stderr=log, start_new_session=True)
    try:
        client = DataPlaneClient(run_dir, DiskFrontend())
        with trio.fail_after(30):
            while await client.ping() is None:
                assert proc.poll() is None, (workroot / "dataplane.log").read_text()
                await trio.sleep(0.05)
        yield run_dir
    finally:
        proc.send_signal(signal.SIGTERM)  # it stops every VMM and disk it still holds
        try:
            await trio.to_thread.run_sync(proc.wait, 30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def test_a_detached_jailed_vm_runs_on_and_is_taken_over(jailer: JailerConfig, kernel: Path, workroot: Path,
                                                              dataplane: Path) -> None:
    raw = workroot / "base.raw"
    raw.write_bytes(b"\x5a" * (1 << 20))
    layers = workroot / "layers"
    layers.mkdir()
    layer = import_raw(raw, layers, virtual_size=4 << 20)
    snap = workroot / "snap"
    snap.mkdir()
    # a jailed VMM opens its FUSE-exported disk as the jail's user: the data plane exports it as that user's
    client = DataPlaneClient(dataplane, DiskFrontend(FrontendKind.FUSE, owner=(UID, GID)))
    disk = await client.open_disk("sbx1", [LayerRef.local(layer.path)], workroot / "upper", workroot / "run")
    try:
        source = Path(disk.source)
        assert (source.stat().st_uid, source.stat().st_gid) == (UID, GID)
        fc = FirecrackerDriver(jailer=jailer)
        fc.spawner = client.spawn
        drives = (Drive(disk.source),)
        boot = tiny_config(workroot / "boot", kernel, name="aenv-jail-boot", drives=drives)
        async with fc.boot(boot) as vm:
            await wait_for_tick(boot.console_path, 3)
            base = await vm.capture(snap / "vmstate", snap / "memory")
        _, base_tick = image_status(base.memory)

        cfg = tiny_config(workroot / "vm", kernel, name="aenv-jail-to", pid_file=workroot / "vm.pid",
                          drives=drives)
        async with fc.restore(cfg, base.snapshot_files()) as vm:
            pid = vm.pid
            await wait_for_tick(cfg.console_path, base_tick + 3)
            assert_jailed(pid, jailer, cfg.name)
            # the disk: bind-mounted into the chroot in the VMM's own mount namespace, not on the host
            assert " /run/aenv-vm/vd0 " in Path(f"/proc/{pid}/mountinfo").read_text()
            assert host_mounts_under(jailer.chroot_base) == []
            assert any(same_file(fd, source) for fd in Path(f"/proc/{pid}/fd").iterdir())
            vm.detach()
        assert alive(pid) and await client.children() == {pid: "aenv-jail-to"}
        assert (jail_dir(jailer, cfg.name) / "root").is_dir() and cfg.socket_path.is_symlink()
        seen = last_tick(cfg.console_path)
        assert seen is not None
        await wait_for_tick(cfg.console_path, seen + 2)  # it runs on with no owner

        after = FirecrackerDriver(jailer=jailer)  # the next run of the node
        after.spawner = client.spawn
        assert await after.sweep_jails() == [], "a jail whose VMM runs is kept"
        async with after.attach(cfg, base.snapshot_files(), client.adopt(pid)) as taken:
            assert taken.pid == pid and taken.state is VmState.RUNNING
            now = last_tick(cfg.console_path)
            assert now is not None
            await wait_for_tick(cfg.console_path, now + 3)
            res = await taken.capture(workroot / "t.vmstate", workroot / "t.memory", kind=CaptureKind.DIFF)
            assert res.kind is CaptureKind.FULL  # the dirty log's start is unknown after a take-over
        assert_nothing_left(jailer, cfg.name, pid, cfg.socket_path)
        assert await client.children() == {}
        _, at = image_status(res.memory)
        assert at >= now + 3

        # a VMM that died with nobody owning it (a data plane stopped with it): its jail is swept
        dead = tiny_config(workroot / "dead", kernel, name="aenv-jail-dead", drives=drives)
        async with after.restore(dead, base.snapshot_files()) as vm:
            dead_pid = vm.pid
            vm.detach()
        os.kill(dead_pid, signal.SIGKILL)
        assert await after.sweep_jails(wait_for=[dead_pid]) == ["aenv-jail-dead"]
        assert not jail_dir(jailer, dead.name).exists()
    finally:
        await trio.to_thread.run_sync(disk.close)


async def test_the_node_runs_firecracker_jailed_from_its_config(kernel: Path, workroot: Path) -> None:
    """``vmm.jailer*`` reach the node's driver and disk frontend; its VMs run as configured; a jailer that could
    not work is refused when the node's parts are built."""
    from aenv_node.config import ConfigError, load_config
    from aenv_node.runtime.parts import NodeParts
    from aenv_node.state import Database

    if not detect_accel().kvm or not DEFAULT_JAILER.is_file():
        pytest.skip("needs /dev/kvm and the jailer")

    def parts(name: str, **vmm: object) -> NodeParts:
        cfg = load_config(environ={}, overrides={
            "node": {"state_dir": str(workroot / name), "data_plane": False}, "net": {"egress": False},
            "vmm": {"kind": "firecracker", "accel": "kvm", "cgroups": False, **vmm}})
        cfg.state_dir.mkdir(parents=True)
        db = Database(cfg.database_path)
        try:
            return NodeParts.build(cfg, db, "n1")
        finally:
            db.close()

    off = parts("off")
    assert isinstance(off.driver, FirecrackerDriver) and off.driver.jailer is None and off.frontend.owner is None

    # the jailer binary named by the config is the one that runs (a wrapper that leaves a mark)
    mark = workroot / "jailer-ran"
    wrapper = workroot / "bin" / "jailer"
    wrapper.parent.mkdir()
    wrapper.write_text(f'#!/bin/sh\necho "$@" > {mark}\nexec {DEFAULT_JAILER} "$@"\n')
    wrapper.chmod(0o755)
    on = parts("on", jailer=True, jailer_uid=UID, jailer_gid=GID, jailer_binary=str(wrapper))
    driver = on.driver
    assert isinstance(driver, FirecrackerDriver)
    assert driver.jailer == JailerConfig(binary=wrapper, chroot_base=workroot / "on" / "jailer", uid=UID, gid=GID)
    assert on.frontend.owner == (UID, GID)
    cfg = tiny_config(workroot / "vm", kernel, name="aenv-node-jail")
    async with driver.boot(cfg) as vm:
        await wait_for_tick(cfg.console_path, 2)
        assert_jailed(vm.pid, driver.jailer, cfg.name)  # under <state_dir>/jailer, as uid/gid
    assert f"--uid {UID} --gid {GID} --chroot-base-dir {workroot / 'on' / 'jailer'}" in mark.read_text()
    assert not jail_dir(driver.jailer, cfg.name).exists()

    elsewhere = parts("base", jailer=True, jailer_chroot_base=str(workroot / "elsewhere"))
    assert isinstance(elsewhere.driver, FirecrackerDriver) and elsewhere.driver.jailer is not None
    assert elsewhere.driver.jailer.chroot_base == workroot / "elsewhere"

    if detect_accel().linux_guests is not Accel.KVM:  # auto picks QEMU on a PVM host such as this one
        with pytest.raises(ConfigError, match="chose qemu"):
            parts("qemu", jailer=True, kind="auto", accel="auto")
    if os.stat("/dev/shm").st_dev != os.stat(workroot).st_dev:
        with pytest.raises(ConfigError, match="not on the filesystem of the snapshots"):
            parts("shm", jailer=True, jailer_chroot_base="/dev/shm/aenv-jail")
