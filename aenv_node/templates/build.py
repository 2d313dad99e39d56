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
import re
import shutil
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import trio

from sqlalchemy.orm import Session

from ..faults import crash_point
from ..images import ImageError
from ..net import SlotPool
from ..snapshot.envd import EnvdUnavailable, wait_envd
from ..snapshot.layers import layer_digest, record_stack, reference_layer
from ..snapshot.machine import open_machine
from ..state import (
    BuildStatus,
    Database,
    EventSubject,
    Layer,
    LayerKind,
    MachineShape,
    Snapshot,
    SnapshotConfig,
    SnapshotKind,
    SnapshotStatus,
    Template,
    TemplateBuild,
    new_id,
    utcnow,
)
from ..state.repository import record_event
from ..storage import Image, LayerInfo, LayerReader, LayerRef, import_raw_cached
from ..storage.frontends import DiskFrontend
from ..vmm import CaptureKind, CaptureResult, VmmDriver
from .errors import GuestNotReady, TemplateBuildError
from .names import DEFAULT_TAG, assign_tags

__all__ = ["BuildResult", "GuestDefaults", "Prepare", "TemplateSource", "build_template"]

log = logging.getLogger(__name__)

#: A cold boot under emulation very rarely hangs for good (QEMU TCG's multi-threaded translation has races
#: with a kernel patching its own code); a second boot from the same base layer is cheap next to failing the
#: build. Only the envd wait is retried: a VMM that fails to start fails the build at once.
BOOT_ATTEMPTS = 2


def _top_size(stack: list[Path]) -> int:
    """The largest virtual size among the layers (a converted layer may have grown the disk)."""
    size = 0
    for p in stack:
        reader = LayerReader.open(p)
        try:
            size = max(size, reader.virtual_size)
        finally:
            reader.close()
    return size


def _console_tail(path: Path, limit: int = 400) -> str:
    try:
        text = path.read_text(errors="replace").strip()
    except OSError:
        return "(no console log)"
    return repr(text[-limit:]) if text else "(empty console)"


@dataclass(frozen=True)
class TemplateSource:
    """What a template is built from: the guest kit, and either a raw ext4 root filesystem (imported as the
    base layer) or block layers already made (an OCI image's, converted and provisioned), bottom first."""

    kernel: Path
    initrd: Path | None  # (None, and no tools image: a VM imported without the guest kit, ``import_vm``)
    tools_img: Path | None
    cmdline: str
    kit_hash: str
    free_page_reporting: bool = False
    rootfs: Path | None = None
    layers: tuple[Path, ...] = ()
    #: what the build row says it was built from (default: the rootfs path), and what that resolved to
    description: str = ""
    source_digest: str | None = None
    #: the guest's environment and defaults every sandbox of the template starts with (an image's config)
    env_vars: tuple[tuple[str, str], ...] = ()
    default_user: str | None = None
    default_workdir: str | None = None

    def __post_init__(self) -> None:
        if (self.rootfs is None) == (not self.layers):
            raise ValueError("a template source is a rootfs or layers, exactly one of them")


@dataclass(frozen=True)
class GuestDefaults:
    """The environment, default user and working directory every sandbox of a template starts with."""

    env_vars: dict[str, str]
    default_user: str | None = None
    default_workdir: str | None = None


#: ``prepare(host, seal)``: ``seal()`` turns what the guest wrote to its disk so far into a layer of its own
#: (the guest must have synced), so a recipe can cache each step's result.
Prepare = Callable[[str, Callable[[], Awaitable[LayerInfo]]], Awaitable[GuestDefaults | None]]


@dataclass(frozen=True)
class BuildResult:
    template_id: str
    snapshot_id: str
    build_id: str
    duration_s: float
    boot_s: float
    capture_s: float


def _vm_name(template_id: str) -> str:
    """The build VM's name: letters, digits and '-' only (Firecracker's ``--id`` allows no more; ids are
    ``tpl_<hex>``)."""
    return "aenv-build-" + re.sub(r"[^A-Za-z0-9-]", "-", template_id)[:53]


#: room a build needs on the state disk beyond its RAM image (its disk upper, console, step layers)
BUILD_HEADROOM_MIB = 256


def _check_room(directory: Path, *, need_mib: int) -> None:
    """Fail at once, and say why, when the state disk cannot hold a build: a guest whose RAM file cannot grow
    hangs at boot with an empty console instead of failing."""
    free_mib = shutil.disk_usage(directory).free >> 20
    if free_mib < need_mib:
        raise TemplateBuildError(f"the node's state disk is full: {free_mib} MiB free under {directory}, a build "
                                 f"of this template needs at least {need_mib} MiB (No space left on device)")


async def build_template(
    *,
    db: Database,
    driver: VmmDriver,
    accel: str,
    pool: SlotPool,
    frontend: DiskFrontend,
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
    build_id: str | None = None,
    prepare: Prepare | None = None,
    ready: Callable[[Path], Awaitable[None]] | None = None,
) -> BuildResult:
    """Build ``template_id`` from ``source`` (see the module docstring). ``build_id``: a build row made earlier
    (the API registers builds before they run), else a new one. ``prepare(host, seal)`` runs once envd answers in the
    build VM, before the capture (a recipe's steps, start command and ready check); it may return the
    environment, default user and workdir the template gets instead of the source's.

    An empty ``envd_version`` is a guest without envd (``aenv-node template import-vm``): ``ready(console_log)``
    says when it is up instead of envd (it raises ``TemplateBuildError`` if it never is), and its snapshot
    records no guest agent (``SnapshotConfig.guest_agent``)."""
    if (ready is None) != bool(envd_version):
        raise ValueError("a guest without envd (envd_version '') needs a ready check, and only such a guest")
    started = time.monotonic()
    build_id = build_id or str(uuid.uuid4())  # E2B build ids are UUIDs (the SDKs parse them)
    snapshot_id = new_id("snp_")
    snap_dir = snapshots_dir / snapshot_id
    workdir = work_root / build_id
    shape = MachineShape(
        vcpus=vcpus, mem_mib=mem_mib, kernel=str(source.kernel),
        initrd=str(source.initrd) if source.initrd else "", cmdline=source.cmdline,
        tools_img=str(source.tools_img) if source.tools_img else "", accel=accel,
        free_page_reporting=source.free_page_reporting,
    )

    def begin(s: Session) -> None:
        t = s.get(Template, template_id)
        if t is None:
            s.add(Template(id=template_id, alias=alias, status=BuildStatus.BUILDING, cpu_count=vcpus,
                           memory_mb=mem_mib, disk_size_mb=disk_size_mb, envd_version=envd_version))
        elif t.boot_snapshot_id is None:
            t.status = BuildStatus.BUILDING
        b = s.get(TemplateBuild, build_id)
        if b is None:
            b = TemplateBuild(id=build_id, template_id=template_id)
            s.add(b)
        b.status = BuildStatus.BUILDING
        b.source = source.description or str(source.rootfs)
        b.source_digest = source.source_digest
        b.kit_hash = source.kit_hash
        b.log_path = b.log_path or str(workdir / "console.log")
        record_event(s, "template_build", subject=EventSubject.TEMPLATE, subject_id=template_id,
                     to_state=BuildStatus.BUILDING, detail={"build_id": build_id})

    await db.run(begin)
    layers_dir.mkdir(parents=True, exist_ok=True)
    snap_dir.mkdir(parents=True, exist_ok=True)
    image: Image | None = None
    guest = GuestDefaults(dict(source.env_vars), source.default_user, source.default_workdir)
    step_layers: list[LayerInfo] = []  # sealed by prepare() (a recipe's steps, each cached as a layer)
    boot_s: float | None = None
    capture: CaptureResult | None = None
    try:
        _check_room(snap_dir, need_mib=mem_mib + BUILD_HEADROOM_MIB)
        disk_bytes = disk_size_mb << 20
        base: LayerInfo | None = None
        if source.rootfs is not None:
            rootfs = source.rootfs
            log.info("template %s: importing %s as the base layer", template_id, rootfs.name)
            t_imp = time.monotonic()
            # a root filesystem source is a file cached by content hash (images/), never changed under its
            # name: its import is remembered beside it, for the next node or rebuild
            base = await trio.to_thread.run_sync(
                lambda: import_raw_cached(rootfs, layers_dir, cache_dir=rootfs.parent / "imported", virtual_size=max(
                    disk_bytes, -(-rootfs.stat().st_size // 4096) * 4096)))
            log.info("template %s: base layer %s in %.1fs", template_id, base.digest[:12], time.monotonic() - t_imp)
            stack = [Path(base.path)]
        else:
            stack = list(source.layers)
        size = max(disk_bytes, await trio.to_thread.run_sync(_top_size, stack))
        for attempt in range(1, BOOT_ATTEMPTS + 1):
            image = await trio.to_thread.run_sync(
                lambda: Image.open([str(p) for p in stack], workdir / "upper", size=size))
            slot = await pool.acquire()
            try:
                t_boot = time.monotonic()
                async with open_machine(driver, shape, disk=image, slot=slot, workdir=workdir,
                                        run_dir=run_root / build_id, mem_file=snap_dir / "memory",
                                        name=_vm_name(template_id), frontend=frontend) as m:
                    try:
                        if ready is not None:
                            with trio.fail_after(boot_timeout_s):
                                await ready(workdir / "console.log")
                        else:
                            await wait_envd(slot.address, timeout=boot_timeout_s)
                    except trio.TooSlowError:
                        raise GuestNotReady(f"the guest was not ready {boot_timeout_s:.0f} s after its boot; "
                                                 f"its console ends with: {_console_tail(workdir / 'console.log')}"
                                                 ) from None
                    except EnvdUnavailable as exc:
                        if attempt == BOOT_ATTEMPTS:
                            raise TemplateBuildError(
                                f"{exc} (booted {BOOT_ATTEMPTS} times); the guest console ends with: "
                                f"{_console_tail(workdir / 'console.log')}") from exc
                        log.warning("template %s: boot %d hung (%s); console ends with: %s; booting again",
                                    template_id, attempt, exc, _console_tail(workdir / "console.log"))
                        await m.vm.stop()
                        continue
                    boot_s = time.monotonic() - t_boot
                    crash_point("build.booted", vmm_pid=m.vm.pid)
                    log.info("template %s: %s %.1fs after boot", template_id,
                             "envd ready" if ready is None else "the guest is up", boot_s)
                    if prepare is not None:
                        running = image

                        async def seal_now() -> LayerInfo:
                            info = await trio.to_thread.run_sync(running.seal, layers_dir)
                            step_layers.append(info)
                            return info

                        defaults = await prepare(slot.address, seal_now)
                        if defaults is not None:
                            guest = defaults
                    log.info("template %s: capturing", template_id)
                    t_cap = time.monotonic()
                    capture = await m.vm.capture(snap_dir / "vmstate", snap_dir / "memory",
                                                 kind=CaptureKind.FULL)
                    capture_s = time.monotonic() - t_cap
                    await m.vm.stop()
                    break
            finally:
                await pool.release(slot)
                shutil.rmtree(run_root / build_id, ignore_errors=True)
                if attempt < BOOT_ATTEMPTS and boot_s is None:
                    # the hung boot wrote to its upper: the next boot starts from the base layer alone
                    await trio.to_thread.run_sync(image.close)
                    image = None
                    shutil.rmtree(workdir / "upper", ignore_errors=True)
        assert image is not None and boot_s is not None and capture is not None
        sealed = await trio.to_thread.run_sync(image.seal, layers_dir)
        await trio.to_thread.run_sync(image.close)
        image = None
        crash_point("build.sealed")

        refs = [LayerRef.local(str(p), "sha256:" + p.name.removesuffix(".layer")) for p in stack]
        refs += [LayerRef.local(info.path, layer_digest(info)) for info in (*step_layers, sealed)]

        def commit(s: Session) -> None:
            if base is not None:
                reference_layer(s, base, LayerKind.DISK)
            else:  # converted and step layers: their rows exist (the converter and the step cache wrote them)
                for ref in refs[:-1]:
                    row = s.get(Layer, ref.digest)
                    if row is not None:
                        row.refcount += 1
            reference_layer(s, sealed, LayerKind.DISK)
            s.add(Snapshot(
                id=snapshot_id, kind=SnapshotKind.BOOT, status=SnapshotStatus.COMMITTED, template_id=template_id,
                vmm=capture.vmm, vmstate_location=str(capture.vmstate), vmstate_format=capture.format.value,
                memory_location=str(capture.memory),
                config=SnapshotConfig(shape=shape, envd_version=envd_version,
                                      rootfs=str(source.rootfs) if source.rootfs is not None else None,
                                      kit_hash=source.kit_hash, env_vars=guest.env_vars,
                                      default_user=guest.default_user, default_workdir=guest.default_workdir,
                                      guest_agent=bool(envd_version)),
                memory_mb=mem_mib, committed_at=utcnow(),
            ))
            s.flush()
            record_stack(s, snapshot_id, refs, [])
            t = s.get(Template, template_id)
            assert t is not None  # begin() made it
            old_snapshot = t.boot_snapshot_id
            t.status = BuildStatus.READY
            t.boot_snapshot_id = snapshot_id
            t.cpu_count, t.memory_mb, t.disk_size_mb = vcpus, mem_mib, disk_size_mb
            t.envd_version = envd_version
            b = s.get(TemplateBuild, build_id)
            assert b is not None
            b.status = BuildStatus.READY
            b.snapshot_id = snapshot_id
            b.finished_at = utcnow()
            # from its start (a recipe build's turn: its pull and conversion included)
            b.duration_ms = (b.finished_at - b.started_at).total_seconds() * 1000
            assign_tags(s, template_id, build_id, b.tags or [DEFAULT_TAG])
            record_event(s, "template_build", subject=EventSubject.TEMPLATE, subject_id=template_id,
                         from_state=BuildStatus.BUILDING, to_state=BuildStatus.READY, duration_ms=b.duration_ms,
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
            shutil.rmtree(workdir / "upper", ignore_errors=True)  # the console log stays: build.log_path
            message = str(exc) if isinstance(exc, (TemplateBuildError, ImageError)) else f"{type(exc).__name__}: {exc}"

            def fail(s: Session) -> None:
                b = s.get(TemplateBuild, build_id)
                if b is not None:
                    b.status = BuildStatus.ERROR
                    b.error = message
                    b.finished_at = utcnow()
                t = s.get(Template, template_id)
                if t is not None and t.boot_snapshot_id is None:
                    t.status = BuildStatus.ERROR
                record_event(s, "template_build", subject=EventSubject.TEMPLATE, subject_id=template_id,
                             from_state=BuildStatus.BUILDING, to_state=BuildStatus.ERROR, error=message,
                             detail={"build_id": build_id,
                                     "console_log": str(workdir / "console.log")})

            await db.run(fail)
        raise
