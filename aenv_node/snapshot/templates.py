"""Building a template: the only place a sandbox machine cold-boots.

A build imports the template's root filesystem as a base layer, boots a
machine on it (RAM in a file mapped shared), waits for envd, and captures a
**boot snapshot**: device state + that memory file, plus the disk as it was at
the capture (the build's upper, sealed into a layer). Every sandbox created
from the template restores this snapshot copy-on-write (DESIGN.md "create from
template").

The build is recorded as it goes: a ``template_builds`` row (building -> ready
| error), then in one transaction the layers, the boot snapshot with its layer
stack, and the template pointing at it. A failed build leaves no template,
snapshot or layer rows and removes its files.
"""

from __future__ import annotations

import logging
import secrets
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import trio

from ..net import SlotPool
from ..state import Database, Layer, Snapshot, SnapshotLayer, Template, TemplateBuild, utcnow
from ..state.repository import record_event
from ..storage.image import Image
from ..storage.importer import import_raw
from ..storage.layer import LayerInfo
from ..vmm import CaptureKind, VmmDriver
from .envd import wait_envd
from .machine import MachineShape, open_machine

__all__ = ["TemplateSource", "BuildResult", "build_template", "new_id", "layer_digest", "reference_layer"]

log = logging.getLogger(__name__)


def layer_digest(info: "LayerInfo") -> str:
    """The digest as the database and repositories name it."""
    return f"sha256:{info.digest}"


def reference_layer(s, info: "LayerInfo", kind: str) -> Layer:  # type: ignore[no-untyped-def]
    """Record a layer file (once) and count one more snapshot referencing it."""
    row = s.get(Layer, layer_digest(info))
    if row is None:
        row = Layer(digest=layer_digest(info), kind=kind, size_bytes=info.file_size,
                    virtual_size_bytes=info.virtual_size, location=str(info.path), refcount=0)
        s.add(row)
    row.refcount += 1
    return row


def new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(10)}"


@dataclass(frozen=True)
class TemplateSource:
    """What a template is built from: a raw ext4 root filesystem and the guest kit."""

    rootfs: Path
    kernel: Path
    initrd: Path
    tools_img: Path
    cmdline: str
    kit_hash: str
    free_page_reporting: bool = False


@dataclass(frozen=True)
class BuildResult:
    template_id: str
    snapshot_id: str
    build_id: str
    duration_s: float
    boot_s: float
    capture_s: float


async def build_template(
    *,
    db: Database,
    driver: VmmDriver,
    accel: str,
    pool: SlotPool,
    source: TemplateSource,
    layers_dir: Path,
    snapshots_dir: Path,
    work_root: Path,
    run_root: Path,
    template_id: str,
    alias: Optional[str],
    vcpus: int,
    mem_mib: int,
    disk_size_mb: int,
    envd_version: str,
    boot_timeout_s: float = 180.0,
) -> BuildResult:
    started = time.monotonic()
    build_id = new_id("bld_")
    snapshot_id = new_id("snp_")
    snap_dir = snapshots_dir / snapshot_id
    workdir = work_root / build_id
    shape = MachineShape(
        vcpus=vcpus, mem_mib=mem_mib, kernel=str(source.kernel), initrd=str(source.initrd),
        cmdline=source.cmdline, tools_img=str(source.tools_img), accel=accel,
        free_page_reporting=source.free_page_reporting,
    )

    def begin(s) -> None:  # type: ignore[no-untyped-def]
        if s.get(Template, template_id) is None:
            s.add(Template(id=template_id, alias=alias, status="building", cpu_count=vcpus,
                           memory_mb=mem_mib, disk_size_mb=disk_size_mb, envd_version=envd_version))
        s.add(TemplateBuild(id=build_id, template_id=template_id, status="building",
                            source=str(source.rootfs), kit_hash=source.kit_hash,
                            log_path=str(workdir / "console.log")))
        record_event(s, "template_build", subject="template", subject_id=template_id,
                     to_state="building", detail={"build_id": build_id})

    await db.run(begin)
    layers_dir.mkdir(parents=True, exist_ok=True)
    snap_dir.mkdir(parents=True, exist_ok=True)
    image: Image | None = None
    try:
        log.info("template %s: importing %s as the base layer", template_id, source.rootfs.name)
        t_imp = time.monotonic()
        disk_bytes = disk_size_mb << 20
        base = await trio.to_thread.run_sync(
            lambda: import_raw(source.rootfs, layers_dir, virtual_size=max(
                disk_bytes, -(-source.rootfs.stat().st_size // 4096) * 4096)))
        log.info("template %s: base layer %s in %.1fs", template_id, base.digest[:12], time.monotonic() - t_imp)
        image = await trio.to_thread.run_sync(
            lambda: Image.open([base.path], workdir / "upper"))
        slot = await pool.acquire()
        try:
            t_boot = time.monotonic()
            async with open_machine(driver, shape, disk=image, slot=slot, workdir=workdir,
                                    run_dir=run_root / build_id, mem_file=snap_dir / "memory",
                                    name=f"aenv-build-{template_id}") as m:
                await wait_envd(slot.address, timeout=boot_timeout_s)
                boot_s = time.monotonic() - t_boot
                log.info("template %s: envd ready %.1fs after boot; capturing", template_id, boot_s)
                t_cap = time.monotonic()
                capture = await m.vm.capture(snap_dir / "vmstate", snap_dir / "memory",
                                             kind=CaptureKind.FULL)
                capture_s = time.monotonic() - t_cap
                await m.vm.stop()
        finally:
            await pool.release(slot)
            shutil.rmtree(run_root / build_id, ignore_errors=True)
        sealed = await trio.to_thread.run_sync(image.seal, layers_dir)
        await trio.to_thread.run_sync(image.close)
        image = None

        def commit(s) -> None:  # type: ignore[no-untyped-def]
            for info in (base, sealed):
                reference_layer(s, info, "disk")
            s.add(Snapshot(
                id=snapshot_id, kind="boot", status="committed", template_id=template_id,
                vmm=capture.vmm, vmstate_location=str(capture.vmstate),
                config={"shape": shape.to_json(), "format": capture.format.value,
                        "memory": str(capture.memory), "memory_layers": [],
                        "envd_version": envd_version, "rootfs": str(source.rootfs),
                        "kit_hash": source.kit_hash},
                memory_mb=mem_mib, committed_at=utcnow(),
            ))
            s.flush()
            s.add(SnapshotLayer(snapshot_id=snapshot_id, kind="disk", position=0, layer_digest=layer_digest(base)))
            s.add(SnapshotLayer(snapshot_id=snapshot_id, kind="disk", position=1, layer_digest=layer_digest(sealed)))
            t = s.get(Template, template_id)
            old_snapshot = t.boot_snapshot_id
            t.status = "ready"
            t.boot_snapshot_id = snapshot_id
            t.cpu_count, t.memory_mb, t.disk_size_mb = vcpus, mem_mib, disk_size_mb
            t.envd_version = envd_version
            b = s.get(TemplateBuild, build_id)
            b.status = "ready"
            b.finished_at = utcnow()
            b.duration_ms = (time.monotonic() - started) * 1000
            record_event(s, "template_build", subject="template", subject_id=template_id,
                         from_state="building", to_state="ready", duration_ms=b.duration_ms,
                         detail={"build_id": build_id, "snapshot_id": snapshot_id,
                                 "replaced_snapshot_id": old_snapshot,
                                 "boot_s": round(boot_s, 3), "capture_ms": round(capture_s * 1000, 1)})

        await db.run(commit)
        shutil.rmtree(workdir / "upper", ignore_errors=True)
        return BuildResult(template_id, snapshot_id, build_id, time.monotonic() - started, boot_s, capture_s)
    except BaseException as exc:
        with trio.CancelScope(shield=True):
            if image is not None:
                await trio.to_thread.run_sync(image.close)
            shutil.rmtree(snap_dir, ignore_errors=True)
            message = f"{type(exc).__name__}: {exc}"

            def fail(s) -> None:  # type: ignore[no-untyped-def]
                b = s.get(TemplateBuild, build_id)
                b.status = "error"
                b.error = message
                b.finished_at = utcnow()
                t = s.get(Template, template_id)
                if t is not None and t.boot_snapshot_id is None:
                    t.status = "error"
                record_event(s, "template_build", subject="template", subject_id=template_id,
                             from_state="building", to_state="error", error=message,
                             detail={"build_id": build_id,
                                     "console_log": str(workdir / "console.log")})

            await db.run(fail)
        raise
