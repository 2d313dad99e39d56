"""The node's ``base`` template: built on first start from the guest kit and the base root filesystem, and
rebuilt when either changes (or the accelerator, or free page reporting), so a template never restores a
kernel or tools drive that no longer exists. Both inputs are cached by content hash (``images/``)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import trio
from sqlalchemy.orm import Session

from ..images import Kit, ensure_base_rootfs
from ..state import BuildStatus, Snapshot, Template
from .build import BuildResult
from .machine import BuildMachine

__all__ = ["base_template_current", "ensure_base_template"]

log = logging.getLogger(__name__)


def base_template_current(s: Session, template_id: str, kit: Kit, rootfs: Path, machine: BuildMachine
                          ) -> Optional[str]:
    """The template's boot snapshot if it was built from this kit, root filesystem and machine (its VMM too: a
    node whose ``vmm.kind`` changed cannot restore the other VMM's snapshot, even of the same kernel), else
    None."""
    t = s.get(Template, template_id)
    if t is None or t.status != BuildStatus.READY or t.boot_snapshot_id is None:
        return None
    sn = s.get(Snapshot, t.boot_snapshot_id)
    if sn is None or sn.config is None:
        return None
    shape = sn.config.shape
    if sn.vmm != machine.driver.name or shape.kernel != str(machine.kernel(kit)) or shape.tools_img != str(kit.tools_img) \
            or shape.accel != machine.accel.value or shape.free_page_reporting != machine.free_page_reporting \
            or sn.config.rootfs != str(rootfs):
        return None
    return t.boot_snapshot_id


async def ensure_base_template(machine: BuildMachine, template_id: str, *, vcpus: int, mem_mib: int,
                               disk_size_mb: int) -> Optional[BuildResult]:
    """Build the template from the base rootfs and current kit unless one is current; the build, or None."""
    kit = await machine.kit()
    rootfs = await trio.to_thread.run_sync(ensure_base_rootfs, machine.images_cache_dir)
    if await machine.db.run(base_template_current, template_id, kit, rootfs, machine) is not None:
        return None
    log.info("building template %r (kit %s)", template_id, kit.hash[:12])
    result = await machine.build(machine.source(kit, rootfs=rootfs), template_id=template_id, alias=template_id,
                                 vcpus=vcpus, mem_mib=mem_mib, disk_size_mb=disk_size_mb)
    log.info("template %r ready in %.1fs (boot %.1fs, capture %.0f ms)", template_id, result.duration_s,
             result.boot_s, result.capture_s * 1000)
    return result
