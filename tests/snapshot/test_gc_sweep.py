"""The collector's start-up sweep (``GarbageCollector.sweep_orphans``) on real files, no VM: what it removes and
what it leaves, as the directory entries' types tell it (it no longer stats each entry)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from collections.abc import Iterator

import pytest
import trio

from aenv_node.snapshot.gc import GarbageCollector
from aenv_node.state import Database, Layer, LayerKind, Snapshot, SnapshotKind, SnapshotStatus


@pytest.fixture
def db(tmp_path: Path) -> Iterator[Database]:
    d = Database(tmp_path / "aenv.db")
    d.upgrade()
    yield d
    d.close()


async def test_sweep_removes_orphans_and_temporaries_and_keeps_the_rest(db: Database, tmp_path: Path) -> None:
    layers, snaps = tmp_path / "layers", tmp_path / "snapshots"
    layers.mkdir()
    snaps.mkdir()
    old = time.time() - 7200

    def make(p: Path, *, age: float | None = old, directory: bool = False) -> Path:
        if directory:
            p.mkdir()
            (p / "vmstate").touch()
        else:
            p.touch()
        if age is not None:
            os.utime(p, (age, age))
        return p

    known = make(layers / ("ab" * 32 + ".layer"))
    orphan_layer = make(layers / ("cd" * 32 + ".layer"))
    young_orphan = make(layers / ("ef" * 32 + ".layer"), age=None)
    temp_layer = make(layers / ".tmp-1.layer", age=None)
    link = layers / ("01" * 32 + ".layer")
    link.symlink_to(orphan_layer)
    committed = make(snaps / "snp_kept", directory=True)
    cut = make(committed / "memory.part", age=None)
    collected = make(snaps / "snp_gone", directory=True)
    unknown_old = make(snaps / "snp_unknown", directory=True)
    os.utime(unknown_old / "vmstate", (old, old))
    unknown_young = make(snaps / "snp_new", directory=True, age=None)
    with db.session() as s:
        s.add(Layer(digest="sha256:" + "ab" * 32, kind=LayerKind.DISK, size_bytes=0, local_path=str(known)))
        for sid, status in (("snp_kept", SnapshotStatus.COMMITTED), ("snp_gone", SnapshotStatus.COLLECTED)):
            s.add(Snapshot(id=sid, kind=SnapshotKind.PAUSE, status=status))

    gc = GarbageCollector(db, layers_dir=layers, snapshots_dir=snaps, live=lambda: [], orphan_grace_s=3600,
                          patience_s=0)
    out = await gc.sweep_orphans()
    await trio.sleep(0)
    assert sorted(out.orphans) == sorted(map(str, (orphan_layer, temp_layer, cut, collected, unknown_old)))
    for p in (orphan_layer, temp_layer, cut, collected, unknown_old):
        assert not p.exists(), p
    for p in (known, young_orphan, committed, committed / "vmstate", unknown_young):
        assert p.exists(), p
    assert link.is_symlink()  # not ours to judge: left alone
