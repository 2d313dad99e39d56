"""The node's ``base`` template: built on first start from the guest kit and the base root filesystem, and
rebuilt when either changes (or the accelerator, or free page reporting), so a template never restores a
kernel or tools drive that no longer exists. Both inputs are cached by content hash (``images/``)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import trio
from sqlalchemy.orm import Session

from ..images import Kit, ensure_base_rootfs, ensure_kit, kernel_cmdline
from ..images.kit import host_tsc_khz
from ..net import SlotPool
from ..state import BuildStatus, Database, Snapshot, Template
from ..storage.frontends import DiskFrontend
from ..vmm import Accel, KernelFormat, VmmDriver
from .build import BuildResult, TemplateSource, build_template

__all__ = ["BaseTemplateInputs", "base_template_current", "ensure_base_template"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BaseTemplateInputs:
    """What a build of ``base`` depends on besides the kit and the root filesystem."""

    driver: VmmDriver
    accel: Accel
    frontend: DiskFrontend
    free_page_reporting: bool
    images_cache_dir: Path
    layers_dir: Path
    snapshots_dir: Path
    work_root: Path
    run_root: Path
    vcpus: int
    mem_mib: int
    disk_size_mb: int
    envd_version: str
    boot_timeout_s: float


def kernel_of(kit: Kit, driver: VmmDriver) -> Path:
    """The kit's kernel image in the format ``driver`` boots."""
    return kit.vmlinux if driver.kernel_format is KernelFormat.ELF else kit.vmlinuz


def base_template_current(s: Session, template_id: str, kit: Kit, rootfs: Path, inputs: BaseTemplateInputs
                          ) -> Optional[str]:
    """The template's boot snapshot if it was built from this kit, root filesystem and machine, else None."""
    t = s.get(Template, template_id)
    if t is None or t.status != BuildStatus.READY or t.boot_snapshot_id is None:
        return None
    sn = s.get(Snapshot, t.boot_snapshot_id)
    if sn is None or sn.config is None:
        return None
    shape = sn.config.shape
    if shape.kernel != str(kernel_of(kit, inputs.driver)) or shape.tools_img != str(kit.tools_img) \
            or shape.accel != inputs.accel.value or shape.free_page_reporting != inputs.free_page_reporting \
            or sn.config.rootfs != str(rootfs):
        return None
    return t.boot_snapshot_id


async def ensure_base_template(db: Database, pool: SlotPool, template_id: str,
                               inputs: BaseTemplateInputs) -> Optional[BuildResult]:
    """Build the template from the base rootfs and current kit unless one is current; the build, or None."""
    kit = await trio.to_thread.run_sync(ensure_kit, inputs.images_cache_dir)
    rootfs = await trio.to_thread.run_sync(ensure_base_rootfs, inputs.images_cache_dir)
    if await db.run(base_template_current, template_id, kit, rootfs, inputs) is not None:
        return None
    log.info("building template %r (kit %s)", template_id, kit.hash[:12])
    tsc = host_tsc_khz() if inputs.accel is Accel.TCG else None
    source = TemplateSource(rootfs=rootfs, kernel=kernel_of(kit, inputs.driver), initrd=kit.initramfs, tools_img=kit.tools_img,
                            cmdline=kernel_cmdline(tsc_khz=tsc), kit_hash=kit.hash,
                            free_page_reporting=inputs.free_page_reporting)
    result = await build_template(
        db=db, driver=inputs.driver, accel=inputs.accel.value, pool=pool, frontend=inputs.frontend, source=source,
        layers_dir=inputs.layers_dir, snapshots_dir=inputs.snapshots_dir, work_root=inputs.work_root,
        run_root=inputs.run_root, template_id=template_id, alias=template_id, vcpus=inputs.vcpus,
        mem_mib=inputs.mem_mib, disk_size_mb=inputs.disk_size_mb, envd_version=inputs.envd_version,
        boot_timeout_s=inputs.boot_timeout_s)
    log.info("template %r ready in %.1fs (boot %.1fs, capture %.0f ms)", template_id, result.duration_s,
             result.boot_s, result.capture_s * 1000)
    return result
