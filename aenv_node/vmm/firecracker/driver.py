"""Firecracker behind the VMM interface, controlled over its REST API.

* boot: the VM is described in a config file passed with `--config-file` (machine-config with
  `track_dirty_pages`, boot-source, drives, network-interfaces, balloon), so Firecracker boots it without
  API round trips; the API socket stays open for everything after. Firecracker's boot RAM is anonymous
  memory, whatever `VmConfig.mem_mode` says: a capture writes the memory image.
* restore: a fresh process, `PUT /snapshot/load` with `mem_backend: {backend_type: File}`: the image is
  mapped MAP_PRIVATE (copy-on-write; page cache shared by every VM restored from it).
* capture: `PATCH /vm Paused`, `PUT /snapshot/create` Full (whole memory) or Diff (pages dirtied since
  the last snapshot or load, from KVM's dirty log: needs `track_dirty_pages`). A Diff memory file is
  sparse; its data extents are the dirty ranges.
* dirty_memory_ranges: for a restored VM, /proc/PID/pagemap over the MAP_PRIVATE image (`pagemap.py`),
  which needs no dirty log and works while the guest runs.
* stats: `FlushMetrics` + the last line of the metrics file, plus /proc readings.

Jailer: optional (`JailerConfig`). With it Firecracker runs chrooted under an unprivileged uid; every file it
opens (kernel, initrd, drives, snapshot and memory files) is hard-linked into the chroot, so they must be on
the chroot's filesystem, and capture files are moved out of it afterwards.

Version: written against Firecracker v1.12.1 (no free page reporting in its balloon).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from .. import memfile
from ..memory import MemoryRange
from ..driver import (
    CaptureKind,
    CaptureResult,
    KernelFormat,
    SnapshotFiles,
    SnapshotFormat,
    Vm,
    VmConfig,
    VmState,
    VmStats,
)
from ..errors import (
    SnapshotError,
    UnsupportedOperation,
    VmmApiError,
    VmmConfigError,
    VmmExited,
    VmmStartError,
)
from ..cgroup import VmmLimits
from ..process import ChildProcess, Spawner, StableLinks, VmmProcess, adopted_process, vmm_process
from .api import FirecrackerApi

DEFAULT_FIRECRACKER = Path("/opt/aenv/bin/firecracker")
_ID_RE = re.compile(r"[A-Za-z0-9-]{1,64}")
DEFAULT_JAILER = Path("/opt/aenv/bin/jailer")
#: where an unjailed Firecracker sees its drives (symlinks in its own mount namespace, see StableLinks): the
#: snapshot records these paths, so every restore finds its own disk under the same names
DRIVE_DIR = Path("/run/aenv-vm")


@dataclass(frozen=True)
class JailerConfig:
    """Run Firecracker under `jailer`: chroot `<chroot_base>/firecracker/<VmConfig.name>/root`, uid/gid.

    VM names must then be unique among the node's running VMs (the name is the chroot). The chroot base must
    be on the filesystem of the kernel, images and snapshots (they are hard-linked in), which must be
    readable by `uid`; writable drives are chowned to it.
    """

    binary: Path = DEFAULT_JAILER
    chroot_base: Path = Path("/srv/jailer")
    uid: int = 65534
    gid: int = 65534


class FirecrackerDriver:
    """Starts Firecracker VMs. Holds no processes; safe to share.

    track_dirty_pages: KVM dirty logging, needed for Diff captures (costs a fault on the first write to each
    page after every snapshot). log_level: Firecracker's own log (to workdir/firecracker.log).
    """

    name = "firecracker"
    nbd_client = False
    kernel_format = KernelFormat.ELF

    def __init__(
        self,
        *,
        binary: Path = DEFAULT_FIRECRACKER,
        jailer: JailerConfig | None = None,
        track_dirty_pages: bool = True,
        log_level: str = "Warning",
        start_timeout_s: float = 10.0,
        op_timeout_s: float = 120.0,
    ) -> None:
        self.binary = binary
        self.jailer = jailer
        self.track_dirty_pages = track_dirty_pages
        self.log_level = log_level
        self.start_timeout_s = start_timeout_s
        self.op_timeout_s = op_timeout_s
        #: where VMM processes start (the node's data plane), None: as this process's children
        self.spawner: Spawner | None = None
        #: each VMM in its own cgroup with these limits (``cgroup.py``); None: unlimited
        self.limits: VmmLimits | None = None

    # ---- process ------------------------------------------------------------------------------------

    def _vm_json(self, config: VmConfig, paths: _Paths) -> dict[str, Any]:
        c = config
        boot: dict[str, Any] = {"kernel_image_path": paths.inside(c.kernel), "boot_args": c.cmdline}
        if c.initrd is not None:
            boot["initrd_path"] = paths.inside(c.initrd)
        drives = []
        for i, d in enumerate(c.drives):
            if d.is_nbd:
                raise VmmConfigError(
                    f"Firecracker cannot attach NBD drive {d.source!r}: give it a file or block device path"
                )
            drives.append(
                {
                    "drive_id": f"vd{i}",
                    "path_on_host": paths.drive(i, Path(d.source), writable=not d.read_only),
                    "is_root_device": False,
                    "is_read_only": d.read_only,
                }
            )
        vm: dict[str, Any] = {
            "boot-source": boot,
            "drives": drives,
            "machine-config": {
                "vcpu_count": c.vcpus,
                "mem_size_mib": c.mem_mib,
                "track_dirty_pages": self.track_dirty_pages,
            },
        }
        if c.net is not None:
            vm["network-interfaces"] = [{"iface_id": "eth0", "host_dev_name": c.net.tap, "guest_mac": c.net.mac}]
        if c.balloon is not None:
            vm["balloon"] = {
                "amount_mib": c.balloon.amount_mib,
                "deflate_on_oom": c.balloon.deflate_on_oom,
                "stats_polling_interval_s": c.balloon.stats_interval_s,
            }
        return vm

    @staticmethod
    def _check_config(config: VmConfig) -> None:
        config.validate()
        if not _ID_RE.fullmatch(config.name):
            raise VmmConfigError(
                f"Firecracker VM names (--id) are 1-64 characters of letters, digits and '-': {config.name!r}"
            )
        if config.balloon is not None and config.balloon.free_page_reporting:
            raise VmmConfigError("Firecracker 1.12 has no balloon free page reporting: disable free_page_reporting")

    @asynccontextmanager
    async def _started(
        self, config: VmConfig, *, boot: bool
    ) -> AsyncIterator[tuple[VmmProcess, FirecrackerApi, _Paths]]:
        wd = config.workdir
        wd.mkdir(parents=True, exist_ok=True)
        paths = _Paths.make(config, self.jailer, self.binary.name)
        proc: VmmProcess | None = None
        try:
            async with self._process(config, paths, boot=boot) as started:
                proc = started[0]
                yield started
        finally:
            if proc is None or not proc.detached:  # a detached VM runs on in its chroot
                paths.cleanup()

    @asynccontextmanager
    async def _process(
        self, config: VmConfig, paths: _Paths, *, boot: bool
    ) -> AsyncIterator[tuple[VmmProcess, FirecrackerApi, _Paths]]:
        wd = config.workdir
        config_file = self._vm_json(config, paths) if boot else None
        log = paths.host_file("firecracker.log")
        metrics = paths.host_file("metrics.json")
        for f in (log, metrics):
            f.touch()
            if self.jailer is not None:
                os.chown(f, self.jailer.uid, self.jailer.gid)
        fc_args = [
            "--api-sock", paths.api_socket_inside,
            "--log-path", paths.inside(log),
            "--level", self.log_level,
            "--metrics-path", paths.inside(metrics),
        ]  # fmt: skip
        if config_file is not None:
            cf = paths.host_file("vm.json")
            cf.write_text(json.dumps(config_file, indent=1))
            fc_args += ["--config-file", paths.inside(cf)]
        if self.jailer is None:
            argv = [str(self.binary), "--id", config.name, *fc_args]
            netns = config.netns
            links = StableLinks(DRIVE_DIR, tuple((f"vd{i}", Path(d.source)) for i, d in enumerate(config.drives)))
        else:
            j = self.jailer
            argv = [
                str(j.binary), "--id", config.name, "--exec-file", str(self.binary),
                "--uid", str(j.uid), "--gid", str(j.gid), "--chroot-base-dir", str(j.chroot_base),
            ]  # fmt: skip
            if config.netns is not None:
                argv += ["--netns", str(config.netns)]
            argv += ["--", *fc_args]
            netns = None
            links = None
        async with vmm_process(
            argv,
            log_path=wd / "firecracker.stderr",
            stdout_path=config.console_path,
            sockets=[paths.api_socket],
            netns=netns,
            cwd=wd,
            extra_logs=[log],
            stable_links=links,
            pid_file=config.pid_file,
            spawner=self.spawner,
            key=config.name,
            cgroup=self.limits.create(config.name, config.vcpus, config.mem_mib) if self.limits else None,
        ) as proc:
            await proc.wait_for_socket(paths.api_socket, self.start_timeout_s)
            api = FirecrackerApi(paths.api_socket, timeout_s=self.op_timeout_s)
            try:
                yield proc, api, paths
            finally:
                with trio.CancelScope(shield=True):
                    await api.aclose()

    @asynccontextmanager
    async def attach(self, config: VmConfig, restored_from: SnapshotFiles,
                     proc: ChildProcess) -> AsyncIterator[FirecrackerVm]:
        """Take over a VM an earlier run of the node restored with ``config`` from ``restored_from`` and left
        running in ``proc``: its API socket (same path: same config) is spoken to again and its state read.

        Its next capture is FULL even if a Diff is asked (``FirecrackerVm.capture``): KVM's dirty log restarts
        at every snapshot Firecracker takes, and the dead node may have had one taken that it never committed,
        so a Diff could miss pages written before it."""
        paths = _Paths.make(config, self.jailer, self.binary.name)
        vm: FirecrackerVm | None = None
        try:
            async with adopted_process(proc, log_path=config.workdir / "firecracker.stderr",
                                       sockets=[paths.api_socket], extra_logs=[paths.host_file("firecracker.log")],
                                       pid_file=config.pid_file,
                                       cgroup=self.limits.cgroups.of(config.name) if self.limits else None) as vp:
                api = FirecrackerApi(paths.api_socket, timeout_s=self.op_timeout_s)
                try:
                    vm = FirecrackerVm(self, config, vp, api, paths, restored_from=restored_from)
                    vm.full_next = True
                    state = (await vm._call("GET", "/"))["state"]
                    vm.state = VmState.RUNNING if state == "Running" else VmState.PAUSED
                    yield vm
                finally:
                    with trio.CancelScope(shield=True):
                        await api.aclose()
        finally:
            if vm is None or not vm._proc.detached:
                paths.cleanup()

    # ---- boot / restore -----------------------------------------------------------------------------

    @asynccontextmanager
    async def boot(self, config: VmConfig) -> AsyncIterator[FirecrackerVm]:
        self._check_config(config)
        async with self._started(config, boot=True) as (proc, api, paths):
            # The API socket opens before the VM is built from the config file: wait for the guest to run.
            running = False
            with trio.move_on_after(self.start_timeout_s):
                while not running and proc.alive():
                    try:
                        running = (await api.get("/"))["state"] == "Running"
                    except VmmExited:
                        pass
                    if not running:
                        await trio.sleep(0.001)
            if not running:
                why = "exited" if not proc.alive() else f"did not start it within {self.start_timeout_s:.0f} s"
                raise VmmStartError(f"Firecracker {why} booting the VM", log_tail=proc.log_tail())
            vm = FirecrackerVm(self, config, proc, api, paths, restored_from=None)
            vm.state = VmState.RUNNING
            yield vm

    @asynccontextmanager
    async def restore(
        self, config: VmConfig, snapshot: SnapshotFiles, *, resume: bool = True
    ) -> AsyncIterator[FirecrackerVm]:
        self._check_config(config)
        if snapshot.format is not SnapshotFormat.FIRECRACKER:
            raise SnapshotError(f"Firecracker cannot restore a {snapshot.format} snapshot")
        for p in (snapshot.vmstate, snapshot.memory):
            if not p.is_file():
                raise SnapshotError(f"snapshot file missing: {p}")
        if snapshot.memory.stat().st_size != config.mem_bytes:
            raise SnapshotError(
                f"memory image {snapshot.memory} is {snapshot.memory.stat().st_size} bytes, "
                f"the VM has {config.mem_bytes}"
            )
        async with self._started(config, boot=False) as (proc, api, paths):
            body = {
                "snapshot_path": paths.inside(snapshot.vmstate),
                "mem_backend": {"backend_type": "File", "backend_path": paths.inside(snapshot.memory)},
                "enable_diff_snapshots": self.track_dirty_pages,  # 1.12's name for track_dirty_pages
                "resume_vm": resume,
            }
            if config.net is not None:
                # The restored VM may use another tap than the captured one (its own slot).
                body["network_overrides"] = [{"iface_id": "eth0", "host_dev_name": config.net.tap}]
            try:
                await api.put("/snapshot/load", body)
            except (VmmApiError, VmmExited) as e:
                raise SnapshotError(f"Firecracker failed to load {snapshot.vmstate}: {e}\n{proc.log_tail()}") from e
            vm = FirecrackerVm(self, config, proc, api, paths, restored_from=snapshot)
            vm.state = VmState.RUNNING if resume else VmState.PAUSED
            yield vm


class _Paths:
    """Where files are for Firecracker (inside its chroot under the jailer) and for us."""

    def __init__(self, config: VmConfig, jailer: JailerConfig | None, exec_name: str) -> None:
        self.config = config
        self.jailer = jailer
        if jailer is None:
            self.root: Path | None = None
            self.api_socket = config.socket_path
            self.api_socket_inside = str(config.socket_path)
        else:
            self.root = jailer.chroot_base / exec_name / config.name / "root"
            self.api_socket = self.root / "run" / "firecracker.socket"
            self.api_socket_inside = "/run/firecracker.socket"

    @classmethod
    def make(cls, config: VmConfig, jailer: JailerConfig | None, exec_name: str) -> _Paths:
        p = cls(config, jailer, exec_name)
        if p.root is not None:
            p.root.mkdir(parents=True, exist_ok=True)
        return p

    def host_file(self, name: str) -> Path:
        """A file Firecracker writes: in the workdir, or in the chroot under the jailer."""
        return (self.root / name) if self.root is not None else self.config.workdir / name

    def drive(self, index: int, source: Path, *, writable: bool) -> str:
        """The path Firecracker is given for drive ``index``: the same for every VM (see ``DRIVE_DIR``), or the
        hard link in the jailer's chroot."""
        if self.root is None:
            return str(DRIVE_DIR / f"vd{index}")
        return self.inside(source, writable=writable)

    def inside(self, path: Path, *, writable: bool = False) -> str:
        """The path Firecracker must be given for host file `path` (hard-linked into the chroot if jailed).

        A hard link shares the inode, so only files Firecracker must write (`writable`) are chowned to the
        jail's uid; everything else (kernel, images, snapshots) just has to be readable by it.
        """
        if self.root is None:
            return str(path)
        if path.is_relative_to(self.root):
            return "/" + str(path.relative_to(self.root))
        rel = Path("files") / str(path.resolve()).lstrip("/")
        dst = self.root / rel
        if not dst.exists():
            dst.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(path, dst)
            except OSError as e:
                raise VmmConfigError(
                    f"cannot hard-link {path} into the jailer chroot {self.root} ({e.strerror}): keep VM files "
                    f"on the chroot's filesystem"
                ) from e
        assert self.jailer is not None
        if writable:
            os.chown(dst, self.jailer.uid, self.jailer.gid)
        return "/" + str(rel)

    def cleanup(self) -> None:
        """Remove the chroot, keeping Firecracker's log and metrics in the workdir for post-mortems."""
        if self.root is not None:
            for name in ("firecracker.log", "metrics.json"):
                try:
                    shutil.move(self.root / name, self.config.workdir / name)
                except OSError:
                    pass
            shutil.rmtree(self.root.parent, ignore_errors=True)


class FirecrackerVm(Vm):
    driver_name = "firecracker"

    def __init__(
        self,
        driver: FirecrackerDriver,
        config: VmConfig,
        proc: VmmProcess,
        api: FirecrackerApi,
        paths: _Paths,
        *,
        restored_from: SnapshotFiles | None,
    ) -> None:
        super().__init__(config, restored_from=restored_from)
        self._driver = driver
        self._proc = proc
        self._api = api
        self._paths = paths
        self._has_base = restored_from is not None  # a Diff needs something to be a diff against
        #: the next capture is FULL whatever is asked (a VM taken over: its dirty log's start is unknown)
        self.full_next = False
        self._lock = trio.Lock()

    @property
    def pid(self) -> int:
        return self._proc.pid

    async def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        try:
            return await self._api.request(method, path, body)
        except VmmExited as e:
            raise VmmExited(f"{e}\n--- Firecracker output (tail) ---\n{self._proc.log_tail()}") from e

    async def pause(self) -> None:
        async with self._lock:
            await self._pause_locked()

    async def _pause_locked(self) -> None:
        if self.state is VmState.PAUSED:
            return
        await self._call("PATCH", "/vm", {"state": "Paused"})
        self.state = VmState.PAUSED

    async def resume(self) -> None:
        async with self._lock:
            if self.state is VmState.RUNNING:
                return
            await self._call("PATCH", "/vm", {"state": "Resumed"})
            self.state = VmState.RUNNING

    async def capture(self, vmstate: Path, memory: Path, *, kind: CaptureKind = CaptureKind.FULL,
                      buffer: Any = None) -> CaptureResult:
        # `buffer` is not used: Firecracker writes its Diff snapshot's memory file itself.
        async with self._lock:
            t0 = time.perf_counter()
            if self.full_next:
                kind = CaptureKind.FULL  # the result says so: its dirty ranges are the whole memory
            if kind is CaptureKind.DIFF:
                if not self._driver.track_dirty_pages:
                    raise UnsupportedOperation("Diff captures need FirecrackerDriver(track_dirty_pages=True)")
                if not self._has_base:
                    raise UnsupportedOperation(
                        "a booted VM has no base image to diff against: take a FULL capture first"
                    )
            if self.restored_from is not None and memory.resolve() == self.restored_from.memory.resolve():
                raise SnapshotError(f"capture target {memory} is the image this VM was restored from")
            await self._pause_locked()
            for p in (vmstate, memory):
                p.unlink(missing_ok=True)
            jailed = self._paths.root is not None
            out_state = self._paths.host_file("capture.vmstate") if jailed else vmstate
            out_mem = self._paths.host_file("capture.memory") if jailed else memory
            await self._call(
                "PUT",
                "/snapshot/create",
                {
                    "snapshot_type": "Full" if kind is CaptureKind.FULL else "Diff",
                    "snapshot_path": self._paths.inside(out_state),
                    "mem_file_path": self._paths.inside(out_mem),
                },
            )
            if jailed:
                os.replace(out_state, vmstate)
                os.replace(out_mem, memory)
            self._has_base = True
            self.full_next = False
            if kind is CaptureKind.FULL:
                ranges: tuple[MemoryRange, ...] = (MemoryRange(0, self.config.mem_bytes),)
            else:
                ranges = await trio.to_thread.run_sync(memfile.data_ranges, memory)
            return CaptureResult(
                vmm="firecracker",
                kind=kind,
                format=SnapshotFormat.FIRECRACKER,
                vmstate=vmstate,
                memory=memory,
                mem_size=self.config.mem_bytes,
                dirty_ranges=ranges,
                duration_s=time.perf_counter() - t0,
                since_restore=False,  # KVM's dirty log restarts at every snapshot
            )

    async def balloon(self, amount_mib: int) -> None:
        self._check_balloon_amount(amount_mib)
        await self._call("PATCH", "/balloon", {"amount_mib": amount_mib})

    async def stats(self) -> VmStats:
        vmm: dict[str, Any] = {}
        if self._proc.alive():
            try:
                vmm["state"] = (await self._call("GET", "/"))["state"]
                await self._call("PUT", "/actions", {"action_type": "FlushMetrics"})
                vmm["metrics"] = await trio.to_thread.run_sync(_last_json_line, self._paths.host_file("metrics.json"))
            except (VmmApiError, VmmExited):
                pass
        return self._process_stats(vmm)


def _last_json_line(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 65536))
            lines = [ln for ln in f.read().splitlines() if ln.strip()]
        return json.loads(lines[-1]) if lines else {}
    except (OSError, ValueError):
        return {}
