"""Snapshots in the shared repository: publish after a pause, import on another node.

A node keeps what it needs locally (layer files, each snapshot's flat memory
image). For a sandbox to outlive its node, every pause is also **published**
to the configured repository (posix_fs, possibly on a shared filesystem, or
s3): its disk layers, its memory chain as layers (the template's RAM image at
the bottom, imported as a layer once, then one layer of dirty pages per
capture), and a manifest holding the device state and everything a restore
needs, written last (``Repository.commit_snapshot``), then a small
``sandbox-<id>`` manifest naming the sandbox's newest snapshot. A reader never
sees a manifest whose layers are missing.

A node asked to resume a sandbox it does not know looks for that manifest,
**imports** the sandbox and its snapshot into its own database (layers
recorded with ``repo:`` locations), and restores it with a cold local cache:
disk layers are read on demand in 256 KiB ranges through the LRU cache, and
the memory chain is materialized into a local file through the same cache.
Only one node should run a given sandbox at a time; the node that resumes it
does not tell the other (single-writer is the operator's responsibility).
"""

from __future__ import annotations

import base64
import logging
import time
from pathlib import Path
from typing import Any, Optional

import trio
from sqlalchemy import select

from ..state import Database, Layer, Sandbox, SandboxState, Snapshot, SnapshotLayer, utcnow
from ..state.repository import insert_sandbox, record_event
from ..storage.importer import import_raw
from ..storage.repository.base import Repository

__all__ = ["REPO_PREFIX", "publish_snapshot", "import_sandbox", "sandbox_manifest_id"]

log = logging.getLogger(__name__)

#: Layer.location prefix for layers that live only in the repository (read through the cache).
REPO_PREFIX = "repo:"


def sandbox_manifest_id(sandbox_id: str) -> str:
    return f"sandbox-{sandbox_id}"


def _chain(s, snapshot_id: str, kind: str) -> list[Layer]:  # type: ignore[no-untyped-def]
    rows = s.scalars(select(SnapshotLayer).where(SnapshotLayer.snapshot_id == snapshot_id,
                                                 SnapshotLayer.kind == kind)
                     .order_by(SnapshotLayer.position))
    return [s.get(Layer, r.layer_digest) for r in rows]


async def _memory_base_layer(db: Database, layers_dir: Path, memory_base: str) -> tuple[str, str]:
    """The template RAM image at the bottom of a memory chain, as a layer (imported once)."""
    def find(s) -> Optional[tuple[str, str]]:  # type: ignore[no-untyped-def]
        for sn in s.scalars(select(Snapshot).where(Snapshot.kind == "boot")):
            cfg = sn.config or {}
            if cfg.get("memory") == memory_base and cfg.get("memory_base_layer"):
                layer = s.get(Layer, cfg["memory_base_layer"])
                if layer is not None:
                    return layer.digest, layer.location
        return None

    found = await db.run(find)
    if found is not None:
        return found
    info = await trio.to_thread.run_sync(lambda: import_raw(memory_base, layers_dir))
    digest = f"sha256:{info.digest}"

    def record(s) -> None:  # type: ignore[no-untyped-def]
        if s.get(Layer, digest) is None:
            s.add(Layer(digest=digest, kind="memory", size_bytes=info.file_size,
                        virtual_size_bytes=info.virtual_size, location=str(info.path), refcount=1))
        for sn in s.scalars(select(Snapshot).where(Snapshot.kind == "boot")):
            cfg = dict(sn.config or {})
            if cfg.get("memory") == memory_base:
                cfg["memory_base_layer"] = digest
                sn.config = cfg

    await db.run(record)
    return digest, str(info.path)


async def publish_snapshot(db: Database, repo: Repository, layers_dir: Path, snapshot_id: str,
                           sandbox_id: str) -> dict[str, Any]:
    """Commit one snapshot (and the sandbox pointer) to the repository; returns the commit summary."""
    t0 = time.monotonic()

    def gather(s):  # type: ignore[no-untyped-def]
        sn = s.get(Snapshot, snapshot_id)
        sb = s.get(Sandbox, sandbox_id)
        return sn, sb, _chain(s, snapshot_id, "disk"), _chain(s, snapshot_id, "memory")

    sn, sb, disk, memory = await db.run(gather)
    cfg = dict(sn.config or {})
    layer_paths = {l.digest: l.location for l in disk + memory if not l.location.startswith(REPO_PREFIX)}
    memory_chain = [l.digest for l in memory]
    if cfg.get("memory_base"):
        # a chain over a template's RAM file: that file goes up as the chain's bottom layer
        base_digest, base_path = await _memory_base_layer(db, layers_dir, cfg["memory_base"])
        memory_chain.insert(0, base_digest)
        if not base_path.startswith(REPO_PREFIX):
            layer_paths[base_digest] = base_path
    require = [l.digest for l in disk + memory if l.location.startswith(REPO_PREFIX)]
    vmstate = await trio.to_thread.run_sync(Path(sn.vmstate_location).read_bytes)
    manifest = {
        "version": 1,
        "snapshot_id": sn.id,
        "kind": sn.kind,
        "parent_id": sn.parent_id,
        "source_sandbox_id": sn.source_sandbox_id,
        "template_id": sn.template_id,
        "vmm": sn.vmm,
        "shape": cfg["shape"],
        "format": cfg["format"],
        "vmstate_b64": base64.b64encode(vmstate).decode(),
        "disk_layers": [{"digest": l.digest, "size": l.size_bytes, "virtual_size": l.virtual_size_bytes}
                        for l in disk],
        "memory_layers": memory_chain,
        "memory_mb": sn.memory_mb,
        "access_token": cfg.get("access_token"),
        "env_vars": cfg.get("env_vars") or {},
        "sandbox": {
            "id": sb.id, "template_id": sb.template_id, "alias": sb.alias, "cpu_count": sb.cpu_count,
            "memory_mb": sb.memory_mb, "disk_size_mb": sb.disk_size_mb, "envd_version": sb.envd_version,
            "envd_access_token": sb.envd_access_token, "metadata": sb.metadata_ or {},
            "env_vars": sb.env_vars or {}, "auto_pause": sb.auto_pause, "auto_resume": sb.auto_resume,
            "secure": sb.secure, "allow_internet_access": sb.allow_internet_access,
            "network_policy": sb.network_policy or {},
        },
    }

    def commit() -> Any:
        result = repo.commit_snapshot(sn.id, manifest, layer_paths, require=require)
        repo.put_manifest(sandbox_manifest_id(sandbox_id),
                          {"sandbox_id": sandbox_id, "snapshot_id": sn.id, "published_at": time.time()})
        return result

    result = await trio.to_thread.run_sync(commit)
    summary = {"uploaded": len(result.uploaded), "already_present": len(result.already_present),
               "ms": round((time.monotonic() - t0) * 1000, 1)}
    await db.run(lambda s: record_event(s, "snapshot_publish", sandbox_id=sandbox_id, subject="snapshot",
                                        subject_id=sn.id, duration_ms=summary["ms"], detail=summary))
    return summary


async def import_sandbox(db: Database, repo: Repository, snapshots_dir: Path, sandbox_id: str,
                         node_id: str) -> bool:
    """Make a sandbox paused on another node known here (False if the repository has none)."""
    def fetch() -> Optional[dict[str, Any]]:
        mid = sandbox_manifest_id(sandbox_id)
        if not repo.has_manifest(mid):
            return None
        pointer = repo.get_manifest(mid)
        return repo.get_manifest(pointer["snapshot_id"])

    manifest = await trio.to_thread.run_sync(fetch)
    if manifest is None:
        return False
    snap_id = manifest["snapshot_id"]
    snap_dir = snapshots_dir / snap_id
    snap_dir.mkdir(parents=True, exist_ok=True)
    vmstate = snap_dir / "vmstate"
    await trio.to_thread.run_sync(vmstate.write_bytes, base64.b64decode(manifest["vmstate_b64"]))
    info = manifest["sandbox"]

    def record(s) -> None:  # type: ignore[no-untyped-def]
        if s.get(Sandbox, sandbox_id) is not None:
            return
        for l in manifest["disk_layers"]:
            if s.get(Layer, l["digest"]) is None:
                s.add(Layer(digest=l["digest"], kind="disk", size_bytes=l["size"],
                            virtual_size_bytes=l["virtual_size"], location=REPO_PREFIX + l["digest"],
                            refcount=1))
        for d in manifest["memory_layers"]:
            if s.get(Layer, d) is None:
                s.add(Layer(digest=d, kind="memory", size_bytes=0, location=REPO_PREFIX + d, refcount=1))
        if s.get(Snapshot, snap_id) is None:
            s.add(Snapshot(
                id=snap_id, kind=manifest["kind"], status="committed", parent_id=None,
                source_sandbox_id=manifest["source_sandbox_id"], template_id=manifest["template_id"],
                vmm=manifest["vmm"], vmstate_location=str(vmstate),
                config={"shape": manifest["shape"], "format": manifest["format"],
                        "memory": str(snap_dir / "memory"), "memory_base": "",
                        "memory_layers": manifest["memory_layers"],
                        "memory_from_layers": True, "imported_parent_id": manifest["parent_id"],
                        "access_token": manifest["access_token"], "env_vars": manifest["env_vars"]},
                memory_mb=manifest["memory_mb"], committed_at=utcnow()))
            s.flush()
            for pos, l in enumerate(manifest["disk_layers"]):
                s.add(SnapshotLayer(snapshot_id=snap_id, kind="disk", position=pos, layer_digest=l["digest"]))
            for pos, d in enumerate(manifest["memory_layers"]):
                s.add(SnapshotLayer(snapshot_id=snap_id, kind="memory", position=pos, layer_digest=d))
        row = Sandbox(
            id=sandbox_id, template_id=info["template_id"], alias=info["alias"], node_id=node_id,
            client_id=node_id, cpu_count=info["cpu_count"], memory_mb=info["memory_mb"],
            disk_size_mb=info["disk_size_mb"], envd_version=info["envd_version"],
            envd_access_token=info["envd_access_token"], metadata_=info["metadata"],
            env_vars=info["env_vars"], auto_pause=info["auto_pause"], auto_resume=info["auto_resume"],
            secure=info["secure"], allow_internet_access=info["allow_internet_access"],
            network_policy=info["network_policy"], snapshot_id=snap_id, vmm=manifest["vmm"],
            state=SandboxState.PAUSED.value, paused_at=utcnow(), end_at=utcnow())
        insert_sandbox(s, row, operation="import")

    await db.run(record)
    log.info("imported sandbox %s (snapshot %s) from the repository", sandbox_id, snap_id)
    return True
