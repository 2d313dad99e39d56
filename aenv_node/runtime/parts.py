"""The parts of a node that its services share, built once from the configuration.

A node's services (``host``, ``storage``, ``slots``, the sandbox registry, the
snapshot operations, the TTL wheel, ...) work on the same VMM driver, shared
repository, layer cache, warm slot pool, capture buffers, snapshot store and
garbage collector. ``NodeParts`` holds them with their lifetimes made plain:
what can be built synchronously is built here (no I/O beyond reading the
configuration); what must be opened (the layer cache, the slot pool) is set by
the one service that owns it for as long as it runs, and is ``None`` before.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from ..config import Config, ConfigError
from ..dataplane import DataPlaneClient
from ..net import NetworkConfig, SlotPool
from ..snapshot.gc import GarbageCollector, LiveStack
from ..snapshot.publish import owner_id
from ..snapshot.store import SnapshotStore
from ..state import Database
from ..storage.cache import LayerCache
from ..storage.cache_peers import PeerOptions
from ..storage.frontends import DiskFrontend, FrontendKind, choose_frontend
from ..storage.repository import Repository, repository_from_config
from ..vmm import Accel, CgroupError, Cgroups, JailerConfig, VmmDriver, VmmLimits, make_driver
from ..vmm.capture_buffer import CaptureBufferPool
from .errors import NodeNotReady
from .sandbox import Adoption

__all__ = ["NodeParts", "node_tag"]

log = logging.getLogger(__name__)


def node_tag(cfg: Config) -> str:
    """A short tag (4 chars) naming this node's network objects, stable across restarts."""
    digest = hashlib.sha256(f"{cfg.state_dir.resolve()}".encode()).digest()
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
    return "".join(alphabet[b % 36] for b in digest[:4])


def _which(binary: str) -> Path:
    found = shutil.which(binary)
    return Path(found) if found else Path(binary)


def _jailer(cfg: Config) -> Optional[JailerConfig]:
    """The jailer's settings (``vmm.jailer*``), or None when Firecracker runs unjailed."""
    if not cfg.vmm.jailer:
        return None
    return JailerConfig(binary=Path(cfg.vmm.jailer_binary), chroot_base=cfg.jailer_chroot_base,
                        uid=cfg.vmm.jailer_uid, gid=cfg.vmm.jailer_gid)


def _filesystem(path: Path) -> int:
    """The device of the filesystem ``path`` is (or would be made) on: its nearest existing ancestor's."""
    for p in (path, *path.parents):
        try:
            return p.stat().st_dev
        except FileNotFoundError:
            continue
    raise ConfigError(f"no part of {path} exists")


def _check_jailer(cfg: Config, driver: VmmDriver, jailer: JailerConfig) -> None:
    """Refuse, at start, a jailer that could not do its work (instead of failing every sandbox later)."""
    if driver.name != "firecracker":
        raise ConfigError(f"vmm.jailer = true runs Firecracker, but vmm.kind = {cfg.vmm.kind} chose {driver.name} "
                          "on this host: set vmm.kind = firecracker (on a KVM host) or vmm.jailer = false")
    if _filesystem(jailer.chroot_base) != _filesystem(cfg.templates_dir):
        raise ConfigError(f"vmm.jailer_chroot_base {jailer.chroot_base} is not on the filesystem of the snapshots "
                          f"({cfg.templates_dir}): a jailed capture is renamed out of its chroot; leave it empty "
                          "(<state_dir>/jailer)")


@dataclass
class NodeParts:
    """See the module docstring. ``live_stacks`` is set by the sandbox registry: the collector asks it what
    the running sandboxes use."""

    cfg: Config
    db: Database
    node_id: str
    netcfg: NetworkConfig
    driver: VmmDriver
    accel: Accel
    #: how sandbox disks reach the VMM (NBD for QEMU; ublk, else FUSE, for Firecracker)
    frontend: DiskFrontend
    #: templates get a free-page-reporting balloon (QEMU only: Firecracker refuses it on copy-on-write
    #: memory); sandboxes restored from them inherit it
    free_page_reporting: bool
    repository: Repository
    capture_buffers: CaptureBufferPool
    store: SnapshotStore
    gc: GarbageCollector
    owner: str
    cache: Optional[LayerCache] = None
    #: P2P layer ranges for the cache (``[p2p]``; set by ``peers.install_peers``), None: off
    peers: Optional[PeerOptions] = None
    pool: Optional[SlotPool] = None
    live_stacks: Callable[[], list[LiveStack]] = field(default=lambda: [])
    #: the data plane (``node.data_plane``): it serves sandbox disks and starts the VMMs; None: this process does
    dataplane: Optional[DataPlaneClient] = None
    #: sandboxes the previous run left running in the data plane, found by the reconciler, taken over by the
    #: sandbox registry when it starts
    adoptions: dict[str, Adoption] = field(default_factory=dict)
    #: of those, the ones a pause was cut in (it may have answered): paused again once taken over
    cut_pauses: list[str] = field(default_factory=list)

    @classmethod
    def build(cls, cfg: Config, db: Database, node_id: str) -> "NodeParts":
        jailer = _jailer(cfg)
        choice = make_driver(cfg.vmm.kind, accel_override=cfg.vmm.accel, qemu_binary=_which(cfg.vmm.qemu_binary),
                             firecracker_binary=Path(cfg.vmm.firecracker_binary), jailer=jailer,
                             tcg_tb_size_mib=cfg.vmm.tcg_tb_size_mb, qemu_mem_merge=cfg.vmm.ksm,
                             tcg_restore_tb_size_mib=cfg.vmm.tcg_tb_size_restore_mb,
                             qemu_cow_discard=cfg.vmm.free_page_reporting)
        log.info("VMM %s with %s (%s)", choice.driver.name, choice.accel.value, choice.info.reason)
        if jailer is not None:
            _check_jailer(cfg, choice.driver, jailer)
            log.info("Firecracker jailed: uid %d, gid %d, chroots in %s", jailer.uid, jailer.gid,
                     jailer.chroot_base)
        # a jailed VMM opens a FUSE-exported disk as the jail's user: the file is exported as its own
        frontend = DiskFrontend(choose_frontend(cfg.storage.block_frontend, vmm_takes_nbd=choice.driver.nbd_client),
                                ublk_queues=cfg.storage.ublk_queues,
                                owner=(jailer.uid, jailer.gid) if jailer is not None else None)
        log.info("sandbox disks through %s (storage.block_frontend = %s)", frontend.kind.value,
                 cfg.storage.block_frontend)
        free_page_reporting = cfg.vmm.free_page_reporting and choice.driver.name == "qemu"
        if free_page_reporting and frontend.kind is not FrontendKind.NBD:
            # QEMU's discard guard (the balloon over copy-on-write RAM) would also swallow guest discards on a
            # writable file drive: vmm/qemu/driver.py refuses the pair, so say it here, once, at start
            raise ConfigError(f"vmm.free_page_reporting needs NBD disks under QEMU; storage.block_frontend = "
                              f"{frontend.kind.value}: set vmm.free_page_reporting = false or use nbd")
        store = SnapshotStore(db, layers_dir=cfg.layers_dir, snapshots_dir=cfg.templates_dir)
        parts: NodeParts
        gc = GarbageCollector(db, layers_dir=cfg.layers_dir, snapshots_dir=cfg.templates_dir,
                              live=lambda: parts.live_stacks(), orphan_grace_s=cfg.snapshot.gc_orphan_grace_s,
                              interval_s=cfg.snapshot.gc_interval_s, patience_s=cfg.snapshot.gc_patience_s)
        tag = node_tag(cfg)
        parts = cls(
            cfg=cfg, db=db, node_id=node_id,
            netcfg=NetworkConfig(node_tag=tag, pool_cidr=cfg.net.pool_cidr, egress=cfg.net.egress,
                                 uplinks=cfg.net.uplinks,
                                 dns_port=(cfg.net.dns_port or None) if cfg.net.egress else None,
                                 proxy_port=(cfg.net.egress_proxy_port or None) if cfg.net.egress else None),
            driver=choice.driver, accel=choice.accel, frontend=frontend,
            free_page_reporting=free_page_reporting,
            repository=repository_from_config(cfg),
            capture_buffers=CaptureBufferPool(cfg.snapshot.capture_buffer_mib << 20, cfg.snapshot.capture_buffers),
            store=store, gc=gc, owner=owner_id(node_id, tag))
        if cfg.node.data_plane:
            parts.dataplane = DataPlaneClient(cfg.run_dir, frontend)
            choice.driver.spawner = parts.dataplane.spawn
        if cfg.vmm.cgroups:
            try:
                limits = VmmLimits(Cgroups.detect(tag), memory_overhead_mib=cfg.vmm.memory_overhead_mib,
                                   pids=cfg.vmm.pids_max)
            except CgroupError as exc:
                log.warning("VMMs run without resource limits: %s", exc)
            else:  # the cgroups a crash left are swept by the reconciler, once it killed their VMMs
                log.info("each VMM in its own cgroup (%s)", ", ".join(map(str, limits.cgroups.roots)))
                choice.driver.limits = limits
        return parts

    def running_pool(self) -> SlotPool:
        if self.pool is None:
            raise NodeNotReady("the sandbox service is not running (no network slot pool)")
        return self.pool
