"""The one interface every VMM driver implements, and the plain data that crosses it.

The layers above (snapshot/, runtime/) talk only to `VmmDriver` and `Vm`; nothing QEMU- or Firecracker-
specific leaks out of vmm/. The shape follows what both VMMs can do cheaply:

* `VmmDriver.boot(config)` and `VmmDriver.restore(config, snapshot)` are async context managers. Each owns
  exactly one VMM process: leaving the block (normally, by an exception or by cancellation) kills the
  process, reaps it and removes its sockets. There is no other way to get a `Vm`.
* A restore always maps the snapshot's memory image copy-on-write (QEMU `share=off`, Firecracker
  `mem_backend: File`), so any number of VMs can be restored from one image at once (fork) and share its
  page cache, and the image never changes.
* `Vm.capture()` writes device state + memory. A FULL capture leaves a complete memory image; a DIFF
  capture leaves a sparse file of guest-memory size holding the pages written since the most recent
  capture or restore of this VM (at least those: QEMU reports every page written since the restore,
  Firecracker those since its last snapshot; `dirty_ranges` lists them), to be laid over the image of that
  capture or restore. A booted VM has no base: its first capture is FULL. Materializing base + diffs into
  one file is the storage layer's job (`memfile.materialize` is the minimal version).
* A snapshot is described by `SnapshotFiles` (vmstate, memory image, format); a restore needs the same
  `VmConfig` shape (vcpus, memory size, devices) that the captured VM had.
"""

from __future__ import annotations

import enum
import time
from abc import ABC, abstractmethod
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import trio

from . import pagemap
from .errors import UnsupportedOperation, VmmConfigError
from .memory import MemoryRange
from .cgroup import VmmLimits
from .process import ChildProcess, Spawner, proc_cpu_seconds, proc_memory

# sockaddr_un.sun_path is 108 bytes including the terminating NUL.
_MAX_UNIX_PATH = 107


class Accel(enum.StrEnum):
    """How the guest's CPU runs: hardware virtualization or QEMU's software emulation."""

    KVM = "kvm"
    TCG = "tcg"


class MemoryMode(enum.StrEnum):
    """How a booted VM's RAM is backed.

    SHARED: RAM is a file mapped shared (QEMU `share=on`): the file is the memory image, so a capture only
    saves device state. PRIVATE: a file mapped copy-on-write (the file never changes). ANONYMOUS: plain
    anonymous memory (Firecracker always boots this way; a capture writes the image).
    """

    SHARED = "shared"
    PRIVATE = "private"
    ANONYMOUS = "anonymous"


class KernelFormat(enum.StrEnum):
    """Which image of the guest kernel a VMM boots: the compressed ``bzImage`` or the uncompressed ELF ``vmlinux``
    (Firecracker on x86 loads only ELF)."""

    BZIMAGE = "bzimage"
    ELF = "elf"


class CaptureKind(enum.StrEnum):
    FULL = "full"
    DIFF = "diff"


class SnapshotFormat(enum.StrEnum):
    """What a vmstate file holds; `restore` needs it to replay the file the right way."""

    QEMU_MIGRATION = "qemu-migration"  # `migrate` stream with x-ignore-shared (RAM not in it)
    QEMU_DEVICES = "qemu-devices"  # `xen-save-devices-state`: device state only
    FIRECRACKER = "firecracker"  # Firecracker snapshot state file


class VmState(enum.StrEnum):
    STARTING = "starting"
    RUNNING = "running"
    PAUSED = "paused"
    STOPPED = "stopped"


@dataclass(frozen=True)
class Drive:
    """A virtio block device. `source` is a file path or `nbd+unix:///EXPORT?socket=PATH` (QEMU only)."""

    source: str
    read_only: bool = False

    @property
    def is_nbd(self) -> bool:
        return self.source.startswith("nbd")


@dataclass(frozen=True)
class NetIf:
    """A virtio-net device backed by an existing tap device (in `VmConfig.netns` when that is set)."""

    tap: str
    mac: str


@dataclass(frozen=True)
class BalloonConfig:
    """A virtio balloon device, present from boot. `amount_mib` is what the balloon takes from the guest.

    `free_page_reporting` is only honoured where it is safe (see `BalloonNotAllowed`); drivers refuse it
    otherwise.
    """

    amount_mib: int = 0
    deflate_on_oom: bool = True
    free_page_reporting: bool = False
    stats_interval_s: int = 0


@dataclass(frozen=True)
class VmConfig:
    """Everything needed to start one VM. Paths default to files inside `workdir`.

    `mem_file`/`mem_mode` describe how a *booted* VM's RAM is backed (drivers that cannot do a mode pick the
    nearest they can and say so in their docstring); a restored VM always maps the snapshot's memory image
    copy-on-write. `mem_exclusive` declares that no other VM maps the same memory file, which is what makes
    free page reporting safe on QEMU.
    """

    workdir: Path
    kernel: Path
    vcpus: int = 1
    mem_mib: int = 256
    initrd: Path | None = None
    cmdline: str = ""
    drives: tuple[Drive, ...] = ()
    net: NetIf | None = None
    mem_file: Path | None = None
    mem_mode: MemoryMode = MemoryMode.SHARED
    mem_exclusive: bool = False
    balloon: BalloonConfig | None = None
    console_log: Path | None = None
    api_socket: Path | None = None
    netns: Path | None = None  # e.g. /run/netns/slot7: the VMM process runs in this network namespace
    accel: Accel = Accel.KVM
    name: str = "aenv-vm"
    #: where the VMM's pid is written, by the process itself before the VMM binary runs (``vmm_process``):
    #: a node killed at any moment leaves a record of every VMM it started, for its reconciler
    pid_file: Path | None = None

    @property
    def mem_bytes(self) -> int:
        return self.mem_mib << 20

    @property
    def console_path(self) -> Path:
        return self.console_log or self.workdir / "console.log"

    @property
    def socket_path(self) -> Path:
        return self.api_socket or self.workdir / "api.sock"

    @property
    def mem_path(self) -> Path:
        return self.mem_file or self.workdir / "memory"

    def validate(self) -> None:
        if self.vcpus < 1:
            raise VmmConfigError(f"vcpus must be >= 1, got {self.vcpus}")
        if self.mem_mib < 8:
            raise VmmConfigError(f"mem_mib must be >= 8, got {self.mem_mib}")
        if len(str(self.socket_path)) > _MAX_UNIX_PATH:
            raise VmmConfigError(
                f"API socket path is {len(str(self.socket_path))} bytes, over the {_MAX_UNIX_PATH}-byte "
                f"limit of unix sockets: {self.socket_path}; use a shorter workdir or api_socket"
            )
        if not self.kernel.is_file():
            raise VmmConfigError(f"kernel not found: {self.kernel}")
        if self.initrd is not None and not self.initrd.is_file():
            raise VmmConfigError(f"initrd not found: {self.initrd}")


@dataclass(frozen=True)
class SnapshotFiles:
    """What a restore needs: device state, a complete memory image (mapped copy-on-write), their format."""

    vmstate: Path
    memory: Path
    format: SnapshotFormat


@dataclass(frozen=True)
class CaptureResult:
    """The outcome of `Vm.capture`.

    FULL: `memory` is a complete image. DIFF: `memory` is a sparse file of `mem_size` bytes in which only
    `dirty_ranges` hold data; lay them over the image of the VM's previous capture (or of its restore) to
    get a complete image: which of the two, `since_restore` says.
    """

    vmm: str
    kind: CaptureKind
    format: SnapshotFormat
    vmstate: Path
    memory: Path
    mem_size: int
    dirty_ranges: tuple[MemoryRange, ...]
    duration_s: float
    #: DIFF into a capture buffer: the dirty pages are in `buffer.view`, packed in `dirty_ranges` order, and
    #: no `memory` file was written. Valid until the buffer is given back.
    buffer: Any = None
    #: DIFF: the pages are those dirtied since the VM's restore (QEMU: the pagemap of its copy-on-write
    #: image, which only grows), not only since its previous capture (Firecracker: KVM's dirty log, reset by
    #: every snapshot). When False, the next capture of this VM is a diff against *this* capture's image.
    since_restore: bool = True

    @property
    def dirty_bytes(self) -> int:
        return sum(r.length for r in self.dirty_ranges)

    def snapshot_files(self, memory: Path | None = None) -> SnapshotFiles:
        """The files to restore from. A DIFF capture needs `memory`: the materialized full image."""
        if self.kind is CaptureKind.DIFF and memory is None:
            raise VmmConfigError(
                "a DIFF capture holds only dirty pages: materialize base + diff into one image and pass it"
            )
        return SnapshotFiles(vmstate=self.vmstate, memory=memory or self.memory, format=self.format)


@dataclass(frozen=True)
class VmStats:
    pid: int
    state: VmState
    rss_bytes: int
    pss_bytes: int
    cpu_seconds: float
    uptime_s: float
    vmm: dict[str, Any] = field(default_factory=dict)


class Vm(ABC):
    """A running VMM process with one guest. Obtained only from a driver's `boot`/`restore` context."""

    driver_name: str

    def __init__(self, config: VmConfig, *, restored_from: SnapshotFiles | None) -> None:
        self.config = config
        self.restored_from = restored_from
        self.state = VmState.STARTING
        self.started_at = time.monotonic()

    @property
    @abstractmethod
    def pid(self) -> int: ...

    @abstractmethod
    async def pause(self) -> None:
        """Stop the vCPUs. Idempotent."""

    @abstractmethod
    async def resume(self) -> None:
        """Run the vCPUs again. Idempotent."""

    @abstractmethod
    async def capture(self, vmstate: Path, memory: Path, *, kind: CaptureKind = CaptureKind.FULL,
                      buffer: Any = None) -> CaptureResult:
        """Pause (if running) and write device state to `vmstate` and memory to `memory`.

        `buffer` (a `CaptureBuffer`, DIFF only): copy the dirty pages into it instead of `memory` when the
        driver can and they fit (`CaptureResult.buffer` says whether it did): the fastest copy, so the
        shortest pause. The VM is left paused: `resume()` it or leave the context to stop it.
        """

    async def dirty_memory_ranges(self) -> tuple[MemoryRange, ...]:
        """Guest memory written since the VM was restored (all of it for a booted VM).

        Both VMMs map a restored VM's memory image MAP_PRIVATE, so the pagemap method serves both.
        """
        if self.restored_from is None:
            return (MemoryRange(0, self.config.mem_bytes),)
        return await trio.to_thread.run_sync(pagemap.dirty_ranges, self.pid, self.restored_from.memory)

    @abstractmethod
    async def balloon(self, amount_mib: int) -> None:
        """Set how much memory the balloon takes from the guest (needs `VmConfig.balloon`)."""

    def _check_balloon_amount(self, amount_mib: int) -> None:
        if self.config.balloon is None:
            raise UnsupportedOperation("this VM has no balloon device: set VmConfig.balloon at boot")
        if not 0 <= amount_mib < self.config.mem_mib:
            raise VmmConfigError(f"balloon amount {amount_mib} MiB outside [0, {self.config.mem_mib})")

    @abstractmethod
    async def stats(self) -> VmStats: ...

    #: The VMM process (set by the driver before the Vm is handed out).
    _proc: Any

    def _process_stats(self, vmm: dict[str, Any]) -> VmStats:
        """Stats every VMM shares (process memory and CPU) plus the VMM's own ``vmm`` fields."""
        rss, pss = proc_memory(self.pid)
        return VmStats(
            pid=self.pid,
            state=self.state if self._proc.alive() else VmState.STOPPED,
            rss_bytes=rss,
            pss_bytes=pss,
            cpu_seconds=proc_cpu_seconds(self.pid),
            uptime_s=time.monotonic() - self.started_at,
            vmm=vmm,
        )

    def detach(self) -> None:
        """Leave the VMM running when its context exits (a node stopping with its VMMs in the data plane, for
        its next run to take over): nothing is killed or removed. Only a ``Spawner``'s processes outlive us."""
        self._proc.detached = True

    async def stop(self) -> None:
        """Kill the VMM process now and reap it (the context exit does the same if not done)."""
        await self._proc.kill()
        self.state = VmState.STOPPED

    async def wait(self) -> int:
        """Wait until the VMM process exits; its exit status."""
        rc = await self._proc.wait()
        self.state = VmState.STOPPED
        return rc


@runtime_checkable
class VmmDriver(Protocol):
    """A VMM behind the common interface. Instances are cheap, hold no processes and may be shared."""

    name: str
    #: whether the VMM has its own NBD client (a ``Drive`` may then be an ``nbd+unix://`` URI); one without
    #: it opens only files and block devices, so its disks go through ublk or FUSE (storage/frontends)
    nbd_client: bool
    #: the kernel image the VMM boots
    kernel_format: KernelFormat
    #: where VMM processes start (the node's data plane, so they outlive a restart of the node); None: as
    #: children of this process
    spawner: Spawner | None
    #: each VMM in its own cgroup with these limits (``cgroup.py``); None: unlimited
    limits: VmmLimits | None

    def boot(self, config: VmConfig) -> AbstractAsyncContextManager[Vm]:
        """Start a VMM process and boot the guest; the VM is running when the context is entered."""
        ...

    def restore(
        self, config: VmConfig, snapshot: SnapshotFiles, *, resume: bool = True
    ) -> AbstractAsyncContextManager[Vm]:
        """Start a VMM process from a snapshot, its memory image mapped copy-on-write."""
        ...

    def attach(self, config: VmConfig, restored_from: SnapshotFiles,
               proc: ChildProcess) -> AbstractAsyncContextManager[Vm]:
        """Take over a VM an earlier run of the node restored with ``config`` (the same shape and paths) and
        left running in ``proc``; owned from here on as a restore's VM is."""
        ...
