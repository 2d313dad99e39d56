"""The snapshot store and compaction on a real database and real layer files (no guest needed: these read
rows and layers, which are fast to make)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Awaitable

import pytest
import trio
from sqlalchemy import select

from aenv_node.snapshot.compaction import compact_snapshot
from aenv_node.snapshot.errors import SnapshotNotFound
from aenv_node.snapshot.layers import layer_digest, record_stack, reference_layer
from aenv_node.snapshot.source import SnapshotSource, load_source
from aenv_node.snapshot.store import SnapshotStore
from aenv_node.state import (
    Database,
    Event,
    Layer,
    LayerKind,
    MachineShape,
    Sandbox,
    SandboxState,
    Snapshot,
    SnapshotConfig,
    SnapshotKind,
    SnapshotLayer,
    SnapshotStatus,
    Template,
    TemplateKind,
)
from aenv_node.state.repository import insert_sandbox
from aenv_node.storage import Image, LayerInfo, LayerRef, LayerWriter
from aenv_node.vmm import SnapshotFormat

SIZE = 1 << 20
SHAPE = MachineShape(vcpus=1, mem_mib=64, kernel="/k", initrd="/i", cmdline="c", tools_img="/t", accel="tcg")


@pytest.fixture
def db(tmp_path: Path) -> Database:
    d = Database(tmp_path / "aenv.db")
    d.upgrade()
    return d


def _layer(layers: Path, blocks: dict[int, bytes]) -> LayerInfo:
    with LayerWriter(layers, SIZE, zero_blocks="zeroed") as w:
        for off in sorted(blocks):
            w.add_data(off, blocks[off])
        return w.finish()


def _snapshot(db: Database, sid: str, kind: SnapshotKind, disk: list[LayerInfo], *, memory: list[str] = (),
              memory_base: str | None = None, memory_location: str = "/m", source: str | None = None,
              status: SnapshotStatus = SnapshotStatus.COMMITTED) -> None:
    with db.session() as s:
        for info in disk:
            reference_layer(s, info, LayerKind.DISK)
        for digest in memory:  # memory layers only the repository holds
            if s.get(Layer, digest) is None:
                s.add(Layer(digest=digest, kind=LayerKind.MEMORY, size_bytes=0, local_path=None))
        s.add(Snapshot(id=sid, kind=kind, status=status, vmstate_location="/v", vmstate_format="qemu-devices",
                       memory_location=memory_location, memory_base_location=memory_base, source_sandbox_id=source,
                       config=SnapshotConfig(shape=SHAPE, access_token="tok", env_vars={"K": "v"})))
        s.flush()
        record_stack(s, sid, [LayerRef.local(i.path) for i in disk], list(memory))


def test_load_source_is_typed_and_follows_the_memory_base_rule(db: Database, tmp_path: Path) -> None:
    base = _layer(tmp_path, {0: b"a" * 4096})
    _snapshot(db, "boot", SnapshotKind.BOOT, [base], memory_location="/tpl/memory")
    _snapshot(db, "pause", SnapshotKind.PAUSE, [base], memory=["sha256:" + "ab" * 32], memory_base="/tpl/memory")
    _snapshot(db, "imported", SnapshotKind.PAUSE, [base], memory=["sha256:" + "cd" * 32])
    with db.session() as s:
        boot, pause, imported = (load_source(s, i) for i in ("boot", "pause", "imported"))
        assert load_source(s, "nope") is None
    assert boot is not None and pause is not None and imported is not None
    assert boot.memory_base == "/tpl/memory" and boot.memory_layers == []  # a boot snapshot's own RAM image
    assert pause.memory_base == "/tpl/memory" and pause.memory_layers == ["sha256:" + "ab" * 32]
    assert imported.memory_base == ""  # a chain whose layers stand alone
    assert pause.format is SnapshotFormat.QEMU_DEVICES and pause.shape == SHAPE
    assert pause.disk_layers == [LayerRef("sha256:" + base.digest, Path(base.path))]
    assert pause.access_token == "tok" and pause.env_vars == {"K": "v"}


async def test_store_load_refuses_what_is_not_committed(db: Database, tmp_path: Path) -> None:
    store = SnapshotStore(db, layers_dir=tmp_path, snapshots_dir=tmp_path / "snapshots")
    _snapshot(db, "gone", SnapshotKind.PAUSE, [_layer(tmp_path, {0: b"x" * 4096})], status=SnapshotStatus.COLLECTED)
    with pytest.raises(SnapshotNotFound, match="gone"):
        await store.load("gone")


async def test_compaction_keeps_the_disk_bytes_and_the_base(db: Database, tmp_path: Path) -> None:
    layers = tmp_path / "layers"
    layers.mkdir()
    chain = [_layer(layers, {0: b"0" * 4096, 8192: b"b" * 4096}), _layer(layers, {0: b"1" * 4096}),
             _layer(layers, {4096: b"2" * 4096}), _layer(layers, {0: b"3" * 4096, 12288: b"\0" * 4096})]
    _snapshot(db, "snp", SnapshotKind.PAUSE, chain)
    with Image.open([c.path for c in chain]) as before:
        want = before.pread(0, SIZE)
    assert await compact_snapshot(db, layers, "snp", limit=2)
    with db.session() as s:
        rows = list(s.scalars(select(SnapshotLayer).where(SnapshotLayer.snapshot_id == "snp")
                              .order_by(SnapshotLayer.position)))
        ev = s.scalars(select(Event).where(Event.operation == "compact")).one()
        paths = [load_source(s, "snp").disk_layers[i].path for i in range(2)]  # type: ignore[union-attr]
    assert [r.position for r in rows] == [0, 1] and rows[0].layer_digest == "sha256:" + chain[0].digest
    assert ev.detail == {"kind": "disk", "layers_before": 4, "layers_after": 2}
    with Image.open([p for p in paths if p is not None]) as after:
        assert after.pread(0, SIZE) == want
    assert not await compact_snapshot(db, layers, "snp", limit=2)  # short enough now


async def test_compaction_leaves_chains_with_repository_only_layers(db: Database, tmp_path: Path) -> None:
    chain = [_layer(tmp_path, {0: bytes([i + 1]) * 4096}) for i in range(4)]
    _snapshot(db, "snp", SnapshotKind.PAUSE, chain)
    with db.session() as s:  # the top layer was imported: only the repository has it
        row = s.get(Layer, "sha256:" + chain[-1].digest)
        assert row is not None
        row.local_path = None
    assert not await compact_snapshot(db, tmp_path, "snp", limit=2)


async def test_retiring_and_deleting_snapshots(db: Database, tmp_path: Path) -> None:
    info = _layer(tmp_path, {0: b"p" * 4096})
    for i in range(3):
        _snapshot(db, f"per{i}", SnapshotKind.PERIODIC, [info], source="isb")
    _snapshot(db, "mine", SnapshotKind.USER, [info], source="isb")
    with db.session() as s:
        insert_sandbox(s, Sandbox(id="iuser", template_id="base", snapshot_id="per0", state=SandboxState.PAUSED))
        s.add(Template(id="mine", kind=TemplateKind.SNAPSHOT))
    with db.session() as s:
        SnapshotStore.retire_older_periodic(s, "isb", keep="per2")
    store = SnapshotStore(db, layers_dir=tmp_path, snapshots_dir=tmp_path)
    assert await store.delete_user_snapshot("mine") and not await store.delete_user_snapshot("mine")
    assert not await store.delete_user_snapshot("per2")  # not a user snapshot
    with db.session() as s:
        status = {sn.id: sn.status for sn in s.scalars(select(Snapshot))}
        assert s.get(Template, "mine") is None
    # per0 stays: a sandbox is paused at it; per1 is superseded by per2
    assert status == {"per0": "committed", "per1": "deleted", "per2": "committed", "mine": "deleted"}


def test_memory_is_private_only_for_a_sandboxs_own_pause_snapshot(db: Database, tmp_path: Path) -> None:
    info = _layer(tmp_path, {0: b"q" * 4096})
    snap_dir = tmp_path / "snapshots"
    for sid, kind in (("own", SnapshotKind.PAUSE), ("user", SnapshotKind.USER)):
        (snap_dir / sid).mkdir(parents=True)
        _snapshot(db, sid, kind, [info], source="ia", memory_location=os.fspath(snap_dir / sid / "memory"))
    with db.session() as s:
        insert_sandbox(s, Sandbox(id="ia", template_id="base", snapshot_id="own", state=SandboxState.RUNNING))
    with db.session() as s:
        assert SnapshotStore.memory_is_private(s, "ia", "own")
        assert not SnapshotStore.memory_is_private(s, "ia", "user")  # a template: others restore from it
        assert not SnapshotStore.memory_is_private(s, "ib", "own")  # not ib's
    with db.session() as s:  # a fork child running from it too
        insert_sandbox(s, Sandbox(id="ic", template_id="base", snapshot_id="own", state=SandboxState.RUNNING))
    with db.session() as s:
        assert not SnapshotStore.memory_is_private(s, "ia", "own")


@pytest.mark.trio
async def test_load_makes_a_deferred_memory_image_from_its_layers_over_the_base(db: Database, tmp_path: Path) -> None:
    """A user or periodic snapshot committed without its flat memory image (capture.py ``defer_flat_image``):
    ``load`` makes it from the memory layers (local files) laid over the template's RAM file, a zeroed extent
    shadowing the base, and makes it once when two restores ask at the same moment."""
    ram = tmp_path / "tpl-memory"
    ram.write_bytes(b"B" * SIZE)
    (tmp_path / "layers").mkdir()
    first = _layer(tmp_path / "layers", {0: b"1" * 4096, 8192: b"1" * 4096})
    second = _layer(tmp_path / "layers", {8192: bytes(4096), 12288: b"2" * 4096})  # a zeroed page, a new one
    dest = tmp_path / "snapshots" / "user" / "memory"
    with db.session() as s:
        for info in (first, second):
            reference_layer(s, info, LayerKind.MEMORY)
        s.add(Snapshot(id="user", kind=SnapshotKind.USER, status=SnapshotStatus.COMMITTED, vmstate_location="/v",
                       vmstate_format="qemu-devices", memory_location=str(dest), memory_base_location=str(ram),
                       memory_from_layers=True, config=SnapshotConfig(shape=SHAPE)))
        s.flush()
        record_stack(s, "user", [], [layer_digest(first), layer_digest(second)])
    store = SnapshotStore(db, layers_dir=tmp_path / "layers", snapshots_dir=tmp_path / "snapshots")
    sources = []
    async with trio.open_nursery() as nursery:
        for _ in range(2):
            nursery.start_soon(lambda: _append(sources, store.load("user")))
    assert [s.memory for s in sources] == [dest, dest]
    data = dest.read_bytes()
    assert data[:4096] == b"1" * 4096 and data[4096:8192] == b"B" * 4096
    assert data[8192:12288] == bytes(4096) and data[12288:16384] == b"2" * 4096 and data[16384:] == b"B" * (SIZE - 16384)
    assert not [p for p in dest.parent.iterdir() if p.name != "memory"]  # no temporary left


async def _append(out: list[SnapshotSource], aw: Awaitable[SnapshotSource]) -> None:
    out.append(await aw)
