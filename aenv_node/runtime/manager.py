"""The sandbox manager: a supervisor service owning every sandbox's nursery.

It prepares the host (network isolation tables, orphan clean-up), reconciles
the database with reality at start, keeps the warm slot pool filled, makes
sure the default template exists (building it on first start), runs the TTL
timer, and creates and kills sandboxes for the API. Each sandbox runs as a
task in this service's nursery (``sandbox.run_sandbox``); cancelling the
service (node shutdown) ends every sandbox through its shielded cleanup.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import logging
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable, Optional

import trio
from sqlalchemy import delete, select

from ..config import Config
from ..net import (
    EgressPolicy,
    PoolExhausted,
    NetworkConfig,
    SlotPool,
    ensure_host_networking,
    remove_orphans,
    teardown_host_networking,
)
from ..snapshot.capture import SnapshotSource, capture_running
from ..vmm.capture_buffer import CaptureBufferPool
from ..snapshot.persist import REPO_PREFIX, publish_snapshot
from ..snapshot.machine import MachineShape
from ..snapshot.templates import TemplateSource, build_template
from ..state import Database, NetworkSlot, Sandbox, SandboxState, Snapshot, SnapshotLayer, Template, utcnow
from ..state import repository as repo
from ..state.models import Layer
from ..storage.cache import LayerCache, run_janitor
from ..storage.cache_store import CacheStore
from ..storage.repository import open_repository
from ..vmm import Accel, make_driver
from .errors import RuntimeLayerError
from .gc import GarbageCollector, LiveStack
from .node import Node
from .sandbox import SandboxHandle, SandboxSpec, run_sandbox

__all__ = ["SandboxManager", "SandboxNotRunning", "TemplateNotFound", "CreateRequest"]

log = logging.getLogger(__name__)

#: States in which a sandbox holds a VMM process on this node.
_LIVE_STATES = (SandboxState.CREATING, SandboxState.RUNNING, SandboxState.PAUSING,
                SandboxState.RESUMING, SandboxState.SNAPSHOTTING, SandboxState.FORKING,
                SandboxState.KILLING)


def envd_version() -> str:
    from ..guest import __envd_version__

    return __envd_version__


class TemplateNotFound(RuntimeLayerError):
    http_status = 404


class TemplateNotReady(RuntimeLayerError):
    http_status = 503


class SandboxNotRunning(RuntimeLayerError):
    http_status = 404


class SandboxConflict(RuntimeLayerError):
    """The sandbox is not in a state that allows the operation (e.g. pausing a paused one)."""

    http_status = 409


class PoolInUse(RuntimeLayerError):
    """The configured slot range is already routed on this host."""


class ForkLimit(RuntimeLayerError):
    http_status = 400


def node_tag(cfg: Config) -> str:
    """A short tag (4 chars) naming this node's network objects, stable across restarts."""
    digest = hashlib.sha256(f"{cfg.state_dir.resolve()}".encode()).digest()
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
    return "".join(alphabet[b % 36] for b in digest[:4])


class DbIndexAllocator:
    """Slot indexes persisted in ``network_slots`` so a restarted node knows what it held."""

    def __init__(self, db: Database, netcfg: NetworkConfig) -> None:
        self.db = db
        self.netcfg = netcfg
        # the pool's refiller and acquire() may allocate at once: read-then-insert must not interleave
        self._lock = trio.Lock()

    async def allocate(self) -> int:
        async with self._lock:
            return await self._allocate()

    async def _allocate(self) -> int:
        def work(s) -> int:  # type: ignore[no-untyped-def]
            used = set(s.scalars(select(NetworkSlot.slot_index)))
            for i in range(self.netcfg.capacity):
                if i not in used:
                    sl = self.netcfg.slot(i)
                    s.add(NetworkSlot(slot_index=i, netns=sl.netns, host_ip=sl.host_ip, slot_ip=sl.ns_ip,
                                      state="warm"))
                    return i
            from ..net import PoolExhausted

            raise PoolExhausted(f"all {self.netcfg.capacity} network slots are in use")

        return await self.db.run(work)

    async def free(self, index: int) -> None:
        await self.db.run(lambda s: s.execute(delete(NetworkSlot).where(NetworkSlot.slot_index == index)))


@dataclass
class CreateRequest:
    template: str
    timeout_s: int
    metadata: dict[str, str]
    env_vars: dict[str, str]
    auto_pause: bool = True
    auto_resume: bool = False
    secure: bool = True
    allow_internet_access: bool = True
    allow_out: Optional[list[str]] = None
    deny_out: Optional[list[str]] = None


class SandboxManager:
    name = "sandboxes"

    def __init__(self, node: Node, *, build_default_template: bool = True) -> None:
        self.node = node
        cfg = node.cfg
        self.cfg = cfg
        self.db = node.db
        self.netcfg = NetworkConfig(node_tag=node_tag(cfg), pool_cidr=cfg.net.pool_cidr,
                                    egress=cfg.net.egress)
        self.live: dict[str, SandboxHandle] = {}
        #: Called with a sandbox id after it stopped running (the API's proxy cuts its streams).
        self.stopped_hooks: list[Callable[[str], Awaitable[Any]]] = [self._settle_record]
        self.build_default_template = build_default_template
        self.pool: SlotPool | None = None
        self._nursery: trio.Nursery | None = None
        self._template_events: dict[str, trio.Event] = {}
        self._template_errors: dict[str, str] = {}
        self._resume_locks: dict[str, trio.Lock] = {}
        self._republish: list[tuple[str, str]] = []  # (snapshot, sandbox) reconciled to paused
        self._expiring: set[str] = set()
        choice = make_driver(cfg.vmm.kind, accel_override=cfg.vmm.accel,
                             qemu_binary=_which(cfg.vmm.qemu_binary),
                             firecracker_binary=Path(cfg.vmm.firecracker_binary),
                             tcg_tb_size_mib=cfg.vmm.tcg_tb_size_mb, qemu_mem_merge=cfg.vmm.ksm,
                             tcg_restore_tb_size_mib=cfg.vmm.tcg_tb_size_restore_mb,
                             qemu_cow_discard=cfg.vmm.free_page_reporting)
        self.driver = choice.driver
        self.accel = choice.accel
        #: Templates get a free-page-reporting balloon (QEMU only: Firecracker refuses it on
        #: copy-on-write memory); sandboxes restored from them inherit it.
        self.free_page_reporting = cfg.vmm.free_page_reporting and choice.driver.name == "qemu"
        st = cfg.storage
        if st.repository == "s3":
            self.repo = open_repository("s3", endpoint_url=st.s3_endpoint, bucket=st.s3_bucket,
                                        region=st.s3_region, prefix=st.s3_prefix,
                                        conditional_writes={"auto": None, "true": True,
                                                            "false": False}[st.s3_conditional_writes])
        else:
            self.repo = open_repository("posix_fs", path=str(cfg.repository_path))
        self.cache: LayerCache | None = None
        #: Pre-faulted memory live captures copy dirty pages into (the guest-visible pause is a memcpy).
        self.capture_buffers = CaptureBufferPool(cfg.snapshot.capture_buffer_mib << 20,
                                                 cfg.snapshot.capture_buffers)
        #: Local snapshot/layer files: pins around every restore and capture, a collection after
        #: each end that makes files garbage (runtime/gc.py).
        self.gc = GarbageCollector(self.db, layers_dir=cfg.layers_dir, snapshots_dir=cfg.templates_dir,
                                   live=self._live_stacks,
                                   orphan_grace_s=cfg.snapshot.gc_orphan_grace_s,
                                   interval_s=cfg.snapshot.gc_interval_s,
                                   patience_s=cfg.snapshot.gc_patience_s)
        log.info("VMM %s with %s (%s)", choice.driver.name, choice.accel.value, choice.info.reason)

    # -- service -------------------------------------------------------------------------------
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        if self.cfg.vmm.ksm:
            await trio.to_thread.run_sync(Path("/sys/kernel/mm/ksm/run").write_text, "1")
        await remove_orphans(self.netcfg)
        await self._check_pool_is_free()
        await ensure_host_networking(self.netcfg)
        try:
            await self._reconcile()
            await self.gc.startup()
            st = self.cfg.storage
            cache = await trio.to_thread.run_sync(lambda: LayerCache(
                self.cfg.cache_dir, self.repo, capacity_bytes=st.cache_capacity_bytes,
                high_watermark=st.cache_high_watermark, low_watermark=st.cache_low_watermark,
                store=CacheStore(self.db)))
            self.cache = cache
            async with SlotPool(self.netcfg, DbIndexAllocator(self.db, self.netcfg),
                                size=self.cfg.net.warm_slots) as pool:
                self.pool = pool
                async with trio.open_nursery() as nursery:
                    self._nursery = nursery
                    nursery.start_soon(self._keep_pool_filled, pool)
                    nursery.start_soon(run_janitor, cache)
                    nursery.start_soon(self._ttl_loop)
                    nursery.start_soon(self._warm_capture_buffers)
                    for snapshot_id, sid in self._republish:
                        nursery.start_soon(self._after_pause, snapshot_id, sid)
                    nursery.start_soon(self.gc.run)
                    nursery.start_soon(self._repository_gc_loop)
                    if self.cfg.snapshot.periodic_interval_s > 0:
                        nursery.start_soon(self._periodic_loop)
                    if self.build_default_template:
                        nursery.start_soon(self._ensure_default_template)
                    task_status.started()
                    await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True):
                self._nursery = None
                if self.cache is not None:
                    await trio.to_thread.run_sync(self.cache.close)
                await trio.to_thread.run_sync(self.repo.close)
                self.capture_buffers.close()
                await teardown_host_networking(self.netcfg)

    async def _warm_capture_buffers(self) -> None:
        try:
            await self.capture_buffers.warm()
        except (OSError, MemoryError) as exc:  # captures then take the slower path
            log.warning("could not make the capture buffers (%s): live captures will write files", exc)

    async def _keep_pool_filled(self, pool: SlotPool) -> None:
        """The pool's refiller; an unexpected error is logged and the refiller restarted, never
        allowed to take down the manager (and every sandbox with it)."""
        while True:
            try:
                await pool.run()
                return
            except Exception:
                log.exception("the network slot refiller failed; restarting it")
                await trio.sleep(1)

    async def _check_pool_is_free(self) -> None:
        """Refuse to start when another node (or anything else) routes part of our slot range: the
        host would send this node's guest traffic into the other's namespaces."""
        import ipaddress
        import json as _json

        out = await trio.run_process(["ip", "-j", "-4", "route", "show"], capture_stdout=True)
        pool = self.netcfg.pool
        ours = self.netcfg.host_veth_prefix
        for route in _json.loads(out.stdout or b"[]"):
            dst = route.get("dst", "")
            if dst in ("", "default"):
                continue
            try:
                net = ipaddress.ip_network(dst, strict=False)
            except ValueError:
                continue
            if net.overlaps(pool) and not str(route.get("dev", "")).startswith(ours):
                raise PoolInUse(
                    f"net.pool_cidr {pool} overlaps {dst} (dev {route.get('dev')}), already routed on this "
                    "host (another node?): give this node its own pool_cidr")

    async def _reconcile(self) -> None:
        """Nothing orphaned, nothing reported running that is not (this node's previous run)."""
        def work(s) -> list[tuple[str, Optional[int]]]:  # type: ignore[no-untyped-def]
            rows = s.scalars(select(Sandbox).where(Sandbox.state.in_([x.value for x in _LIVE_STATES])))
            found = []
            for sb in rows:
                found.append((sb.id, sb.vmm_pid))
                current = SandboxState(sb.state)
                if current == SandboxState.RESUMING:
                    # its pause snapshot is intact: it is still paused
                    repo.transition(s, sb.id, SandboxState.PAUSED, operation="reconcile",
                                    vmm_pid=None, slot_index=None)
                    continue
                periodic = s.scalars(select(Snapshot).where(
                    Snapshot.source_sandbox_id == sb.id, Snapshot.kind == "periodic",
                    Snapshot.status == "committed").order_by(Snapshot.created_at.desc())).first()
                if periodic is not None and current in (SandboxState.RUNNING, SandboxState.SNAPSHOTTING,
                                                        SandboxState.FORKING, SandboxState.PAUSING):
                    if current != SandboxState.PAUSING:
                        repo.transition(s, sb.id, SandboxState.PAUSING, operation="reconcile")
                    repo.transition(s, sb.id, SandboxState.PAUSED, operation="reconcile",
                                    snapshot_id=periodic.id, vmm_pid=None, slot_index=None,
                                    detail={"reason": "the node restarted: paused at its latest periodic "
                                                      "snapshot", "snapshot_id": periodic.id})
                    republish.append((periodic.id, sb.id))
                    continue
                if current != SandboxState.KILLING:
                    repo.transition(s, sb.id, SandboxState.KILLING, operation="reconcile")
                repo.transition(s, sb.id, SandboxState.KILLED, operation="reconcile",
                                vmm_pid=None, slot_index=None,
                                detail={"reason": "the node restarted; its VMM did not survive"})
            s.execute(delete(NetworkSlot))
            return found

        republish: list[tuple[str, str]] = []
        found = await self.db.run(work)
        # published as a pause once the manager runs, so its repository record says paused (and other
        # nodes may resume it) instead of running on this node
        self._republish = republish
        import shutil

        for sid, pid in found:
            if pid and _is_our_vmm(pid, sid):
                log.warning("reconcile: killing leftover VMM %d of sandbox %s", pid, sid)
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass
            # its sockets and its writable upper died with it (a pause's state is in its snapshot)
            shutil.rmtree(self.cfg.run_dir / sid, ignore_errors=True)
            shutil.rmtree(self.cfg.sandboxes_dir / sid, ignore_errors=True)
        for sid, _ in found:  # a record naming this node as running would make other nodes refuse it
            await self._settle_record(sid)
        removed = await remove_orphans(self.netcfg)
        if removed or found:
            log.info("reconcile: %d sandboxes marked killed, %d orphan slots removed", len(found), len(removed))

    async def _settle_record(self, sandbox_id: str) -> None:
        """A sandbox ended here without a pause or a kill (VMM died, node restarted): drop its repository
        ownership record if it still says running here (snapshot/persist.py ``settle_record``)."""
        from ..snapshot.persist import owner_id, settle_record

        try:
            await settle_record(self.db, self.repo, sandbox_id, owner_id(self.node.node_id, node_tag(self.cfg)))
        except Exception as exc:  # the repository may be unreachable: other nodes then see a stale owner
            log.warning("settling the ownership record of %s failed: %s", sandbox_id, exc)

    async def _ttl_loop(self) -> None:
        interval = self.cfg.sandbox.ttl_check_interval_s
        while True:
            await trio.sleep(interval)
            now = utcnow()

            def expired(s) -> list[tuple[str, bool]]:  # type: ignore[no-untyped-def]
                return list(s.execute(select(Sandbox.id, Sandbox.auto_pause).where(
                    Sandbox.state == SandboxState.RUNNING.value, Sandbox.end_at <= now)).all())

            for sid, auto_pause in await self.db.run(expired):
                if sid in self.live and sid not in self._expiring:
                    self._expiring.add(sid)
                    log.info("sandbox %s reached its end: %s", sid, "pausing" if auto_pause else "killing")
                    self._nursery.start_soon(self._expire, sid, auto_pause)  # type: ignore[union-attr]

    async def _repository_gc_loop(self) -> None:
        """Collect the shared repository every ``storage.repository_gc_interval_s`` (0: never): snapshot
        manifests no sandbox record reaches and layers no kept manifest names, older than
        ``storage.repository_gc_grace_s`` (storage/repository/gc.py). The collection runs in a thread this
        task owns; a cancellation (shutdown) asks it to stop between two deletions and waits for it."""
        import threading

        st = self.cfg.storage
        if st.repository_gc_interval_s <= 0:
            return
        while True:
            await trio.sleep(st.repository_gc_interval_s)
            stop = threading.Event()

            async def stop_on_cancel() -> None:
                try:
                    await trio.sleep_forever()
                finally:
                    stop.set()

            try:
                async with trio.open_nursery() as n:
                    n.start_soon(stop_on_cancel)
                    report = await trio.to_thread.run_sync(
                        lambda: self.repo.collect_garbage(st.repository_gc_grace_s, stop=stop))
                    n.cancel_scope.cancel()
            except Exception as exc:  # an unreachable repository: try again next interval
                log.warning("repository garbage collection failed: %s", exc)
                continue
            detail = report.summary()
            log.info("repository gc: removed %d manifests and %d layers (%.1f MiB) in %.1f s; kept %d manifests, "
                     "%d layers", len(report.manifests_removed), len(report.layers_removed),
                     report.bytes_removed / 2**20, report.duration_s, report.manifests_kept, report.layers_kept)
            await self.db.run(lambda s: repo.record_event(
                s, "repository_gc", subject="node", subject_id=self.node.node_id,
                duration_ms=report.duration_s * 1000, detail=detail))

    async def _periodic_loop(self) -> None:
        """Snapshot every running sandbox each interval, keeping only its newest periodic snapshot.

        After a node crash the reconciler turns a sandbox that has one into a paused sandbox
        (at that snapshot) instead of a killed one: long trajectories lose at most one interval.
        """
        interval = self.cfg.snapshot.periodic_interval_s
        while True:
            await trio.sleep(interval)
            for sid, handle in list(self.live.items()):
                if handle.op_lock.locked() or handle.done.is_set():
                    continue
                try:
                    async with self.node.tracker.operation("periodic_snapshot"), handle.op_lock, \
                            self.gc.pin():
                        if handle.done.is_set():
                            continue
                        snap = await self._capture_live(handle, kind="periodic", name=None,
                                                        state=SandboxState.SNAPSHOTTING,
                                                        operation="periodic_snapshot")
                    await self.db.run(lambda s: _retire_older_periodic(s, sid, keep=snap))
                    self.gc.request("periodic_retire")
                except Exception as exc:
                    log.warning("periodic snapshot of %s failed: %s", sid, exc)

    async def _compact_snapshot(self, snapshot_id: str) -> bool:
        """Bound a snapshot's layer chains, in the background: a disk chain longer than
        ``snapshot.compact_after_layers`` becomes base + one layer, a memory chain that long becomes one
        layer over the template's RAM image (each pause adds a layer of dirty pages to both, so a sandbox
        paused and resumed forever would otherwise grow without bound). The replaced layers become
        garbage for runtime/gc.py. True if a chain was compacted."""
        limit = self.cfg.snapshot.compact_after_layers

        def chains(s) -> dict[str, list[str]]:  # type: ignore[no-untyped-def]
            sn = s.get(Snapshot, snapshot_id)
            if sn is None or sn.status != "committed":
                return {}  # superseded and collected meanwhile: nothing to compact
            out: dict[str, list[str]] = {}
            for kind in ("disk", "memory"):
                rows = s.scalars(select(SnapshotLayer).where(SnapshotLayer.snapshot_id == snapshot_id,
                                                             SnapshotLayer.kind == kind)
                                 .order_by(SnapshotLayer.position))
                out[kind] = [s.get(Layer, r.layer_digest).location for r in rows]
            return out

        from ..storage.compact import compact_layers
        from ..storage.layer import LayerReader

        compacted = False
        for kind, locations in (await self.db.run(chains)).items():
            keep = 1 if kind == "disk" else 0  # the disk base layer stays (shared by every sandbox)
            if len(locations) <= limit or any(loc.startswith(REPO_PREFIX) for loc in locations[keep:]):
                continue  # short enough, or imported layers that live only in the repository
            t0 = time.monotonic()

            def work(paths: list[str] = locations[keep:]):  # type: ignore[no-untyped-def]
                readers = [LayerReader.open(path) for path in paths]
                try:  # bottom=False: zeroed extents must keep shadowing what lies below
                    return compact_layers(readers, self.cfg.layers_dir, bottom=False,
                                          virtual_size=max(r.virtual_size for r in readers))
                finally:
                    for r in readers:
                        r.close()

            info = await trio.to_thread.run_sync(work)
            digest = f"sha256:{info.digest}"

            def swap(s, kind: str = kind, keep: int = keep, before: int = len(locations),
                     t0: float = t0) -> None:  # type: ignore[no-untyped-def]
                if s.get(Layer, digest) is None:
                    s.add(Layer(digest=digest, kind=kind, size_bytes=info.file_size,
                                virtual_size_bytes=info.virtual_size, location=str(info.path), refcount=1))
                s.execute(delete(SnapshotLayer).where(SnapshotLayer.snapshot_id == snapshot_id,
                                                      SnapshotLayer.kind == kind,
                                                      SnapshotLayer.position >= keep))
                s.flush()
                s.add(SnapshotLayer(snapshot_id=snapshot_id, kind=kind, position=keep, layer_digest=digest))
                if kind == "memory":
                    sn = s.get(Snapshot, snapshot_id)
                    sn.config = {**(sn.config or {}), "memory_layers": [digest]}
                repo.record_event(s, "compact", subject="snapshot", subject_id=snapshot_id,
                                  duration_ms=(time.monotonic() - t0) * 1000,
                                  detail={"kind": kind, "layers_before": before, "layers_after": keep + 1})

            await self.db.run(swap)
            compacted = True
            log.info("compacted snapshot %s: %d %s layers -> %d", snapshot_id, len(locations), kind, keep + 1)
        return compacted

    async def _expire(self, sid: str, auto_pause: bool) -> None:
        try:
            if auto_pause:
                await self.pause(sid, reason="timeout")
            else:
                await self.kill(sid, reason="timeout")
        except Exception as exc:  # the sandbox may have gone meanwhile
            log.info("end of %s: %s", sid, exc)
        finally:
            self._expiring.discard(sid)

    # -- templates -----------------------------------------------------------------------------
    async def _ensure_default_template(self) -> None:
        tid = self.cfg.sandbox.default_template
        try:
            await self.ensure_base_template(tid)
        except Exception as exc:
            log.error("building the default template %r failed: %s", tid, exc)

    async def ensure_base_template(self, template_id: str = "base") -> str:
        """Build the template from the base rootfs and current kit, unless one is ready for this kit."""
        from ..images import ensure_base_rootfs, ensure_kit, kernel_cmdline
        from ..images.kit import host_tsc_khz

        ev = self._template_events.setdefault(template_id, trio.Event())
        try:
            kit = await trio.to_thread.run_sync(ensure_kit, self.cfg.images_cache_dir)
            rootfs = await trio.to_thread.run_sync(ensure_base_rootfs, self.cfg.images_cache_dir)

            def current(s) -> Optional[str]:  # type: ignore[no-untyped-def]
                t = s.get(Template, template_id)
                if t is None or t.status != "ready" or t.boot_snapshot_id is None:
                    return None
                sn = s.get(Snapshot, t.boot_snapshot_id)
                shape = (sn.config or {}).get("shape", {}) if sn else {}
                if shape.get("kernel") != str(kit.vmlinuz) or shape.get("tools_img") != str(kit.tools_img) \
                        or shape.get("accel") != self.accel.value or \
                        shape.get("free_page_reporting", False) != self.free_page_reporting or \
                        (sn.config or {}).get("rootfs") != str(rootfs):
                    return None
                return t.boot_snapshot_id

            if await self.db.run(current) is None:
                assert self.pool is not None
                log.info("building template %r (kit %s)", template_id, kit.hash[:12])
                source = TemplateSource(rootfs=rootfs, kernel=kit.vmlinuz, initrd=kit.initramfs,
                                        tools_img=kit.tools_img,
                                        cmdline=kernel_cmdline(tsc_khz=host_tsc_khz() if self.accel is Accel.TCG else None),
                                        kit_hash=kit.hash, free_page_reporting=self.free_page_reporting)
                result = await build_template(
                    db=self.db, driver=self.driver, accel=self.accel.value, pool=self.pool,
                    source=source, layers_dir=self.cfg.layers_dir,
                    snapshots_dir=self.cfg.templates_dir, work_root=self.cfg.state_dir / "builds",
                    run_root=self.cfg.run_dir, template_id=template_id,
                    alias=template_id, vcpus=self.cfg.sandbox.default_cpu_count,
                    mem_mib=self.cfg.sandbox.default_memory_mb,
                    disk_size_mb=self.cfg.sandbox.default_disk_size_mb, envd_version=envd_version(),
                )
                log.info("template %r ready in %.1fs (boot %.1fs, capture %.0f ms)", template_id,
                         result.duration_s, result.boot_s, result.capture_s * 1000)
                self.gc.request("template_build")  # a rebuild supersedes the previous boot snapshot
            self._template_errors.pop(template_id, None)
            return template_id
        except Exception as exc:
            self._template_errors[template_id] = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            ev.set()

    async def _resolve_template(self, name: str) -> tuple[Template, Snapshot]:
        ev = self._template_events.get(name)
        if ev is not None and not ev.is_set():
            with trio.move_on_after(600):
                await ev.wait()

        def work(s):  # type: ignore[no-untyped-def]
            t = s.get(Template, name) or s.scalars(select(Template).where(Template.alias == name)).first()
            if t is None:
                return None
            sn = s.get(Snapshot, t.boot_snapshot_id) if t.boot_snapshot_id else None
            return t, sn

        found = await self.db.run(work)
        if found is None:
            raise TemplateNotFound(f"template {name!r} not found")
        t, sn = found
        if sn is None or t.status != "ready" or sn.status != "committed":
            err = self._template_errors.get(name)
            raise TemplateNotReady(f"template {name!r} is not ready ({err or t.status}); retry shortly")
        return t, sn

    async def _load_source(self, snapshot_id: str) -> tuple[SnapshotSource, Snapshot]:
        def work(s):  # type: ignore[no-untyped-def]
            sn = s.get(Snapshot, snapshot_id)
            if sn is None or sn.status != "committed":
                return None
            rows = s.scalars(select(SnapshotLayer).where(SnapshotLayer.snapshot_id == sn.id,
                                                         SnapshotLayer.kind == "disk")
                             .order_by(SnapshotLayer.position))
            layers = []
            for r in rows:
                loc = s.get(Layer, r.layer_digest).location
                layers.append(loc if loc.startswith(REPO_PREFIX) else Path(loc))
            return sn, layers

        found = await self.db.run(work)
        if found is None:
            raise TemplateNotFound(f"snapshot {snapshot_id} not found")
        sn, layers = found
        cfg = sn.config or {}
        if cfg.get("memory_from_layers") and not Path(cfg["memory"]).exists():
            await self._materialize_memory(cfg["memory_layers"], Path(cfg["memory"]))
        source = SnapshotSource(
            snapshot_id=sn.id, memory=Path(cfg["memory"]),
            memory_layers=list(cfg.get("memory_layers") or []),
            memory_base=cfg.get("memory_base", cfg["memory"]),
            shape=MachineShape.from_json(cfg["shape"]), template_id=sn.template_id or "",
            disk_layers=layers)
        return source, sn

    async def _materialize_memory(self, digests: list[str], dest: Path) -> None:
        """A memory image from layers in the repository, fetched through the local cache."""
        from ..storage.layer import LayerReader
        from ..storage.materialize import materialize

        assert self.cache is not None
        cache = self.cache
        t0 = time.monotonic()

        def work() -> None:
            readers = [LayerReader(cache.source(d), digest=d.split(":", 1)[1]) for d in digests]
            try:
                materialize(readers, dest)
            finally:
                for r in readers:
                    r.close()

        dest.parent.mkdir(parents=True, exist_ok=True)
        await trio.to_thread.run_sync(work)
        log.info("materialized %s from %d memory layers in %.2fs", dest, len(digests), time.monotonic() - t0)

    def _spec(self, sid: str, source: SnapshotSource, sn: Snapshot, *, env_vars: dict[str, str],
              token: str, previous_token: Optional[str], policy: EgressPolicy, operation: str) -> SandboxSpec:
        return SandboxSpec(
            sandbox_id=sid, source=source, vmstate=Path(sn.vmstate_location),
            snapshot_format=(sn.config or {})["format"], env_vars=env_vars, access_token=token,
            previous_token=previous_token, default_user="user", policy=policy,
            workdir=self.cfg.sandboxes_dir / sid, run_dir=self.cfg.run_dir / sid, operation=operation)

    def _live_stacks(self) -> list[LiveStack]:
        """What the sandboxes live on this node use (for the garbage collector)."""
        stacks = []
        for h in list(self.live.values()):
            layers: list[object] = list(h.source.disk_layers)
            for reader in getattr(h.image, "layers", ()) or ():  # the image's own view, if it has one
                name = getattr(reader, "name", None)
                if isinstance(name, str):
                    layers.append(name)
            stacks.append(LiveStack(h.source.snapshot_id, tuple(layers), tuple(h.source.memory_layers)))
        return stacks

    def _running(self) -> trio.Nursery:
        if self._nursery is None or self.pool is None:
            raise TemplateNotReady("the sandbox manager is not running")
        return self._nursery

    # -- sandboxes -----------------------------------------------------------------------------
    async def create(self, req: CreateRequest) -> Sandbox:
        async with self.node.tracker.operation("create"), self.gc.pin():
            t, sn = await self._resolve_template(req.template)
            source, sn = await self._load_source(sn.id)
            nursery = self._running()
            sid = "i" + secrets.token_hex(10)
            token = secrets.token_urlsafe(24)
            now = utcnow()
            policy = EgressPolicy.from_e2b(req.allow_out, req.deny_out,
                                           allow_internet_access=req.allow_internet_access)
            # a snapshot used as a template carries the env vars of the sandbox it came from
            env_vars = {**((sn.config or {}).get("env_vars") or {}), **req.env_vars}
            row = Sandbox(
                id=sid, template_id=t.id, alias=t.alias, node_id=self.node.node_id,
                client_id=self.node.node_id, cpu_count=t.cpu_count, memory_mb=t.memory_mb,
                disk_size_mb=t.disk_size_mb, envd_version=t.envd_version or envd_version(),
                envd_access_token=token, traffic_access_token=None,
                metadata_=req.metadata, env_vars=env_vars, auto_pause=req.auto_pause,
                auto_resume=req.auto_resume, secure=req.secure,
                allow_internet_access=req.allow_internet_access,
                network_policy={k: v for k, v in (("allowOut", req.allow_out), ("denyOut", req.deny_out)) if v},
                snapshot_id=sn.id, vmm=self.driver.name, started_at=now,
                end_at=now + dt.timedelta(seconds=req.timeout_s),
            )
            await self.db.run(lambda s: repo.insert_sandbox(s, row))
            spec = self._spec(sid, source, sn, env_vars=env_vars, token=token,
                              previous_token=(sn.config or {}).get("access_token"), policy=policy,
                              operation="create")
            await nursery.start(self._run, spec)
            return await self.db.run(lambda s: repo.get_sandbox(s, sid))

    async def _run(self, spec: SandboxSpec, *, task_status: trio.TaskStatus[SandboxHandle]) -> None:
        assert self.pool is not None
        try:
            await run_sandbox(spec, db=self.db, driver=self.driver, pool=self.pool, live=self.live,
                              cache=self.cache, task_status=task_status)
        finally:
            with trio.CancelScope(shield=True):
                for hook in self.stopped_hooks:
                    try:
                        await hook(spec.sandbox_id)
                    except Exception:
                        log.exception("stopped hook for %s failed", spec.sandbox_id)

    async def kill(self, sandbox_id: str, *, reason: str = "kill") -> bool:
        """Kill a sandbox; False if it does not exist (or is already killed)."""
        killed = await self._kill(sandbox_id, reason=reason)
        if killed:
            # another node sharing the repository must not resume it any more
            await trio.to_thread.run_sync(self._forget_published, sandbox_id)
            self.gc.request("kill")
        return killed

    def _forget_published(self, sandbox_id: str) -> None:
        """Delete the sandbox's record in the repository if this node owns it (blocking)."""
        from ..snapshot.persist import forget_published, owner_id

        try:
            forget_published(self.repo, sandbox_id, owner_id(self.node.node_id, node_tag(self.cfg)))
        except Exception as exc:
            log.warning("removing the published pointer of %s failed: %s", sandbox_id, exc)

    async def _kill(self, sandbox_id: str, *, reason: str) -> bool:
        handle = self.live.get(sandbox_id)
        if handle is None:
            def work(s) -> bool:  # type: ignore[no-untyped-def]
                sb = s.get(Sandbox, sandbox_id)
                if sb is None or sb.state == SandboxState.KILLED.value:
                    return False
                # no process on this node (paused, or error): just record the kill
                if sb.state != SandboxState.KILLING.value:
                    repo.transition(s, sandbox_id, SandboxState.KILLING, operation=reason)
                repo.transition(s, sandbox_id, SandboxState.KILLED, operation=reason)
                return True

            return await self.db.run(work)
        async with self.node.tracker.operation("kill"), handle.op_lock:
            if handle.done.is_set():
                return True
            await self.db.run(lambda s: repo.transition(
                s, sandbox_id, SandboxState.KILLING, operation=reason,
                expect=[SandboxState.RUNNING, SandboxState.ERROR]))
            handle.request_stop(reason)
            await handle.done.wait()
        return True

    async def _state(self, sandbox_id: str) -> SandboxState:
        sb = await self.db.run(lambda s: repo.get_sandbox(s, sandbox_id))
        return SandboxState(sb.state)

    async def pause(self, sandbox_id: str, *, reason: str = "pause") -> None:
        """Capture the sandbox incrementally, stop its VMM and free its slot (E2B: 409 if paused)."""
        handle = self.live.get(sandbox_id)
        if handle is None:
            state = await self._state(sandbox_id)
            raise SandboxConflict(f"sandbox {sandbox_id} is already {state.value}"
                                  if state == SandboxState.PAUSED else
                                  f"sandbox {sandbox_id} is {state.value}: only a running sandbox can pause")
        async with self.node.tracker.operation("pause"), handle.op_lock, self.gc.pin():
            if handle.done.is_set():
                raise SandboxConflict(f"sandbox {sandbox_id} stopped meanwhile")
            await self.db.run(lambda s: repo.transition(s, sandbox_id, SandboxState.PAUSING,
                                                        operation=reason, expect=[SandboxState.RUNNING]))
            private = await self.db.run(lambda s: _memory_is_private(s, sandbox_id, handle.source.snapshot_id))
            try:
                out = await capture_running(
                    db=self.db, vm=handle.vm, image=handle.image, sandbox_id=sandbox_id,
                    source=handle.source, kind="pause", keep_running=False,
                    layers_dir=self.cfg.layers_dir, snapshots_dir=self.cfg.templates_dir,
                    access_token=handle.access_token, env_vars=handle.env_vars,
                    buffers=self.capture_buffers, take_source_memory=private)
            except BaseException as exc:
                with trio.CancelScope(shield=True):
                    await self._after_failed_capture(handle, "pause", exc)
                raise
            handle.paused_snapshot_id = out.snapshot_id
            handle.request_stop(reason)
            await handle.done.wait()
        self.gc.request("pause")  # the snapshot it ran from is superseded
        if self._nursery is not None:
            self._nursery.start_soon(self._after_pause, out.snapshot_id, sandbox_id)

    async def _after_pause(self, snapshot_id: str, sandbox_id: str) -> None:
        """Publish the pause snapshot, then bound its chains (compaction past
        ``snapshot.compact_after_layers``; a no-op otherwise). In this order: a compaction replaces layers
        and the collection after it removes them, which must not happen under an upload of them."""
        await self._publish_quietly(snapshot_id, sandbox_id)
        await self._compact_quietly(snapshot_id)

    async def _publish_quietly(self, snapshot_id: str, sandbox_id: str) -> None:
        """Commit a pause snapshot to the repository (in the background: the pause has returned).

        The record goes ``paused`` (owned by this node) under the sandbox's resume lock, and only if the
        sandbox is still paused at this snapshot: a resume or a kill meanwhile wins (snapshot/persist.py)."""
        from ..snapshot.persist import owner_id

        try:
            summary = await publish_snapshot(
                self.db, self.repo, self.cfg.layers_dir, snapshot_id, sandbox_id,
                owner=owner_id(self.node.node_id, node_tag(self.cfg)),
                pointer_lock=self._resume_locks.setdefault(sandbox_id, trio.Lock()))
            log.info("published snapshot %s of %s: %s", snapshot_id, sandbox_id, summary)
        except Exception as exc:
            log.warning("publishing snapshot %s failed: %s", snapshot_id, exc)

    async def _compact_quietly(self, snapshot_id: str) -> None:
        try:
            async with self.gc.pin():  # it reads the chain's files and adds a layer
                compacted = await self._compact_snapshot(snapshot_id)
            if compacted:
                self.gc.request("compact")  # the layers it replaced are garbage now
        except Exception as exc:
            log.warning("compacting snapshot %s failed: %s", snapshot_id, exc)

    async def _after_failed_capture(self, handle: SandboxHandle, operation: str, exc: BaseException) -> None:
        """Truthful state after a failed capture: running again if the VM runs, else error."""
        sid = handle.sandbox_id
        try:
            await handle.vm.resume()
            ok = True
        except Exception:
            ok = False
        message = f"{type(exc).__name__}: {exc}"
        if ok:
            await self.db.run(lambda s: repo.transition(s, sid, SandboxState.RUNNING, operation=operation,
                                                        error=message))
        else:
            await self.db.run(lambda s: repo.transition(s, sid, SandboxState.ERROR, operation=operation,
                                                        error=message))
            handle.request_stop("error")

    async def resume(self, sandbox_id: str, *, timeout_s: Optional[int] = None) -> tuple[Sandbox, bool]:
        """Running: (row, False). Paused: claim it in the repository, restore it from its pause
        snapshot, (row, True).

        The claim (snapshot/persist.py ``claim_for_resume``) makes this node the sandbox's only runner
        before anything starts: a sandbox running on another node is a 409 naming that node; one paused
        on another node (unknown here, or newer there than this node's copy) is imported first."""
        from ..snapshot.persist import claim_for_resume, owner_id, release_claim
        from ..storage.repository.errors import OwnershipConflict

        async with self.node.tracker.operation("resume"):
            lock = self._resume_locks.setdefault(sandbox_id, trio.Lock())
            async with lock, self.gc.pin():
                known = await self.db.run(lambda s: s.get(Sandbox, sandbox_id) is not None)
                if known:
                    sb = await self.db.run(lambda s: repo.get_sandbox(s, sandbox_id))
                    if sb.state == SandboxState.RUNNING.value and sandbox_id in self.live:
                        if timeout_s is not None:
                            await self._set_end(sandbox_id, timeout_s)
                        return await self.db.run(lambda s: repo.get_sandbox(s, sandbox_id)), False
                    if sb.state != SandboxState.PAUSED.value or sb.snapshot_id is None:
                        raise SandboxConflict(f"sandbox {sandbox_id} is {sb.state}: it cannot be resumed")
                # paused here or on another node sharing the repository: this node claims it first
                owner = owner_id(self.node.node_id, node_tag(self.cfg))
                try:
                    claim = await claim_for_resume(self.db, self.repo, self.cfg.templates_dir, sandbox_id,
                                                   self.node.node_id, owner)
                except OwnershipConflict as exc:
                    raise SandboxConflict(str(exc)) from None
                if claim is not None and claim.imported and known:
                    self.gc.request("import")  # the stale local snapshot may be garbage now
                try:
                    sb = await self.db.run(lambda s: repo.get_sandbox(s, sandbox_id))
                    if sb.state != SandboxState.PAUSED.value or sb.snapshot_id is None:
                        raise SandboxConflict(f"sandbox {sandbox_id} is {sb.state}: it cannot be resumed")
                    source, sn = await self._load_source(sb.snapshot_id)
                    nursery = self._running()
                    end = utcnow() + dt.timedelta(seconds=timeout_s if timeout_s is not None
                                                  else self.cfg.sandbox.default_timeout_s)
                    await self.db.run(lambda s: repo.transition(
                        s, sandbox_id, SandboxState.RESUMING, operation="resume",
                        expect=[SandboxState.PAUSED], end_at=end))
                    policy = EgressPolicy.from_e2b((sb.network_policy or {}).get("allowOut"),
                                                   (sb.network_policy or {}).get("denyOut"),
                                                   allow_internet_access=sb.allow_internet_access)
                    spec = self._spec(sandbox_id, source, sn, env_vars=dict(sb.env_vars or {}),
                                      token=sb.envd_access_token or secrets.token_urlsafe(24),
                                      previous_token=sb.envd_access_token, policy=policy,
                                      operation="resume")
                    await nursery.start(self._run, spec)
                except BaseException:
                    if claim is not None:  # not running here after all: hand the claim back
                        with trio.CancelScope(shield=True):
                            await trio.to_thread.run_sync(release_claim, self.repo, claim, owner)
                    raise
                return await self.db.run(lambda s: repo.get_sandbox(s, sandbox_id)), True

    async def _set_end(self, sandbox_id: str, timeout_s: int) -> None:
        end = utcnow() + dt.timedelta(seconds=timeout_s)
        await self.db.run(lambda s: repo.update_sandbox(s, sandbox_id, operation="set_timeout",
                                                        detail={"timeout_s": timeout_s}, end_at=end))

    async def snapshot(self, sandbox_id: str, *, name: Optional[str] = None) -> str:
        """Snapshot a running sandbox (brief pause); the snapshot is also a template."""
        handle = self._live_or_conflict(sandbox_id, "snapshot")
        async with self.node.tracker.operation("snapshot"), handle.op_lock, self.gc.pin():
            return await self._capture_live(handle, kind="user", name=name,
                                            state=SandboxState.SNAPSHOTTING, operation="snapshot")

    def _live_or_conflict(self, sandbox_id: str, op: str) -> SandboxHandle:
        handle = self.live.get(sandbox_id)
        if handle is None:
            raise SandboxConflict(f"sandbox {sandbox_id} is not running: cannot {op} it")
        return handle

    async def _capture_live(self, handle: SandboxHandle, *, kind: str, name: Optional[str],
                            state: SandboxState, operation: str) -> str:
        sid = handle.sandbox_id
        await self.db.run(lambda s: repo.transition(s, sid, state, operation=operation,
                                                    expect=[SandboxState.RUNNING]))
        try:
            out = await capture_running(
                db=self.db, vm=handle.vm, image=handle.image, sandbox_id=sid, source=handle.source,
                kind=kind, keep_running=True, layers_dir=self.cfg.layers_dir,
                snapshots_dir=self.cfg.templates_dir, access_token=handle.access_token,
                env_vars=handle.env_vars, name=name, buffers=self.capture_buffers)
        except BaseException as exc:
            with trio.CancelScope(shield=True):
                await self._after_failed_capture(handle, operation, exc)
            raise
        handle.source.disk_layers = list(out.disk_layers)
        sb_row = await self.db.run(lambda s: repo.get_sandbox(s, sid))

        def done(s) -> None:  # type: ignore[no-untyped-def]
            repo.transition(s, sid, SandboxState.RUNNING, operation=operation,
                            duration_ms=out.total_ms,
                            detail={"snapshot_id": out.snapshot_id, "paused_ms": round(out.paused_ms, 1),
                                    "dirty_bytes": out.dirty_bytes})
            if kind == "user":
                s.add(Template(id=out.snapshot_id, alias=None, kind="snapshot", status="ready",
                               cpu_count=sb_row.cpu_count, memory_mb=sb_row.memory_mb,
                               disk_size_mb=sb_row.disk_size_mb, envd_version=sb_row.envd_version,
                               boot_snapshot_id=out.snapshot_id))

        await self.db.run(done)
        return out.snapshot_id

    async def fork(self, sandbox_id: str, *, count: int, timeout_s: Optional[int]) -> list[dict[str, Any]]:
        """One capture of the parent, then ``count`` restores in parallel; per-child results."""
        if not 1 <= count <= self.cfg.sandbox.fork_max_count:
            raise ForkLimit(f"count must be between 1 and {self.cfg.sandbox.fork_max_count}")
        handle = self._live_or_conflict(sandbox_id, "fork")
        async with self.node.tracker.operation("fork"), contextlib.AsyncExitStack() as pinned:
            async with handle.op_lock:
                # pinned until the children's rows name the fork snapshot; op_lock first, as pause does
                await pinned.enter_async_context(self.gc.pin())
                snap_id = await self._capture_live(handle, kind="fork", name=None,
                                                   state=SandboxState.FORKING, operation="fork")
            parent = await self.db.run(lambda s: repo.get_sandbox(s, sandbox_id))
            source, sn = await self._load_source(snap_id)
            nursery = self._running()
            results: list[dict[str, Any]] = [{} for _ in range(count)]
            timeout = timeout_s if timeout_s is not None else self.cfg.sandbox.default_timeout_s

            async def child(i: int) -> None:
                sid = "i" + secrets.token_hex(10)
                token = secrets.token_urlsafe(24)
                now = utcnow()
                row = Sandbox(
                    id=sid, template_id=parent.template_id, alias=parent.alias, node_id=self.node.node_id,
                    client_id=self.node.node_id, cpu_count=parent.cpu_count, memory_mb=parent.memory_mb,
                    disk_size_mb=parent.disk_size_mb, envd_version=parent.envd_version,
                    envd_access_token=token, metadata_=dict(parent.metadata_ or {}),
                    env_vars=dict(parent.env_vars or {}), auto_pause=parent.auto_pause,
                    auto_resume=parent.auto_resume, secure=parent.secure,
                    allow_internet_access=parent.allow_internet_access,
                    network_policy=dict(parent.network_policy or {}), snapshot_id=snap_id,
                    parent_sandbox_id=sandbox_id, vmm=self.driver.name, started_at=now,
                    end_at=now + dt.timedelta(seconds=timeout))
                await self.db.run(lambda s: repo.insert_sandbox(s, row, operation="fork"))
                policy = EgressPolicy.from_e2b((parent.network_policy or {}).get("allowOut"),
                                               (parent.network_policy or {}).get("denyOut"),
                                               allow_internet_access=parent.allow_internet_access)
                spec = self._spec(sid, source, sn, env_vars=dict(parent.env_vars or {}), token=token,
                                  previous_token=parent.envd_access_token, policy=policy, operation="fork")
                try:
                    await nursery.start(self._run, spec)
                    results[i] = {"sandbox": await self.db.run(lambda s: repo.get_sandbox(s, sid))}
                except Exception as exc:
                    log.warning("fork child %d of %s failed: %s", i, sandbox_id, exc)
                    code = 503 if isinstance(exc, PoolExhausted) else getattr(exc, "http_status", 500)
                    results[i] = {"error": {"code": code, "message": f"{type(exc).__name__}: {exc}"}}

            async with trio.open_nursery() as children:
                for i in range(count):
                    children.start_soon(child, i)
            return results

    async def update_network(self, sandbox_id: str, *, allow_out: Optional[list[str]],
                             deny_out: Optional[list[str]]) -> None:
        """E2B PUT /sandboxes/{id}/network: replace the egress policy (live slots at once)."""
        sb = await self.db.run(lambda s: repo.get_sandbox(s, sandbox_id))
        policy = EgressPolicy.from_e2b(allow_out, deny_out, allow_internet_access=sb.allow_internet_access)
        handle = self.live.get(sandbox_id)
        if handle is not None:
            await handle.slot.apply_egress(policy)
        stored = {k: v for k, v in (("allowOut", allow_out), ("denyOut", deny_out)) if v}
        await self.db.run(lambda s: repo.update_sandbox(s, sandbox_id, operation="update_network",
                                                        detail=stored, network_policy=stored))

    async def delete_snapshot(self, snapshot_id: str) -> bool:
        """Delete a user snapshot (a template built from a running sandbox)."""
        def work(s) -> bool:  # type: ignore[no-untyped-def]
            t = s.get(Template, snapshot_id)
            sn = s.get(Snapshot, snapshot_id)
            if t is None or t.kind != "snapshot" or sn is None or sn.status != "committed":
                return False
            s.delete(t)
            sn.status = "deleted"
            repo.record_event(s, "snapshot_delete", subject="snapshot", subject_id=snapshot_id,
                              from_state="committed", to_state="deleted")
            return True

        deleted = await self.db.run(work)
        if deleted:
            self.gc.request("snapshot_delete")  # its files go once no sandbox runs from it
        return deleted

    async def resolve(self, sandbox_id: str, port: int) -> SandboxHandle:
        """The live sandbox for proxied traffic; a paused one with autoResume is resumed first."""
        handle = self.live.get(sandbox_id)
        if handle is not None:
            return handle

        def auto(s) -> bool:  # type: ignore[no-untyped-def]
            sb = s.get(Sandbox, sandbox_id)
            return sb is not None and sb.auto_resume and sb.state in (
                SandboxState.PAUSED.value, SandboxState.RESUMING.value, SandboxState.PAUSING.value)

        if await self.db.run(auto):
            try:
                await self.resume(sandbox_id)
            except Exception as exc:
                raise SandboxNotRunning(f"The sandbox {sandbox_id} was not found ({exc})") from None
            handle = self.live.get(sandbox_id)
            if handle is not None:
                return handle
        raise SandboxNotRunning(f"The sandbox {sandbox_id} was not found")


def _memory_is_private(s, sandbox_id: str, snapshot_id: str) -> bool:  # type: ignore[no-untyped-def]
    """Is the flat memory image of ``snapshot_id`` (the one the running sandbox was restored from) this
    sandbox's alone, so that its pause may take the file over instead of copying it? True for the
    sandbox's own previous pause snapshot when nothing else can restore from it: pause snapshots are
    not templates, and only their sandbox resumes them (checked: no other live sandbox points at it)."""
    sn = s.get(Snapshot, snapshot_id)
    if sn is None or sn.kind != "pause" or sn.source_sandbox_id != sandbox_id:
        return False
    if s.scalar(select(Template.id).where(Template.boot_snapshot_id == snapshot_id).limit(1)) is not None:
        return False
    others = s.scalar(select(Sandbox.id).where(Sandbox.snapshot_id == snapshot_id, Sandbox.id != sandbox_id,
                                               Sandbox.state != SandboxState.KILLED.value).limit(1))
    memory = (sn.config or {}).get("memory", "")
    return others is None and Path(memory).parent.name == snapshot_id


def _retire_older_periodic(s, sandbox_id: str, keep: str) -> None:  # type: ignore[no-untyped-def]
    for sn in s.scalars(select(Snapshot).where(Snapshot.source_sandbox_id == sandbox_id,
                                               Snapshot.kind == "periodic", Snapshot.status == "committed",
                                               Snapshot.id != keep)):
        in_use = s.scalars(select(Sandbox.id).where(Sandbox.snapshot_id == sn.id,
                                                    Sandbox.state != SandboxState.KILLED.value)).first()
        if in_use is None:
            sn.status = "deleted"
            repo.record_event(s, "snapshot_delete", subject="snapshot", subject_id=sn.id,
                              from_state="committed", to_state="deleted", detail={"reason": "superseded"})


def _which(binary: str) -> Path:
    import shutil

    found = shutil.which(binary)
    return Path(found) if found else Path(binary)


def _is_our_vmm(pid: int, sandbox_id: str) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return sandbox_id.encode() in cmdline
