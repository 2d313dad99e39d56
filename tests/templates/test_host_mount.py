"""A layered disk's ext4 mounted on the host for a change, sealed into exactly one layer: the change is what
the next mount sees, the layer holds only what the change wrote, and every failure leaves nothing mounted,
attached or written."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import trio

from aenv_node.storage import import_raw
from aenv_node.templates.errors import TemplateBuildError
from aenv_node.templates.host_mount import make_empty_ext4, mount_for_change

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (loop devices, mount)")


def _loops_on(path_part: str) -> list[str]:
    out = subprocess.run(["losetup", "--list", "--noheadings", "--output", "NAME,BACK-FILE"],
                         capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if path_part in line]


def _mounts_under(path_part: str) -> list[str]:
    return [line for line in Path("/proc/mounts").read_text().splitlines() if path_part in line]


@pytest.fixture
def empty_fs(tmp_path: Path) -> Path:
    raw = tmp_path / "empty.ext4"
    make_empty_ext4(raw, 256 << 20)
    layers = tmp_path / "layers"
    layers.mkdir()
    return Path(import_raw(raw, layers).path)


async def test_a_change_becomes_one_layer_the_next_mount_sees(tmp_path: Path, empty_fs: Path) -> None:
    layers, run = tmp_path / "layers", tmp_path / "run"
    # more free space asked for than the 256 MiB filesystem has: grown to the 512 MiB device first
    async with mount_for_change([empty_fs], size=512 << 20, upper_dir=tmp_path / "up", run_dir=run,
                                layers_dir=layers, min_free=300 << 20) as fs:
        (fs.root / "etc").mkdir()
        (fs.root / "etc" / "motd").write_text("hello from a layer\n")
        st = os.statvfs(fs.root)
        assert st.f_blocks * st.f_frsize > 400 << 20
        fs.commit()
    assert fs.sealed is not None
    first = Path(fs.sealed.path)
    assert fs.sealed.virtual_size == 512 << 20
    assert fs.sealed.file_size < 8 << 20  # the blocks the change wrote, not the filesystem
    assert not _loops_on(str(tmp_path)) and not _mounts_under(str(tmp_path))

    async with mount_for_change([empty_fs, first], size=512 << 20, upper_dir=tmp_path / "up", run_dir=run,
                                layers_dir=layers) as fs:
        assert (fs.root / "etc" / "motd").read_text() == "hello from a layer\n"
        (fs.root / "etc" / "motd").unlink()
        # not committed: discarded
    assert fs.sealed is None
    async with mount_for_change([empty_fs, first], size=512 << 20, upper_dir=tmp_path / "up", run_dir=run,
                                layers_dir=layers) as fs:
        assert (fs.root / "etc" / "motd").exists()
    assert sorted(p.name for p in layers.iterdir()) == sorted([empty_fs.name, first.name])
    assert not (tmp_path / "up").exists() and not run.exists()


async def test_a_failure_inside_leaves_nothing(tmp_path: Path, empty_fs: Path) -> None:
    layers = tmp_path / "layers"
    before = set(layers.iterdir())
    with pytest.raises(RuntimeError, match="boom"):
        async with mount_for_change([empty_fs], size=256 << 20, upper_dir=tmp_path / "up", run_dir=tmp_path / "run",
                                    layers_dir=layers) as fs:
            (fs.root / "x").write_bytes(b"x" * 100_000)
            fs.commit()
            raise RuntimeError("boom")
    assert set(layers.iterdir()) == before
    assert not _loops_on(str(tmp_path)) and not _mounts_under(str(tmp_path)) and not (tmp_path / "up").exists()
    assert not (tmp_path / "run").exists()


async def test_a_cancelled_change_leaves_nothing(tmp_path: Path, empty_fs: Path) -> None:
    layers = tmp_path / "layers"
    with trio.move_on_after(1):
        async with mount_for_change([empty_fs], size=256 << 20, upper_dir=tmp_path / "up", run_dir=tmp_path / "run",
                                    layers_dir=layers) as fs:
            fs.commit()
            await trio.sleep_forever()
    assert fs.sealed is None
    assert not _loops_on(str(tmp_path)) and not _mounts_under(str(tmp_path))


async def test_not_an_ext4_is_a_clear_error(tmp_path: Path) -> None:
    raw = tmp_path / "zeros.raw"
    raw.write_bytes(b"\0" * (4 << 20))
    (tmp_path / "layers").mkdir()
    layer = Path(import_raw(raw, tmp_path / "layers").path)
    with pytest.raises(TemplateBuildError, match="mounting the image's ext4"):
        async with mount_for_change([layer], size=4 << 20, upper_dir=tmp_path / "up", run_dir=tmp_path / "run",
                                    layers_dir=tmp_path / "layers"):
            pass
    assert not _loops_on(str(tmp_path)) and not _mounts_under(str(tmp_path))
