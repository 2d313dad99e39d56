"""A node state directory holding a fleet of paused sandboxes, written the way the node writes it.

Why not hand-written SQL: the figures of ``bench/fleet_state.py`` are only worth something if the rows are
exactly the node's, so every row goes through the node's own models and repository functions
(``state/repository.py``: ``insert_sandbox``, ``transition``, ``record_event``; ``snapshot/layers.py``:
``reference_layer``, ``record_stack``; ``templates/names.py``: ``assign_tags``), in the order a real life writes
them: create (creating -> running), then ``pauses`` times pause (running -> pausing, the capture's snapshot and
its two layers committed with their ``snapshot_commit`` event, pausing -> paused at it, published with its
``snapshot_publish`` event), with a resume (paused -> resuming -> running) between two pauses. Each pause
snapshot stacks the template's disk layers plus every sealed layer so far, and the memory chain so far plus its
own layer, as a capture does. Then the node's own garbage collector (``snapshot/gc.py``) runs once, in process,
as the node would after those pauses: it marks every superseded pause snapshot ``collected``, recomputes the
refcounts, writes its ``gc`` event and removes their directories (its time is reported: a collection with
work to do).

The files the collector and the start-up sweep look at exist (every layer file, each snapshot's directory with
its ``vmstate`` and ``memory``), empty: no figure measured here reads their contents, and nothing that does (a
restore) runs. The ``base`` template is one ready build whose boot snapshot stacks three disk layers.
Sandboxes go in one transaction per ``chunk`` sandboxes (what the node does one sandbox at a time).
"""

from __future__ import annotations

import datetime as dt
import random
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio
from sqlalchemy.orm import Session

from aenv_node.snapshot.gc import Collection, GarbageCollector
from aenv_node.snapshot.layers import layer_digest, record_stack, reference_layer, stack_of
from aenv_node.state import (
    BuildStatus,
    Database,
    EventSubject,
    LayerKind,
    MachineShape,
    Sandbox,
    SandboxState,
    Snapshot,
    SnapshotConfig,
    SnapshotKind,
    SnapshotStatus,
    Template,
    TemplateBuild,
    TemplateKind,
    new_id,
    utcnow,
)
from aenv_node.state import repository as repo
from aenv_node.storage import LayerInfo, LayerRef
from aenv_node.templates.names import DEFAULT_TAG, assign_tags

S = SandboxState
TEMPLATE = "base"
SHAPE = MachineShape(vcpus=2, mem_mib=512, kernel="/var/lib/aenv/kit/vmlinuz", initrd="/var/lib/aenv/kit/initrd",
                     cmdline="console=ttyS0 quiet", tools_img="/var/lib/aenv/kit/tools.img", accel="tcg",
                     free_page_reporting=True)


@dataclass
class FleetState:
    state_dir: Path
    sandboxes: list[str]
    killed: list[str]
    rows_s: float  # writing the rows
    files_s: float  # creating the files
    first_gc: Collection
    first_gc_s: float
    counts: dict[str, int]


def _layer(layers_dir: Path, files: list[Path], size: int) -> LayerInfo:
    digest = secrets.token_hex(32)
    path = layers_dir / f"{digest}.layer"
    files.append(path)
    return LayerInfo(digest=digest, path=str(path), file_size=size, virtual_size=2048 << 20, extent_count=64,
                     data_bytes=size, compressed=False)


def _template(s: Session, layers_dir: Path, snapshots_dir: Path, files: list[Path]) -> tuple[str, list[LayerRef]]:
    """The ``base`` template: one ready build, its boot snapshot stacking three disk layers."""
    snap = new_id("snp_")
    build = new_id("bld_")
    infos = [_layer(layers_dir, files, 300 << 20) for _ in range(3)]
    for info in infos:
        reference_layer(s, info, LayerKind.DISK)
    s.add(Template(id=TEMPLATE, alias=TEMPLATE, kind=TemplateKind.TEMPLATE, status=BuildStatus.READY,
                   envd_version="0.2.0"))
    s.add(Snapshot(id=snap, kind=SnapshotKind.BOOT, status=SnapshotStatus.COMMITTED, template_id=TEMPLATE,
                   vmm="qemu", vmstate_location=str(snapshots_dir / snap / "vmstate"), vmstate_format="qemu-migration",
                   memory_location=str(snapshots_dir / snap / "memory"),
                   config=SnapshotConfig(shape=SHAPE, envd_version="0.2.0", kit_hash="0" * 64),
                   memory_mb=512, committed_at=utcnow()))
    s.flush()
    refs = [LayerRef.local(i.path, layer_digest(i)) for i in infos]
    record_stack(s, snap, refs, [])
    t = s.get(Template, TEMPLATE)
    assert t is not None
    t.boot_snapshot_id = snap
    now = utcnow()
    s.add(TemplateBuild(id=build, template_id=TEMPLATE, status=BuildStatus.READY, source="base rootfs",
                        kit_hash="0" * 64, started_at=now, finished_at=now, duration_ms=30000.0, snapshot_id=snap,
                        tags=[DEFAULT_TAG]))
    s.flush()
    assign_tags(s, TEMPLATE, build, [DEFAULT_TAG])
    repo.record_event(s, "template_build", subject=EventSubject.TEMPLATE, subject_id=TEMPLATE,
                      from_state=BuildStatus.BUILDING, to_state=BuildStatus.READY, duration_ms=30000.0,
                      detail={"build_id": build, "snapshot_id": snap})
    return snap, refs


def _life(s: Session, i: int, *, boot: str, template_refs: list[LayerRef], started: dt.datetime, pauses: int,
          layers_dir: Path, snapshots_dir: Path, files: list[Path], dirs: list[Path]) -> str:
    """One sandbox's life up to its last pause (the module docstring)."""
    sid = "i" + secrets.token_hex(10)
    row = Sandbox(id=sid, template_id=TEMPLATE, alias=TEMPLATE, node_id="bench", client_id="bench",
                  cpu_count=2, memory_mb=512, disk_size_mb=2048, envd_version="0.2.0",
                  envd_access_token=secrets.token_urlsafe(24), traffic_access_token=None,
                  metadata_={"user": f"agent-{i % 97}", "episode": str(i)}, env_vars={"EPISODE": str(i)},
                  auto_pause=True, auto_resume=False, allow_internet_access=True, network_policy={},
                  snapshot_id=boot, vmm="qemu", started_at=started, end_at=started + dt.timedelta(seconds=300))
    repo.insert_sandbox(s, row)
    repo.transition(s, sid, S.RUNNING, operation="create", vmm_pid=None, slot_index=None)
    disk, memory, parent = list(template_refs), [], boot
    for p in range(pauses):
        if p:
            repo.transition(s, sid, S.RESUMING, operation="resume", expect=[S.PAUSED])
            repo.transition(s, sid, S.RUNNING, operation="resume", snapshot_id=parent)
        repo.transition(s, sid, S.PAUSING, operation="pause", expect=[S.RUNNING])
        snap = new_id("snp_")
        d = snapshots_dir / snap
        dirs.append(d)
        sealed = _layer(layers_dir, files, 24 << 20)
        mem = _layer(layers_dir, files, 40 << 20)
        reference_layer(s, sealed, LayerKind.DISK)
        reference_layer(s, mem, LayerKind.MEMORY)
        s.add(Snapshot(id=snap, kind=SnapshotKind.PAUSE, status=SnapshotStatus.COMMITTED, parent_id=parent,
                       source_sandbox_id=sid, template_id=TEMPLATE, vmm="qemu",
                       vmstate_location=str(d / "vmstate"), vmstate_format="qemu-migration",
                       memory_location=str(d / "memory"), memory_base_location=str(snapshots_dir / boot / "memory"),
                       dirty_bytes=40 << 20, config=SnapshotConfig(shape=SHAPE, access_token=row.envd_access_token,
                                                                   env_vars=row.env_vars),
                       memory_mb=512, committed_at=utcnow(), published=True))
        s.flush()
        disk.append(LayerRef.local(sealed.path, layer_digest(sealed)))
        memory.append(layer_digest(mem))
        record_stack(s, snap, disk, memory)
        repo.record_event(s, "snapshot_commit", sandbox_id=sid, subject=EventSubject.SNAPSHOT, subject_id=snap,
                          to_state=SnapshotStatus.COMMITTED, duration_ms=450.0,
                          detail={"kind": "pause", "dirty_bytes": 40 << 20, "paused_ms": 20.0, "parent_id": parent})
        repo.transition(s, sid, S.PAUSED, operation="pause", snapshot_id=snap, vmm_pid=None, slot_index=None)
        repo.record_event(s, "snapshot_publish", sandbox_id=sid, subject=EventSubject.SNAPSHOT, subject_id=snap,
                          duration_ms=120.0, detail={"pointer": "written", "ms": 120.0})
        parent = snap
    return sid


def _killed(s: Session, i: int, started: dt.datetime) -> str:
    """A sandbox that ran and was killed (the history a node keeps: rows stay, lineage is history)."""
    sid = "i" + secrets.token_hex(10)
    repo.insert_sandbox(s, Sandbox(id=sid, template_id=TEMPLATE, alias=TEMPLATE, node_id="bench", client_id="bench",
                                   metadata_={"user": f"agent-{i % 97}"}, started_at=started,
                                   end_at=started + dt.timedelta(seconds=300), vmm="qemu"))
    repo.transition(s, sid, S.RUNNING, operation="create")
    repo.transition(s, sid, S.KILLING, operation="kill")
    repo.transition(s, sid, S.KILLED, operation="kill", vmm_pid=None, slot_index=None)
    return sid


def make_fleet_state(state_dir: Path, *, sandboxes: int, pauses: int = 3, killed: int = 0, chunk: int = 50,
                     seed: int = 1) -> FleetState:
    """Write the state (the module docstring) into ``state_dir`` (fresh: migrated to head here)."""
    rnd = random.Random(seed)
    layers_dir, snapshots_dir = state_dir / "layers", state_dir / "snapshots"
    layers_dir.mkdir(parents=True, exist_ok=True)
    snapshots_dir.mkdir(parents=True, exist_ok=True)
    db = Database(state_dir / "aenv.db")
    db.upgrade()
    files: list[Path] = []
    dirs: list[Path] = []
    t0 = time.monotonic()
    with db.session() as s:
        boot, refs = _template(s, layers_dir, snapshots_dir, files)
    dirs.append(snapshots_dir / boot)
    # starts spread over the past, one every ~0.5 s, some in the same millisecond (the token's tie-break)
    start = utcnow() - dt.timedelta(seconds=0.5 * (sandboxes + killed) + 3600)
    order = ["live"] * sandboxes + ["killed"] * killed
    rnd.shuffle(order)
    live_ids: list[str] = []
    killed_ids: list[str] = []
    at = start
    for base in range(0, len(order), chunk):
        with db.session() as s:
            for i in range(base, min(base + chunk, len(order))):
                at += dt.timedelta(milliseconds=rnd.choice((0, 1, 250, 500, 750)))
                if order[i] == "live":
                    live_ids.append(_life(s, i, boot=boot, template_refs=refs, started=at, pauses=pauses,
                                          layers_dir=layers_dir, snapshots_dir=snapshots_dir, files=files,
                                          dirs=dirs))
                else:
                    killed_ids.append(_killed(s, i, at))
    rows_s = time.monotonic() - t0
    t1 = time.monotonic()
    for d in dirs:
        d.mkdir(exist_ok=True)
        files.extend((d / "vmstate", d / "memory"))
    for f in files:
        f.touch()
    files_s = time.monotonic() - t1
    gc, gc_s = collect_once(db, state_dir, reason="bench-setup")
    counts = count_rows(db)
    db.close()
    return FleetState(state_dir, live_ids, killed_ids, rows_s, files_s, gc, gc_s, counts)


def pause_again(db: Database, state_dir: Path, sandbox_id: str) -> str:
    """One more resume and pause of a paused sandbox (its rows and files, as ``_life`` writes them): its
    previous pause snapshot is now garbage, as after every pause of a resumed sandbox. Returns the new one."""
    files: list[Path] = []
    dirs: list[Path] = []
    layers_dir, snapshots_dir = state_dir / "layers", state_dir / "snapshots"
    with db.session() as s:
        sb = repo.get_sandbox(s, sandbox_id)
        parent = sb.snapshot_id
        assert parent is not None
        prev = s.get(Snapshot, parent)
        assert prev is not None
        disk = [LayerRef.local(row.local_path, row.digest) for row in stack_of(s, parent, LayerKind.DISK)]
        memory = [row.digest for row in stack_of(s, parent, LayerKind.MEMORY)]
        repo.transition(s, sandbox_id, S.RESUMING, operation="resume", expect=[S.PAUSED])
        repo.transition(s, sandbox_id, S.RUNNING, operation="resume")
        repo.transition(s, sandbox_id, S.PAUSING, operation="pause", expect=[S.RUNNING])
        snap = new_id("snp_")
        d = snapshots_dir / snap
        dirs.append(d)
        sealed, mem = _layer(layers_dir, files, 24 << 20), _layer(layers_dir, files, 40 << 20)
        reference_layer(s, sealed, LayerKind.DISK)
        reference_layer(s, mem, LayerKind.MEMORY)
        s.add(Snapshot(id=snap, kind=SnapshotKind.PAUSE, status=SnapshotStatus.COMMITTED, parent_id=parent,
                       source_sandbox_id=sandbox_id, template_id=TEMPLATE, vmm="qemu",
                       vmstate_location=str(d / "vmstate"), vmstate_format="qemu-migration",
                       memory_location=str(d / "memory"), memory_base_location=prev.memory_base_location,
                       dirty_bytes=40 << 20, config=prev.config, memory_mb=512, committed_at=utcnow(),
                       published=True))
        s.flush()
        record_stack(s, snap, [*disk, LayerRef.local(sealed.path, layer_digest(sealed))],
                     [*memory, layer_digest(mem)])
        repo.record_event(s, "snapshot_commit", sandbox_id=sandbox_id, subject=EventSubject.SNAPSHOT,
                          subject_id=snap, to_state=SnapshotStatus.COMMITTED, duration_ms=450.0,
                          detail={"kind": "pause", "parent_id": parent})
        repo.transition(s, sandbox_id, S.PAUSED, operation="pause", snapshot_id=snap, vmm_pid=None,
                        slot_index=None)
    for d in dirs:
        d.mkdir()
        files.extend((d / "vmstate", d / "memory"))
    for f in files:
        f.touch()
    return snap


def collector(db: Database, state_dir: Path) -> GarbageCollector:
    """The node's collector over ``state_dir`` with no sandbox live (none runs: all are paused)."""
    return GarbageCollector(db, layers_dir=state_dir / "layers", snapshots_dir=state_dir / "snapshots",
                            live=lambda: [], orphan_grace_s=3600.0, patience_s=0.0)


def collect_once(db: Database, state_dir: Path, *, reason: str) -> tuple[Collection, float]:
    """One collection, as the node's ``local-gc`` service runs it; (what it removed, seconds)."""
    gc = collector(db, state_dir)

    async def main() -> tuple[Collection, float]:
        t = time.monotonic()
        out = await gc.collect(reason)
        return out, time.monotonic() - t

    return trio.run(main)


def sweep_once(db: Database, state_dir: Path) -> tuple[Collection, float]:
    """The start-up sweep (files no row names), as the node runs it before its first collection."""
    gc = collector(db, state_dir)

    async def main() -> tuple[Collection, float]:
        t = time.monotonic()
        out = await gc.sweep_orphans()
        return out, time.monotonic() - t

    return trio.run(main)


def count_rows(db: Database) -> dict[str, int]:
    from sqlalchemy import text

    out: dict[str, Any] = {}
    with db.session() as s:
        for table in ("sandboxes", "snapshots", "snapshot_layers", "layers", "events"):
            out[table] = s.execute(text(f"SELECT count(*) FROM {table}")).scalar_one()
        out["snapshots_committed"] = s.execute(text(
            "SELECT count(*) FROM snapshots WHERE status = 'committed'")).scalar_one()
    return out
