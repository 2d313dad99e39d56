"""QEMU `-M microvm` behind the VMM interface, controlled over QMP.

Memory is always a `memory-backend-file` (id `mem0`, the same at save and restore, as QEMU requires):

* boot: the VM's own file mapped `share=on`. The file *is* the memory image, so the first capture is
  `stop` + a migration of device state only (`x-ignore-shared`, a few dozen KB, ~10 ms).
* restore: the snapshot's image mapped `share=off`: copy-on-write, never modified, page cache shared by
  every VM restored from it. `-incoming defer` + `migrate-incoming exec:cat FILE`, then `cont`.
* capture after a restore: `migrate` would stream all of RAM (QEMU 7.2 has no dirty log outside a
  migration), so instead the pages the guest wrote are found with /proc/PID/pagemap (`pagemap.py`),
  copied out of /proc/PID/mem, and the device state is saved with `xen-save-devices-state` (restored with
  `migration.send-configuration=off`). `xen-load-devices-state` crashes QEMU 7.2: never used.

Rules this driver enforces:
* the balloon gives memory back (inflation, free page reporting) only where that cannot modify a memory
  image another VM maps. QEMU 7.2's `ram_block_discard_range()` first punches a hole in the backing FILE
  (`fallocate(PUNCH_HOLE|KEEP_SIZE)`: with `share=off` that zeroes the image under every VM that maps it,
  host-facts DANGER), and only then `madvise(MADV_DONTNEED)`s its own mapping. So:
  - memory the VM owns (anonymous, a booted VM's own `share=on` file, `mem_exclusive`): allowed as is;
  - a copy-on-write map of a shared image (restores; `MemoryMode.PRIVATE` boots) with
    `QemuDriver(cow_discard=True)`: QEMU runs under `seccomp.punch_hole_guard()`, which makes that
    fallocate return 0 without running; QEMU then drops only its private copies (the range reads the
    image again, which the guest treats as free memory anyway). Preconditions, checked at start: no drive
    is a writable file (QEMU's raw file driver implements guest discards and write-zeroes-with-unmap with
    the same fallocate, which would then "succeed" without zeroing: NBD drives and read-only drives are
    fine), and the guest kernel is not booted with `init_on_free=1` (the guest would then take reported
    pages to read as zeros; they read as the image). `page_poison=1` guests are safe but report nothing
    (QEMU skips discards when the guest announces a poison value);
  - otherwise free page reporting or a balloon target above 0 is refused (`BalloonNotAllowed`); a balloon
    device that never inflates is allowed;
* a booted VM whose memory file was handed over as the snapshot's image (`capture(memory=<its own file>)`)
  can no longer run: it would write into the snapshot. Otherwise that file is deleted when the VM exits.

Accelerator: `accel=kvm` with `-cpu host,-arch-capabilities` by default (plain `host`/`max` abort on PVM hosts:
"failed to set MSR 0x10a"; `select.make_driver` asks for plain `host` where KVM is Intel's or AMD's) or
`accel=tcg` with `-cpu max` and a small translation cache.
"""

from __future__ import annotations

import os
import shlex
import shutil
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio

from .. import memfile, pagemap, seccomp
from ..memory import MemoryRange
from ..driver import (
    Accel,
    CaptureKind,
    CaptureResult,
    KernelFormat,
    MemoryMode,
    SnapshotFiles,
    SnapshotFormat,
    Vm,
    VmConfig,
    VmState,
    VmStats,
)
from ..errors import (
    BalloonNotAllowed,
    SnapshotError,
    UnsupportedOperation,
    VmmApiError,
    VmmConfigError,
    VmmExited,
    VmmStartError,
    VmmTimeout,
)
from ..cgroup import VmmLimits
from ..process import ChildProcess, Spawner, VmmProcess, adopted_process, vmm_process
from .qmp import QmpClient

DEFAULT_QEMU = Path("/usr/bin/qemu-system-x86_64")


def _opt(value: object) -> str:
    """Escape a value for a QEMU comma-separated option list (',' is written ',,')."""
    return str(value).replace(",", ",,")


class QemuDriver:
    """Starts QEMU microvm VMs. Holds no processes; safe to share.

    binary: qemu-system-x86_64. cpu_model: overrides the per-accel default. tcg_tb_size_mib: TCG translation
    cache (16 MiB cuts QEMU's private memory from ~110 to ~48 MiB; a Linux boot is ~5x slower with it).
    restore_tb_size_mib: the TCG cache size for restored VMs (None: as booted ones).
    mem_merge: mark guest RAM mergeable for KSM (the host must run KSM: /sys/kernel/mm/ksm/run).
    cow_discard: let VMs whose RAM maps a shared image copy-on-write use the balloon (inflation and free
    page reporting) by running QEMU under the punch-hole guard (module docstring: preconditions).
    """

    name = "qemu"
    nbd_client = True
    kernel_format = KernelFormat.BZIMAGE

    def __init__(
        self,
        *,
        binary: Path = DEFAULT_QEMU,
        cpu_model: str | None = None,
        tcg_tb_size_mib: int = 16,
        start_timeout_s: float = 10.0,
        op_timeout_s: float = 60.0,
        mem_merge: bool = False,
        restore_tb_size_mib: int | None = None,
        cow_discard: bool = False,
    ) -> None:
        self.binary = binary
        self.cow_discard = cow_discard
        self._guard: seccomp.SeccompFilter | None = None  # built on first use, then shared
        self.mem_merge = mem_merge
        # A restored guest runs a small working set (a boot runs lots of code once): a smaller
        # translation cache costs it little and saves QEMU private memory per VM (density).
        self.restore_tb_size_mib = restore_tb_size_mib
        self.cpu_model = cpu_model
        self.tcg_tb_size_mib = tcg_tb_size_mib
        self.start_timeout_s = start_timeout_s
        self.op_timeout_s = op_timeout_s
        #: where VMM processes start (the node's data plane), None: as this process's children
        self.spawner: Spawner | None = None
        #: each VMM in its own cgroup with these limits (``cgroup.py``); None: unlimited
        self.limits: VmmLimits | None = None

    # ---- command line -------------------------------------------------------------------------------

    def _argv(
        self, config: VmConfig, *, mem_path: Path | None, share: bool, incoming: SnapshotFormat | None
    ) -> list[str]:
        c = config
        if c.accel is Accel.KVM:
            accel = "kvm"
            cpu = self.cpu_model or "host,-arch-capabilities"
        else:
            tb = self.tcg_tb_size_mib
            if incoming is not None and self.restore_tb_size_mib is not None:
                tb = self.restore_tb_size_mib
            accel = f"tcg,tb-size={tb}"
            cpu = self.cpu_model or "max"
        if mem_path is None:
            backend = f"memory-backend-ram,id=mem0,size={c.mem_mib}M"
        else:
            backend = (
                f"memory-backend-file,id=mem0,size={c.mem_mib}M,mem-path={_opt(mem_path)},"
                f"share={'on' if share else 'off'}"
            )
        if self.mem_merge:  # KSM may merge identical guest pages (MADV_MERGEABLE)
            backend += ",merge=on"
        argv = [
            str(self.binary),
            "-name", _opt(c.name),
            "-machine", "microvm,memory-backend=mem0",
            "-accel", accel,
            "-cpu", cpu,
            "-smp", str(c.vcpus),
            "-m", f"{c.mem_mib}M",
            "-object", backend,
            "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
            "-serial", f"file:{c.console_path}",
            "-qmp", f"unix:{_opt(c.socket_path)},server=on,wait=off",
        ]  # fmt: skip
        if incoming is None:
            # Only a boot reads these. QEMU keeps the kernel and initrd in its own heap for as long as it runs
            # (fw_cfg's copy, for the firmware to load at reset): 14.7 MiB of every restored VM, in a guest
            # whose memory image already holds the running kernel and that never resets (-no-reboot).
            argv += ["-kernel", str(c.kernel)]
            if c.initrd is not None:
                argv += ["-initrd", str(c.initrd)]
            if c.cmdline:
                argv += ["-append", c.cmdline]
        for i, d in enumerate(c.drives):
            src = d.source if d.is_nbd else _opt(d.source)
            ro = ",readonly=on" if d.read_only else ""
            argv += [
                "-drive", f"id=vd{i},file={src},format=raw,if=none,cache=writeback,discard=unmap{ro}",
                "-device", f"virtio-blk-device,drive=vd{i}",
            ]  # fmt: skip
        if c.net is not None:
            argv += [
                "-netdev", f"tap,id=net0,ifname={_opt(c.net.tap)},script=no,downscript=no,vhost=off",
                "-device", f"virtio-net-device,netdev=net0,mac={c.net.mac}",
            ]  # fmt: skip
        if c.balloon is not None:
            b = c.balloon
            argv += [
                "-device",
                f"virtio-balloon-device,id=balloon0,deflate-on-oom={'on' if b.deflate_on_oom else 'off'},"
                f"free-page-reporting={'on' if b.free_page_reporting else 'off'}",
            ]
        if incoming is not None:
            argv += ["-incoming", "defer"]
            if incoming is SnapshotFormat.QEMU_DEVICES:
                argv += ["-global", "migration.send-configuration=off"]
        return argv

    def _discard_guard(self, config: VmConfig, *, owns_memory: bool) -> seccomp.SeccompFilter | None:
        """The seccomp filter QEMU must run under for this VM's balloon to be safe (None: none needed).

        Raises BalloonNotAllowed where the balloon could modify a memory image other VMs map.
        """
        b = config.balloon
        if b is None or owns_memory:
            return None
        if not self.cow_discard:
            if b.free_page_reporting:
                raise BalloonNotAllowed(
                    "free page reporting with copy-on-write file-backed RAM makes QEMU 7.2 punch holes in the "
                    "backing file, corrupting a shared memory image: use QemuDriver(cow_discard=True) (runs "
                    "QEMU under a seccomp guard), set VmConfig.mem_exclusive=True only if this VM's memory "
                    "file is its own copy, or disable free_page_reporting"
                )
            if b.amount_mib:
                raise BalloonNotAllowed(
                    "inflating the balloon of a VM with copy-on-write file-backed RAM makes QEMU 7.2 punch "
                    "holes in the shared memory image: use QemuDriver(cow_discard=True) or amount_mib=0"
                )
            return None
        unsafe = [d.source for d in config.drives if not d.is_nbd and not d.read_only]
        if unsafe:
            raise BalloonNotAllowed(
                f"the balloon of a VM with copy-on-write RAM needs the punch-hole guard, which would also make "
                f"guest discards and write-zeroes on writable file drives succeed without effect: "
                f"{', '.join(unsafe)} (serve them over NBD or attach them read-only)"
            )
        for arg in config.cmdline.split():
            key, _, value = arg.partition("=")
            if key == "init_on_free" and value.lower() in ("1", "on", "y", "yes", "true"):
                raise BalloonNotAllowed(
                    "the guest runs with init_on_free: it expects reported free pages to read as zeros, but "
                    "with copy-on-write RAM they read as the memory image (drop init_on_free or the balloon)"
                )
        if self._guard is None:
            reason = seccomp.seccomp_available()
            if reason is not None:
                raise BalloonNotAllowed(f"the punch-hole guard cannot run on this host: {reason}")
            self._guard = seccomp.punch_hole_guard()
        return self._guard

    # ---- boot / restore -----------------------------------------------------------------------------

    @asynccontextmanager
    async def boot(self, config: VmConfig) -> AsyncIterator[QemuVm]:
        config.validate()
        config.workdir.mkdir(parents=True, exist_ok=True)
        mode = config.mem_mode
        if mode is MemoryMode.ANONYMOUS:
            mem_path, share, owns = None, False, True
        elif mode is MemoryMode.SHARED:
            mem_path, share, owns = config.mem_path, True, True
            # A fresh sparse file: the guest's RAM, written through; it becomes the memory image.
            with open(mem_path, "wb") as f:
                f.truncate(config.mem_bytes)
        else:
            mem_path, share, owns = config.mem_path, False, config.mem_exclusive
            if not mem_path.is_file() or mem_path.stat().st_size < config.mem_bytes:
                raise VmmConfigError(f"PRIVATE memory needs an existing image of {config.mem_mib} MiB: {mem_path}")
        guard = self._discard_guard(config, owns_memory=owns)
        argv = self._argv(config, mem_path=mem_path, share=share, incoming=None)
        vm: QemuVm | None = None
        try:
            async with self._started(config, argv, guard) as (proc, qmp):
                vm = QemuVm(
                    self, config, proc, qmp, mem_path=mem_path, shared=share, restored_from=None,
                    discard_safe=owns or guard is not None,
                )  # fmt: skip
                vm.state = VmState.RUNNING
                if config.balloon is not None:
                    await vm._balloon_setup()
                yield vm
        finally:
            # The RAM file this boot created is garbage once QEMU is gone, unless a capture took it over.
            if mode is MemoryMode.SHARED and mem_path is not None and not (vm is not None and vm._sealed):
                mem_path.unlink(missing_ok=True)

    @asynccontextmanager
    async def restore(self, config: VmConfig, snapshot: SnapshotFiles, *, resume: bool = True) -> AsyncIterator[QemuVm]:
        config.validate()
        if snapshot.format not in (SnapshotFormat.QEMU_MIGRATION, SnapshotFormat.QEMU_DEVICES):
            raise SnapshotError(f"QEMU cannot restore a {snapshot.format} snapshot")
        for p in (snapshot.vmstate, snapshot.memory):
            if not p.is_file():
                raise SnapshotError(f"snapshot file missing: {p}")
        if snapshot.memory.stat().st_size != config.mem_bytes:
            raise SnapshotError(
                f"memory image {snapshot.memory} is {snapshot.memory.stat().st_size} bytes, "
                f"the VM has {config.mem_bytes}"
            )
        config.workdir.mkdir(parents=True, exist_ok=True)
        guard = self._discard_guard(config, owns_memory=config.mem_exclusive)
        argv = self._argv(config, mem_path=snapshot.memory, share=False, incoming=snapshot.format)
        async with self._started(config, argv, guard) as (proc, qmp):
            vm = QemuVm(
                self, config, proc, qmp, mem_path=snapshot.memory, shared=False, restored_from=snapshot,
                discard_safe=config.mem_exclusive or guard is not None,
            )  # fmt: skip
            await vm._incoming(snapshot, resume=resume)
            yield vm

    @asynccontextmanager
    async def attach(self, config: VmConfig, restored_from: SnapshotFiles, proc: ChildProcess) -> AsyncIterator[QemuVm]:
        """Take over a VM an earlier run of the node restored with ``config`` from ``restored_from`` and left
        running in ``proc``: its QMP socket is connected again (QEMU serves one client at a time; the dead
        node's connection is gone) and its run state read. Owned from here on as ``restore`` owns its VM."""
        async with adopted_process(proc, log_path=config.workdir / "qemu.log", sockets=[config.socket_path],
                                   pid_file=config.pid_file,
                                   cgroup=self.limits.cgroups.of(config.name) if self.limits else None) as vp:
            qmp = await QmpClient.connect(config.socket_path)
            try:
                vm = QemuVm(self, config, vp, qmp, mem_path=restored_from.memory, shared=False,
                            restored_from=restored_from,
                            discard_safe=config.mem_exclusive or (self.cow_discard and config.balloon is not None))
                status = (await vm._cmd("query-status"))["status"]
                vm.state = VmState.RUNNING if status == "running" else VmState.PAUSED
                yield vm
            finally:
                with trio.CancelScope(shield=True):
                    await qmp.aclose()

    @asynccontextmanager
    async def _started(
        self, config: VmConfig, argv: list[str], guard: seccomp.SeccompFilter | None = None
    ) -> AsyncIterator[tuple[VmmProcess, QmpClient]]:
        sock = config.socket_path
        async with vmm_process(
            argv,
            log_path=config.workdir / "qemu.log",
            sockets=[sock],
            netns=config.netns,
            cwd=config.workdir,
            seccomp=guard,
            pid_file=config.pid_file,
            spawner=self.spawner,
            key=config.name,
            cgroup=self.limits.create(config.name, config.vcpus, config.mem_mib) if self.limits else None,
        ) as proc:
            await proc.wait_for_socket(sock, self.start_timeout_s)
            try:
                qmp = await QmpClient.connect(sock)
                # QEMU opens its QMP socket before it loads the kernel: make sure it got past that.
                await qmp.execute("query-status")
            except VmmExited as e:
                with trio.move_on_after(1):
                    await proc.wait()
                raise VmmStartError(f"QEMU exited while starting: {e}", log_tail=proc.log_tail()) from e
            try:
                yield proc, qmp
            finally:
                with trio.CancelScope(shield=True):
                    await qmp.aclose()


class QemuVm(Vm):
    driver_name = "qemu"

    def __init__(
        self,
        driver: QemuDriver,
        config: VmConfig,
        proc: VmmProcess,
        qmp: QmpClient,
        *,
        mem_path: Path | None,
        shared: bool,
        restored_from: SnapshotFiles | None,
        discard_safe: bool,
    ) -> None:
        super().__init__(config, restored_from=restored_from)
        # The balloon may give memory back: the VM owns its RAM or QEMU runs under the punch-hole guard.
        self.discard_safe = discard_safe
        self._driver = driver
        self._proc = proc
        self._qmp = qmp
        self._mem_path = mem_path
        self._shared = shared
        self._sealed = False  # memory file handed over as a snapshot image: must not run again
        # vmstate of the last capture of a booted VM that has not run since (QEMU refuses a second
        # `migrate` from the post-migrate state; the device state is unchanged, so it is reused)
        self._clean_vmstate: Path | None = None
        self._lock = trio.Lock()

    @property
    def pid(self) -> int:
        return self._proc.pid

    async def _cmd(self, command: str, arguments: dict[str, Any] | None = None) -> Any:
        try:
            return await self._qmp.execute(command, arguments)
        except VmmExited as e:
            raise VmmExited(f"{e}\n--- QEMU output (tail) ---\n{self._proc.log_tail()}") from e

    async def _wait_until(self, what: str, predicate: Any) -> Any:
        """Poll `predicate()` (async, returns a truthy result when done) with a short back-off."""
        deadline = trio.current_time() + self._driver.op_timeout_s
        delay = 0.0002
        while True:
            result = await predicate()
            if result:
                return result
            if trio.current_time() > deadline:
                raise VmmTimeout(f"QEMU did not finish {what} within {self._driver.op_timeout_s:.0f} s")
            await trio.sleep(delay)
            delay = min(delay * 2, 0.002)

    async def _incoming(self, snapshot: SnapshotFiles, *, resume: bool) -> None:
        if snapshot.format is SnapshotFormat.QEMU_MIGRATION:
            await self._cmd(
                "migrate-set-capabilities", {"capabilities": [{"capability": "x-ignore-shared", "state": True}]}
            )
        await self._cmd("migrate-incoming", {"uri": f"exec:cat {shlex.quote(str(snapshot.vmstate))}"})

        async def loaded() -> str | None:
            self._proc.check_alive(f"loading {snapshot.vmstate}")
            status = (await self._cmd("query-status"))["status"]
            return None if status == "inmigrate" else status

        try:
            status = await self._wait_until("loading the snapshot", loaded)
        except VmmExited as e:
            raise SnapshotError(f"QEMU failed to load snapshot {snapshot.vmstate}: {e}") from e
        if status == "running":
            self.state = VmState.RUNNING
            if not resume:
                await self._cmd("stop")
                self.state = VmState.PAUSED
        else:
            self.state = VmState.PAUSED
            if resume:
                await self._cmd("cont")
                self.state = VmState.RUNNING

    async def _balloon_setup(self) -> None:
        b = self.config.balloon
        assert b is not None
        if b.stats_interval_s:
            await self._cmd(
                "qom-set",
                {
                    "path": "/machine/peripheral/balloon0",
                    "property": "guest-stats-polling-interval",
                    "value": b.stats_interval_s,
                },
            )
        if b.amount_mib:
            await self.balloon(b.amount_mib)

    # ---- the interface ------------------------------------------------------------------------------

    async def pause(self) -> None:
        async with self._lock:
            await self._pause_locked()

    async def _pause_locked(self) -> None:
        if self.state is VmState.PAUSED:
            return
        await self._cmd("stop")
        self.state = VmState.PAUSED

    async def resume(self) -> None:
        async with self._lock:
            if self._sealed:
                raise SnapshotError(
                    "this VM's memory file became a snapshot's memory image at capture; it cannot run again "
                    "(capture to a different memory path to keep the VM usable)"
                )
            if self.state is VmState.RUNNING:
                return
            await self._cmd("cont")
            self.state = VmState.RUNNING
            self._clean_vmstate = None

    async def capture(self, vmstate: Path, memory: Path, *, kind: CaptureKind = CaptureKind.FULL,
                      buffer: Any = None) -> CaptureResult:
        async with self._lock:
            t0 = time.perf_counter()
            await self._pause_locked()
            if vmstate != self._clean_vmstate:
                vmstate.unlink(missing_ok=True)
            used_buffer = None
            if self.restored_from is None:
                fmt, dirty = await self._capture_booted(vmstate, memory, kind)
            else:
                fmt, dirty, used_buffer = await self._capture_restored(vmstate, memory, kind, buffer)
            return CaptureResult(
                vmm="qemu",
                kind=kind,
                format=fmt,
                vmstate=vmstate,
                memory=memory,
                mem_size=self.config.mem_bytes,
                dirty_ranges=dirty,
                duration_s=time.perf_counter() - t0,
                buffer=used_buffer,
            )

    async def _capture_booted(
        self, vmstate: Path, memory: Path, kind: CaptureKind
    ) -> tuple[SnapshotFormat, tuple[MemoryRange, ...]]:
        if kind is CaptureKind.DIFF:
            raise UnsupportedOperation(
                "a booted QEMU VM has no base image to diff against: take a FULL capture (restore from it to "
                "get diff captures)"
            )
        if not self._shared or self._mem_path is None:
            raise UnsupportedOperation(
                "QEMU captures of a booted VM need RAM in a shared memory file (MemoryMode.SHARED)"
            )
        if self._clean_vmstate is not None and self._clean_vmstate.is_file():
            if self._clean_vmstate != vmstate:
                await trio.to_thread.run_sync(shutil.copyfile, self._clean_vmstate, vmstate)
        else:
            await self._cmd(
                "migrate-set-capabilities", {"capabilities": [{"capability": "x-ignore-shared", "state": True}]}
            )
            await self._cmd("migrate", {"uri": f"exec:cat > {shlex.quote(str(vmstate))}"})

            async def done() -> str | None:
                self._proc.check_alive("saving device state")
                info = await self._cmd("query-migrate")
                status = info.get("status")
                if status in ("failed", "cancelled"):
                    raise SnapshotError(f"QEMU device-state migration {status}: {info.get('error-desc', '')}")
                return status if status == "completed" else None

            await self._wait_until("saving device state", done)
            self._clean_vmstate = vmstate
        if memory.resolve() == self._mem_path.resolve():
            self._sealed = True
        else:
            await trio.to_thread.run_sync(memfile.copy_image, self._mem_path, memory)
        return SnapshotFormat.QEMU_MIGRATION, (MemoryRange(0, self.config.mem_bytes),)

    async def _capture_restored(
        self, vmstate: Path, memory: Path, kind: CaptureKind, buffer: Any
    ) -> tuple[SnapshotFormat, tuple[MemoryRange, ...], Any]:
        assert self.restored_from is not None
        base = self.restored_from.memory
        if memory.resolve() == base.resolve():
            raise SnapshotError(f"capture target {memory} is the image this VM was restored from")
        pid, size = self.pid, self.config.mem_bytes
        used: list[Any] = []

        def write_memory() -> tuple[MemoryRange, ...]:
            maps = pagemap.find_mappings(pid, base)
            ranges = pagemap.pages_to_ranges(pagemap.dirty_page_indices(pid, maps))
            if (kind is CaptureKind.DIFF and buffer is not None
                    and sum(r.length for r in ranges) <= buffer.size):
                pagemap.copy_to_buffer(pid, maps, ranges, buffer.address, buffer.size)
                used.append(buffer)
                return ranges
            if kind is CaptureKind.FULL:
                memfile.copy_image(base, memory)
                fd = os.open(memory, os.O_WRONLY)
            else:
                memory.unlink(missing_ok=True)
                fd = os.open(memory, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                os.ftruncate(fd, size)
            try:
                pagemap.copy_out(pid, maps, ranges, fd)
            finally:
                os.close(fd)
            return ranges

        ranges = await trio.to_thread.run_sync(write_memory)
        await self._cmd("xen-save-devices-state", {"filename": str(vmstate), "live": False})
        if kind is CaptureKind.FULL:
            ranges = (MemoryRange(0, size),)
        return SnapshotFormat.QEMU_DEVICES, ranges, used[0] if used else None

    async def balloon(self, amount_mib: int) -> None:
        self._check_balloon_amount(amount_mib)
        if amount_mib and not self.discard_safe:
            raise BalloonNotAllowed(
                "inflating the balloon of a VM with copy-on-write file-backed RAM makes QEMU 7.2 punch holes "
                "in the shared memory image: restore it with QemuDriver(cow_discard=True)"
            )
        # QMP `balloon` takes the guest's target memory size, not the balloon's.
        await self._cmd("balloon", {"value": (self.config.mem_mib - amount_mib) << 20})

    async def stats(self) -> VmStats:
        vmm: dict[str, Any] = {}
        if self._proc.alive():
            try:
                vmm["runstate"] = (await self._cmd("query-status"))["status"]
                if self.config.balloon is not None:
                    vmm["balloon_actual_bytes"] = (await self._cmd("query-balloon"))["actual"]
            except (VmmApiError, VmmExited):
                pass
        return self._process_stats(vmm)
