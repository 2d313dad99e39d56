"""OCI images -> block layers, on real images from a real registry: every OCI layer becomes one block layer
keyed by its chain, a second image sharing base layers converts only what differs, the result mounts with the
image's files and the provisioning's account, and a layer that cannot be applied leaves nothing behind."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import trio

from aenv_node.images.oci import pull
from aenv_node.state import Database
from aenv_node.templates import ImageConverter, TemplateBuildError
from aenv_node.templates.convert import chain_id
from aenv_node.templates.host_mount import mount_for_change
from tests.images.oci.images import GREETING, Images
from tests.images.oci.servers import Registry

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (loop devices, mount)")


def _db(tmp: Path) -> Database:
    db = Database(tmp / "aenv.db")
    db.upgrade()
    return db


def _leftovers(tmp: Path) -> list[str]:
    loops = subprocess.run(["losetup", "--list", "--noheadings", "--output", "BACK-FILE"], capture_output=True,
                           text=True, check=True).stdout
    mounts = Path("/proc/mounts").read_text()
    return [line for line in (loops + mounts).splitlines() if str(tmp) in line]


async def _pull(registry: Registry, tmp: Path, ref: str):  # type: ignore[no-untyped-def]
    return await pull(f"{registry.host}/{ref}", store_dir=tmp / "oci", registries=(),
                      insecure_registries=(registry.host,), concurrency=4)


async def test_layers_are_converted_once_per_chain_and_shared(tmp_path: Path, registry: Registry,
                                                              images: Images) -> None:
    db = _db(tmp_path)
    conv = ImageConverter(db, layers_dir=tmp_path / "layers", work_root=tmp_path / "work", run_root=tmp_path / "run")
    lines: list[str] = []
    v1 = await _pull(registry, tmp_path, "app:v1")
    first = await conv.convert(v1, progress=lines.append)
    assert first.converted == len(v1.layers) == 4
    assert len(first.layers) == len(first.chain) == 1 + 4 + 1  # empty fs, four OCI layers, provisioning
    assert any("layer 1/4" in line and "applied" in line for line in lines), lines
    assert any(line.startswith("provisioning: user user (uid 1000, created)") for line in lines), lines
    # the chain ids are OCI's ChainID over our empty filesystem
    assert first.chain[1] == chain_id(first.chain[0], v1.layers[0].diff_id)

    v2 = await _pull(registry, tmp_path, "app:v2")  # v1's four layers plus one
    lines.clear()
    second = await conv.convert(v2, progress=lines.append)
    assert second.converted == 1
    assert second.layers[:5] == first.layers[:5]
    assert sum("already converted" in line for line in lines) == 4
    rows = db.engine.connect().exec_driver_sql(
        "SELECT count(*), count(DISTINCT layer_digest) FROM image_layers").fetchone()
    assert rows is not None and rows[0] == 1 + 5 + 2  # empty, five OCI chains, two provisionings
    imgs = db.engine.connect().exec_driver_sql("SELECT digest, top_chain_id, layer_count FROM images").fetchall()
    assert sorted(r[2] for r in imgs) == [4, 5]

    # the converted filesystem is the image, plus the provisioning
    async with mount_for_change(list(second.layers), size=second.size, upper_dir=tmp_path / "check-up",
                                run_dir=tmp_path / "run", layers_dir=tmp_path / "layers") as fs:
        assert (fs.root / "etc" / "greeting").read_bytes() == GREETING
        assert (fs.root / "app" / "data.bin").read_bytes() == images.data
        assert (fs.root / "etc" / "version").read_bytes() == b"2\n"
        assert os.readlink(fs.root / "bin" / "sh") == "busybox"
        assert "user:x:1000:1000::/home/user:/bin/sh" in (fs.root / "etc" / "passwd").read_text()
        assert (fs.root / "opt" / "aenv").is_dir()
    assert not _leftovers(tmp_path)


async def test_a_second_converter_finds_the_first_ones_layers(tmp_path: Path, registry: Registry) -> None:
    db = _db(tmp_path)
    v1 = await _pull(registry, tmp_path, "app:v1")
    a = ImageConverter(db, layers_dir=tmp_path / "layers", work_root=tmp_path / "work", run_root=tmp_path / "run")
    await a.convert(v1)
    b = ImageConverter(db, layers_dir=tmp_path / "layers", work_root=tmp_path / "work", run_root=tmp_path / "run")
    again = await b.convert(v1)  # a node restarted: the rows are the cache
    assert again.converted == 0 and again.provisioned is None


async def test_two_builds_converting_one_image_at_once_convert_it_once(tmp_path: Path, registry: Registry) -> None:
    db = _db(tmp_path)
    conv = ImageConverter(db, layers_dir=tmp_path / "layers", work_root=tmp_path / "work", run_root=tmp_path / "run")
    v1 = await _pull(registry, tmp_path, "app:v1")
    results = []
    async with trio.open_nursery() as n:
        for _ in range(2):
            n.start_soon(lambda: _append(results, conv.convert(v1)))
    assert sorted(r.converted for r in results) == [0, 4]
    assert results[0].layers == results[1].layers


async def _append(out: list, coro) -> None:  # type: ignore[no-untyped-def]
    out.append(await coro)


async def test_an_image_without_a_shell_fails_and_leaves_no_layer(tmp_path: Path, registry: Registry) -> None:
    db = _db(tmp_path)
    conv = ImageConverter(db, layers_dir=tmp_path / "layers", work_root=tmp_path / "work", run_root=tmp_path / "run")
    single = await _pull(registry, tmp_path, "single:v1")  # one layer of data: no /bin/sh
    with pytest.raises(TemplateBuildError, match="no /bin/sh"):
        await conv.convert(single)
    rows = db.engine.connect().exec_driver_sql("SELECT diff_id FROM image_layers").fetchall()
    assert len(rows) == 2  # the empty filesystem and the image's layer, never a provisioning
    assert not _leftovers(tmp_path)
    assert not list((tmp_path / "work").iterdir())


async def test_a_corrupt_layer_is_an_error_naming_it_and_leaves_nothing(tmp_path: Path, registry: Registry) -> None:
    db = _db(tmp_path)
    conv = ImageConverter(db, layers_dir=tmp_path / "layers", work_root=tmp_path / "work", run_root=tmp_path / "run")
    v1 = await _pull(registry, tmp_path, "app:v1")
    blob = v1.layers[2].path
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF  # damaged in the store after the pull (its digest was checked then)
    blob.chmod(0o644)
    blob.write_bytes(bytes(data))
    before = sorted(p.name for p in (tmp_path / "layers").iterdir()) if (tmp_path / "layers").exists() else []
    with pytest.raises(TemplateBuildError, match=v1.layers[2].digest):
        await conv.convert(v1)
    rows = db.engine.connect().exec_driver_sql("SELECT count(*) FROM image_layers").fetchone()
    assert rows is not None and rows[0] == 1 + 2  # the empty filesystem and the two good layers below
    assert len(list((tmp_path / "layers").iterdir())) == len(before) + 3
    assert not _leftovers(tmp_path)
