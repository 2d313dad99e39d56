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

**Single writer.** Only one node runs a given sandbox at a time, enforced
through the ``sandbox-<id>`` manifest, which is also the sandbox's ownership
record (storage/repository/base.py): owner (``<node id>/<state-dir tag>``:
node ids default to the hostname, and two nodes on one host differ by their
state directory), state (``paused``: any node may claim it; ``running``: its
owner runs it) and a generation, all changed by compare-and-swap:

* resume (``claim_for_resume``) claims the record (``paused`` -> ``running``,
  owner = this node) before restoring; a sandbox running on another node is
  refused (``OwnershipConflict``, a 409 "sandbox X is running on node Y"). If
  the record names a snapshot published by another node, this node's copy is
  stale: that newer snapshot is imported (the local row moves to it) and the
  sandbox resumes from it, so a sandbox paused on B resumes on A with B's
  changes. If the record is gone although this node's snapshot had been
  published, the sandbox was killed elsewhere: refused (``OwnershipLost``,
  404), the local row left as it is for the operator. A failed restore hands
  the claim back;
* publish (``publish_snapshot``) writes the record ``paused`` at the new
  snapshot only if it is absent or owned by this node, and only while the
  local row is still paused at that snapshot (under the caller's per-sandbox
  lock, which resume holds too). A kill racing it is caught by reading the
  row again after the write: if it was killed meanwhile the record is removed
  (the kill removes it too if it came after the write), so no pointer
  survives a kill;
* kill (``forget_published``) deletes the record only if this node owns it;
  ``settle_record`` does the same after a sandbox ended here without a
  kill (VMM died, node shut down), so no record says it still runs here.

The pointer and the ownership are one document rather than a separate
``owner-<id>`` manifest because they change together (a publish moves the
newest snapshot and hands the sandbox back in one step): one object is one
compare-and-swap, and a reader never sees them disagree. Old pointers without
an owner read as paused and unowned, so a node upgraded in place claims them.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncContextManager, Optional

import trio
from sqlalchemy import select

from ..state import (
    Database,
    Layer,
    Sandbox,
    SandboxState,
    Snapshot,
    SnapshotLayer,
    utcnow,
)
from ..state.repository import insert_sandbox, record_event, update_sandbox
from ..storage.importer import import_raw
from ..storage.repository.base import (
    CAS_RETRIES,
    Ownership,
    Repository,
    sandbox_record_id,
)
from ..storage.repository.errors import (
    OwnershipChanged,
    OwnershipConflict,
    OwnershipLost,
)

__all__ = ["REPO_PREFIX", "publish_snapshot", "import_sandbox", "sandbox_manifest_id", "owner_id",
           "Claim", "claim_for_resume", "release_claim", "forget_published", "settle_record"]

log = logging.getLogger(__name__)

#: Layer.location prefix for layers that live only in the repository (read through the cache).
REPO_PREFIX = "repo:"


def sandbox_manifest_id(sandbox_id: str) -> str:
    return sandbox_record_id(sandbox_id)


def owner_id(node_id: str, instance: str) -> str:
    """A node's name in ownership records: its node id and a tag of its state directory (node ids default
    to the hostname, so two nodes on one host would otherwise look like one)."""
    return f"{node_id}/{instance}"


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
                           sandbox_id: str, *, owner: str,
                           pointer_lock: Optional[AsyncContextManager[Any]] = None) -> dict[str, Any]:
    """Commit one snapshot, then point the sandbox's record at it (``paused``, owned by ``owner``); returns
    the commit summary (``pointer``: written | superseded | killed | moved).

    ``pointer_lock`` is held around the record update: the caller's per-sandbox lock that resume holds too,
    so "the row is still paused at this snapshot" stays true until the record says so."""
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

    result = await trio.to_thread.run_sync(
        lambda: repo.commit_snapshot(sn.id, manifest, layer_paths, require=require))
    async with (pointer_lock or contextlib.nullcontext()):
        pointer, generation = await _publish_pointer(db, repo, sandbox_id, sn.id, owner)
    summary: dict[str, Any] = {"uploaded": len(result.uploaded), "already_present": len(result.already_present),
                               "ms": round((time.monotonic() - t0) * 1000, 1), "pointer": pointer,
                               "generation": generation}
    await db.run(lambda s: record_event(s, "snapshot_publish", sandbox_id=sandbox_id, subject="snapshot",
                                        subject_id=sn.id, duration_ms=summary["ms"], detail=summary))
    return summary


async def _publish_pointer(db: Database, repo: Repository, sandbox_id: str, snapshot_id: str,
                           owner: str) -> tuple[str, Optional[int]]:
    """Record ``paused`` at ``snapshot_id`` if the local row is still paused there; undo it if a kill came."""
    def local(s) -> tuple[Optional[str], Optional[str]]:  # type: ignore[no-untyped-def]
        sb = s.get(Sandbox, sandbox_id)
        return (sb.state, sb.snapshot_id) if sb is not None else (None, None)

    gone = (None, SandboxState.KILLING.value, SandboxState.KILLED.value)
    state, current = await db.run(local)
    if state in gone:
        return "killed", None
    if state != SandboxState.PAUSED.value or current != snapshot_id:
        return "superseded", None  # resumed (and maybe paused again) meanwhile: that pause publishes
    try:
        rec = await trio.to_thread.run_sync(lambda: repo.release_sandbox(sandbox_id, owner, snapshot_id))
    except OwnershipConflict as exc:
        log.warning("not publishing sandbox %s as paused at %s: %s (this node's copy is stale)",
                    sandbox_id, snapshot_id, exc)
        return "moved", None
    state, _ = await db.run(local)
    if state in gone:
        # a kill ran between the check above and the write (its delete came first): undo the write
        await trio.to_thread.run_sync(forget_published, repo, sandbox_id, owner)
        return "killed", None

    def mark(s) -> None:  # type: ignore[no-untyped-def]
        sn = s.get(Snapshot, snapshot_id)
        if sn is not None:
            sn.config = {**(sn.config or {}), "published": True}

    await db.run(mark)
    return "written", rec.generation


def forget_published(repo: Repository, sandbox_id: str, owner: str) -> bool:
    """Delete the sandbox's record if this node owns it (blocking: run it in a thread); True if deleted."""
    try:
        return repo.drop_ownership(sandbox_id, owner)
    except OwnershipConflict as exc:
        log.info("leaving the record of sandbox %s in the repository: %s", sandbox_id, exc)
        return False


async def _fetch_snapshot(repo: Repository, snapshot_id: str) -> dict[str, Any]:
    return await trio.to_thread.run_sync(repo.get_manifest, snapshot_id)


async def _record_import(db: Database, snapshots_dir: Path, sandbox_id: str, node_id: str,
                         manifest: dict[str, Any], *, replace: bool) -> None:
    """Record a published snapshot (its layers as ``repo:`` locations) and point the sandbox at it: a new
    row (``replace=False``; nothing if one exists) or, for a newer snapshot of a sandbox known here, the
    existing paused row, with the settings the other node had."""
    snap_id = manifest["snapshot_id"]
    snap_dir = snapshots_dir / snap_id
    snap_dir.mkdir(parents=True, exist_ok=True)
    vmstate = snap_dir / "vmstate"
    await trio.to_thread.run_sync(vmstate.write_bytes, base64.b64decode(manifest["vmstate_b64"]))
    info = manifest["sandbox"]

    def record(s) -> None:  # type: ignore[no-untyped-def]
        existing = s.get(Sandbox, sandbox_id)
        if existing is not None and not replace:
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
                        "access_token": manifest["access_token"], "env_vars": manifest["env_vars"],
                        "published": True},
                memory_mb=manifest["memory_mb"], committed_at=utcnow()))
            s.flush()
            for pos, l in enumerate(manifest["disk_layers"]):
                s.add(SnapshotLayer(snapshot_id=snap_id, kind="disk", position=pos, layer_digest=l["digest"]))
            for pos, d in enumerate(manifest["memory_layers"]):
                s.add(SnapshotLayer(snapshot_id=snap_id, kind="memory", position=pos, layer_digest=d))
        if existing is not None:
            update_sandbox(
                s, sandbox_id, operation="import",
                detail={"snapshot_id": snap_id, "replaces": existing.snapshot_id,
                        "reason": "a newer snapshot was published by another node"},
                snapshot_id=snap_id, vmm=manifest["vmm"], metadata_=info["metadata"], env_vars=info["env_vars"],
                envd_access_token=info["envd_access_token"], auto_pause=info["auto_pause"],
                auto_resume=info["auto_resume"], network_policy=info["network_policy"])
            return
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
    log.info("imported sandbox %s (snapshot %s) from the repository%s", sandbox_id, snap_id,
             " (newer than this node's copy)" if replace else "")


async def import_sandbox(db: Database, repo: Repository, snapshots_dir: Path, sandbox_id: str,
                         node_id: str) -> bool:
    """Make a sandbox paused on another node known here (False if the repository has none).

    It only reads; resume goes through ``claim_for_resume``, which imports and claims."""
    rec = await trio.to_thread.run_sync(repo.get_ownership, sandbox_id)
    if rec is None or not rec.snapshot_id:
        return False
    await _record_import(db, snapshots_dir, sandbox_id, node_id, await _fetch_snapshot(repo, rec.snapshot_id),
                         replace=False)
    return True


@dataclass(frozen=True)
class Claim:
    """What ``claim_for_resume`` did: the record as claimed, as it was before, and a snapshot it imported."""

    record: Ownership
    previous: Optional[Ownership]
    imported: Optional[str] = None


async def claim_for_resume(db: Database, repo: Repository, snapshots_dir: Path, sandbox_id: str,
                           node_id: str, owner: str) -> Optional[Claim]:
    """Claim a paused sandbox for this node before restoring it; None if neither this node nor the
    repository knows it.

    The caller has checked that a local row, if any, is paused.  Raises ``OwnershipConflict`` if another
    node runs it, ``OwnershipLost`` if it was killed elsewhere; imports the snapshot first when the record
    names one another node published (a sandbox unknown here, or a local copy that is stale).  Every claim
    swaps against exactly the record that was read and judged, so a concurrent claim elsewhere either lands
    first (seen on the next round) or fails.
    """
    def local(s) -> Optional[tuple[str, Optional[str], bool]]:  # type: ignore[no-untyped-def]
        sb = s.get(Sandbox, sandbox_id)
        if sb is None:
            return None
        sn = s.get(Snapshot, sb.snapshot_id) if sb.snapshot_id else None
        return sb.state, sb.snapshot_id, bool(sn is not None and (sn.config or {}).get("published"))

    for _ in range(CAS_RETRIES):
        rec = await trio.to_thread.run_sync(repo.get_ownership, sandbox_id)
        if rec is not None and rec.held_by_other(owner):
            raise OwnershipConflict(sandbox_id, rec.owner, rec.state, "resume")
        mine = await db.run(local)
        imported = None
        if mine is None:
            if rec is None or not rec.snapshot_id:
                return None
            await _record_import(db, snapshots_dir, sandbox_id, node_id,
                                 await _fetch_snapshot(repo, rec.snapshot_id), replace=False)
            imported = rec.snapshot_id
        elif rec is None:
            if mine[2]:
                raise OwnershipLost(sandbox_id)
        elif rec.snapshot_id and rec.snapshot_id != mine[1] and rec.owner not in ("", owner):
            # paused on another node after it ran there: this node's copy is older
            await _record_import(db, snapshots_dir, sandbox_id, node_id,
                                 await _fetch_snapshot(repo, rec.snapshot_id), replace=True)
            imported = rec.snapshot_id
        try:
            claimed = await trio.to_thread.run_sync(lambda: repo.claim_sandbox(sandbox_id, owner, expect=rec))
        except OwnershipChanged:
            continue  # someone wrote it since it was read: judge it again
        await db.run(lambda s: record_event(
            s, "ownership_claim", sandbox_id=sandbox_id, subject="sandbox", subject_id=sandbox_id,
            detail={"owner": owner, "generation": claimed.generation, "snapshot_id": claimed.snapshot_id,
                    "previous_owner": rec.owner if rec is not None else None, "imported": imported}))
        return Claim(claimed, rec, imported)
    raise OwnershipChanged(sandbox_id, f"lost {CAS_RETRIES} claims in a row to other writers")


def release_claim(repo: Repository, claim: Claim, owner: str) -> None:
    """Hand back a claim whose restore failed (blocking): the record as it was before (absent, or paused at
    the snapshot it named), unless it moved on meanwhile."""
    try:
        if claim.previous is None:
            repo.drop_ownership(claim.record.sandbox_id, owner, expect=claim.record)
        else:
            repo.release_sandbox(claim.record.sandbox_id, owner, claim.record.snapshot_id, expect=claim.record)
    except (OwnershipChanged, OwnershipConflict) as exc:
        log.warning("handing back the claim on sandbox %s failed: %s", claim.record.sandbox_id, exc)


async def settle_record(db: Database, repo: Repository, sandbox_id: str, owner: str) -> bool:
    """After a sandbox stopped running here without a pause or a kill (its VMM died, the node shut down, the
    guest powered off): a record still saying ``running`` here would make every other node refuse it, so
    it is deleted if the sandbox ended killed or in error.  True if a record was deleted.

    For the manager's ``stopped_hooks`` and its start-up reconcile (which may find records of sandboxes it
    marked killed); a paused sandbox's record is the publish's business and is left alone."""
    def state(s) -> Optional[str]:  # type: ignore[no-untyped-def]
        sb = s.get(Sandbox, sandbox_id)
        return sb.state if sb is not None else None

    if await db.run(state) not in (SandboxState.KILLED.value, SandboxState.ERROR.value):
        return False
    return await trio.to_thread.run_sync(forget_published, repo, sandbox_id, owner)
