"""The build machine: what every template build boots with (the VMM driver, accelerator, disk frontend, where
its files go, how long its boot may take) and the guest kit's part of its source, in one record that the
node's own ``base`` and the builds from recipes share."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable

import trio

from ..images import Kit, ensure_kit, kernel_cmdline
from ..images.kit import host_tsc_khz
from ..net import SlotPool
from ..state import Database
from ..storage.frontends import DiskFrontend
from ..vmm import Accel, KernelFormat, VmmDriver
from .build import BuildResult, Prepare, TemplateSource, build_template

__all__ = ["BuildMachine"]


@dataclass(frozen=True)
class BuildMachine:
    db: Database
    pool: SlotPool
    driver: VmmDriver
    accel: Accel
    frontend: DiskFrontend
    free_page_reporting: bool
    images_cache_dir: Path  # the guest kit, root filesystems, OCI blobs
    layers_dir: Path
    snapshots_dir: Path
    work_root: Path  # per build: its console log, its disk's upper
    run_root: Path  # per build: its VMM's sockets
    envd_version: str
    boot_timeout_s: float

    def kernel(self, kit: Kit) -> Path:
        """The kit's kernel image in the format this machine's VMM boots."""
        return kit.vmlinux if self.driver.kernel_format is KernelFormat.ELF else kit.vmlinuz

    async def kit(self) -> Kit:
        return await trio.to_thread.run_sync(ensure_kit, self.images_cache_dir)

    def source(self, kit: Kit, **disk: Any) -> TemplateSource:
        """A build source booting ``kit`` on this machine; ``disk``: the rest of ``TemplateSource`` (a root
        filesystem or layers, and what the template inherits)."""
        tsc = host_tsc_khz() if self.accel is Accel.TCG else None
        return TemplateSource(kernel=self.kernel(kit), initrd=kit.initramfs, tools_img=kit.tools_img,
                              cmdline=kernel_cmdline(tsc_khz=tsc), kit_hash=kit.hash,
                              free_page_reporting=self.free_page_reporting, **disk)

    async def build(self, source: TemplateSource, *, template_id: str, alias: str | None, vcpus: int, mem_mib: int,
                    disk_size_mb: int, build_id: str | None = None, prepare: Prepare | None = None,
                    ready: Callable[[Path], Awaitable[None]] | None = None) -> BuildResult:
        """Boot ``source``, run ``prepare`` and take the template's boot snapshot (``build.build_template``);
        ``ready``: a guest without envd, up once it returns (``import_vm``)."""
        return await build_template(
            db=self.db, driver=self.driver, accel=self.accel.value, pool=self.pool, frontend=self.frontend,
            source=source, layers_dir=self.layers_dir, snapshots_dir=self.snapshots_dir, work_root=self.work_root,
            run_root=self.run_root, template_id=template_id, alias=alias, vcpus=vcpus, mem_mib=mem_mib,
            disk_size_mb=disk_size_mb, envd_version="" if ready is not None else self.envd_version,
            boot_timeout_s=self.boot_timeout_s, build_id=build_id, prepare=prepare, ready=ready)
