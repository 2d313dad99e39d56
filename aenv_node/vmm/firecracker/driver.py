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

Jailer: optional (`JailerConfig`, node config `vmm.jailer`). With it Firecracker runs chrooted under an
unprivileged uid in namespaces of its own; `jail.py` says how its files get into the chroot (hard links, device
nodes, bind mounts) and what the life cycle (start, capture, take-over, stop) does there.

Version: written against Firecracker v1.12.1 (no free page reporting in its balloon).
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
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
from .jail import DEFAULT_JAILER, DRIVE_DIR, BindMounts, Jail, JailerConfig, own_tap, sweep_jails

__all__ = ["DEFAULT_FIRECRACKER", "DEFAULT_JAILER", "DRIVE_DIR", "FirecrackerDriver", "FirecrackerVm",
           "JailerConfig"]

DEFAULT_FIRECRACKER = Path("/opt/aenv/bin/firecracker")
_ID_RE = re.compile(r"[A-Za-z0-9-]{1,64}")


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
        #: jailed VMs this driver is starting or holds, by name (the name is the chroot: unique while they run)
        self._jailed: set[str] = set()

    # ---- process ------------------------------------------------------------------------------------

    def _vm_json(self, config: VmConfig, jail: Jail) -> dict[str, Any]:
        c = config
        boot: dict[str, Any] = {"kernel_image_path": jail.inside(c.kernel), "boot_args": c.cmdline}
        if c.initrd is not None:
            boot["initrd_path"] = jail.inside(c.initrd)
        drives = []
        for i, d in enumerate(c.drives):
            drives.append(
                {
                    "drive_id": f"vd{i}",
                    "path_on_host": str(DRIVE_DIR / f"vd{i}"),  # put there by _prepare_files
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
        for d in config.drives:
            if d.is_nbd:
                raise VmmConfigError(
                    f"Firecracker cannot attach NBD drive {d.source!r}: give it a file or block device path"
                )
        if config.balloon is not None and config.balloon.free_page_reporting:
            raise VmmConfigError("Firecracker 1.12 has no balloon free page reporting: disable free_page_reporting")

    def _claim(self, name: str) -> None:
        """A jailed VM's name is its chroot: two at once would share one."""
        if self.jailer is not None:
            if name in self._jailed:
                raise VmmConfigError(f"a jailed Firecracker VM named {name!r} already runs: names must be unique")
            self._jailed.add(name)

    async def _release(self, jail: Jail, proc: VmmProcess | None) -> None:
        """After the VMM: its jail goes unless it was detached (it runs on in its chroot for the next owner)."""
        try:
            if jail.root is not None and (proc is None or not proc.detached):
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(jail.cleanup)
        finally:
            self._jailed.discard(jail.config.name)

    async def sweep_jails(self, *, wait_for: Sequence[int] = (), timeout_s: float = 5.0) -> list[str]:
        """Remove the chroots whose VMM is gone (a node killed hard, a data plane stopped with its VMMs), except
        those of VMs this driver is starting or holds; their names. For reconcilers, once the VMMs they killed
        (``wait_for``: their pids) have exited: a VMM still running keeps its chroot."""
        if self.jailer is None:
            return []
        with trio.move_on_after(timeout_s):
            while any(_runs(pid) for pid in wait_for):
                await trio.sleep(0.02)
        keep = frozenset(self._jailed)
        return await trio.to_thread.run_sync(sweep_jails, self.jailer.chroot_base, self.binary.name, keep)

    @asynccontextmanager
    async def _started(
        self, config: VmConfig, *, boot: bool, snapshot: SnapshotFiles | None = None
    ) -> AsyncIterator[tuple[VmmProcess, FirecrackerApi, Jail]]:
        config.workdir.mkdir(parents=True, exist_ok=True)
        jail = Jail(config, self.jailer, self.binary.name)
        self._claim(config.name)
        proc: VmmProcess | None = None
        try:
            fc_args = await trio.to_thread.run_sync(self._prepare_files, config, jail, boot, snapshot)
            if self.jailer is not None and config.net is not None:
                await trio.to_thread.run_sync(own_tap, config.netns, config.net.tap, self.jailer.uid,
                                              self.jailer.gid)
            async with self._process(config, jail, fc_args) as started:
                proc = started[0]
                yield started
        finally:
            await self._release(jail, proc)

    def _prepare_files(self, config: VmConfig, jail: Jail, boot: bool, snapshot: SnapshotFiles | None) -> list[str]:
        """Everything the VMM opens, made (and put into its jail); its command line. Blocking: in a thread."""
        jail.prepare()
        log = jail.host_file("firecracker.log")
        metrics = jail.host_file("metrics.json")
        for f in (log, metrics):
            f.touch()
            jail.own_file(f)
        fc_args = [
            "--api-sock", jail.api_socket_inside,
            "--log-path", jail.inside(log),
            "--level", self.log_level,
            "--metrics-path", jail.inside(metrics),
        ]  # fmt: skip
        if jail.root is not None:
            for i, d in enumerate(config.drives):
                jail.drive(i, Path(d.source), writable=not d.read_only)
        if boot:
            cf = jail.host_file("vm.json")
            cf.write_text(json.dumps(self._vm_json(config, jail), indent=1))
            fc_args += ["--config-file", jail.inside(cf)]
        if snapshot is not None:  # into the jail before the VMM starts (a bind mount can only be made then)
            jail.inside(snapshot.vmstate)
            jail.inside(snapshot.memory)
        return fc_args

    @asynccontextmanager
    async def _process(
        self, config: VmConfig, jail: Jail, fc_args: list[str]
    ) -> AsyncIterator[tuple[VmmProcess, FirecrackerApi, Jail]]:
        wd = config.workdir
        if self.jailer is None:
            argv = [str(self.binary), "--id", config.name, *fc_args]
            netns = config.netns
            mounts: StableLinks | BindMounts | None = StableLinks(
                DRIVE_DIR, tuple((f"vd{i}", Path(d.source)) for i, d in enumerate(config.drives)))
        else:
            argv = jail.argv(self.binary, fc_args)
            netns = None  # the jailer joins it (--netns)
            mounts = jail.bind_mounts()
        async with vmm_process(
            argv,
            log_path=wd / "firecracker.stderr",
            stdout_path=config.console_path,
            sockets=[jail.api_socket],
            netns=netns,
            cwd=wd,
            extra_logs=[jail.host_file("firecracker.log")],
            stable_links=mounts,
            pid_file=config.pid_file,
            spawner=self.spawner,
            key=config.name,
            cgroup=self.limits.create(config.name, config.vcpus, config.mem_mib) if self.limits else None,
        ) as proc:
            jail.link_socket()
            await proc.wait_for_socket(jail.api_socket, self.start_timeout_s)
            api = FirecrackerApi(jail.api_socket, timeout_s=self.op_timeout_s)
            try:
                yield proc, api, jail
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
        jail = Jail(config, self.jailer, self.binary.name)
        self._claim(config.name)
        jail.adopt()
        vm: FirecrackerVm | None = None
        try:
            async with adopted_process(proc, log_path=config.workdir / "firecracker.stderr",
                                       sockets=[jail.api_socket], extra_logs=[jail.host_file("firecracker.log")],
                                       pid_file=config.pid_file,
                                       cgroup=self.limits.cgroups.of(config.name) if self.limits else None) as vp:
                api = FirecrackerApi(jail.api_socket, timeout_s=self.op_timeout_s)
                try:
                    vm = FirecrackerVm(self, config, vp, api, jail, restored_from=restored_from)
                    vm.full_next = True
                    state = (await vm._call("GET", "/"))["state"]
                    vm.state = VmState.RUNNING if state == "Running" else VmState.PAUSED
                    yield vm
                finally:
                    with trio.CancelScope(shield=True):
                        await api.aclose()
        finally:
            await self._release(jail, vm._proc if vm is not None else None)

    # ---- boot / restore -----------------------------------------------------------------------------

    @asynccontextmanager
    async def boot(self, config: VmConfig) -> AsyncIterator[FirecrackerVm]:
        self._check_config(config)
        async with self._started(config, boot=True) as (proc, api, jail):
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
            vm = FirecrackerVm(self, config, proc, api, jail, restored_from=None)
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
        async with self._started(config, boot=False, snapshot=snapshot) as (proc, api, jail):
            body = {
                "snapshot_path": jail.inside(snapshot.vmstate),  # put into the jail by _prepare_files
                "mem_backend": {"backend_type": "File", "backend_path": jail.inside(snapshot.memory)},
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
            vm = FirecrackerVm(self, config, proc, api, jail, restored_from=snapshot)
            vm.state = VmState.RUNNING if resume else VmState.PAUSED
            yield vm


class FirecrackerVm(Vm):
    driver_name = "firecracker"

    def __init__(
        self,
        driver: FirecrackerDriver,
        config: VmConfig,
        proc: VmmProcess,
        api: FirecrackerApi,
        jail: Jail,
        *,
        restored_from: SnapshotFiles | None,
    ) -> None:
        super().__init__(config, restored_from=restored_from)
        self._driver = driver
        self._proc = proc
        self._api = api
        self._jail = jail
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
            jail = self._jail
            jailed = jail.root is not None
            if jailed:  # before the pause: a target it cannot reach fails with the VM untouched
                await trio.to_thread.run_sync(jail.check_capture_target, vmstate, memory)
            await self._pause_locked()
            for p in (vmstate, memory):
                p.unlink(missing_ok=True)
            # jailed: written in the chroot (all Firecracker can reach), then renamed out
            out_state = jail.host_file("capture.vmstate") if jailed else vmstate
            out_mem = jail.host_file("capture.memory") if jailed else memory
            await self._call(
                "PUT",
                "/snapshot/create",
                {
                    "snapshot_type": "Full" if kind is CaptureKind.FULL else "Diff",
                    "snapshot_path": jail.inside(out_state),
                    "mem_file_path": jail.inside(out_mem),
                },
            )
            if jailed:
                await trio.to_thread.run_sync(jail.take_out, out_state, vmstate)
                await trio.to_thread.run_sync(jail.take_out, out_mem, memory)
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
                vmm["metrics"] = await trio.to_thread.run_sync(_last_json_line, self._jail.host_file("metrics.json"))
            except (VmmApiError, VmmExited):
                pass
        return self._process_stats(vmm)


def _runs(pid: int) -> bool:
    """Whether ``pid`` has not exited (a zombie has)."""
    try:
        os.stat(f"/proc/{pid}/exe")
    except OSError:
        return False
    return True


def _last_json_line(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 65536))
            lines = [ln for ln in f.read().splitlines() if ln.strip()]
        return json.loads(lines[-1]) if lines else {}
    except (OSError, ValueError):
        return {}
