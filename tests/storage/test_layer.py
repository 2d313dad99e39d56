"""Layer files: round trips, zero handling, compression, and corruption/truncation always detected."""

from __future__ import annotations

import hashlib
import os
import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aenv_node.storage import BytesSource, FileSource, LayerCorrupt, LayerFormatError
from aenv_node.storage.layer import Extent, LayerReader, LayerWriter

BLOCK = 4096


def _build(tmp: Path, compression: str | None, zero_blocks: str = "keep") -> tuple[str, bytes]:
    """A 1 MiB layer with data, zero blocks, zeroed extents and holes; returns (path, expected flat view)."""
    rnd = random.Random(7)
    size = 256 * BLOCK
    flat = bytearray(size)
    with LayerWriter(tmp, size, compression=compression, zero_blocks=zero_blocks, group_size=16 * BLOCK) as w:
        pos = 0
        while pos < size - 40 * BLOCK:
            pos += rnd.randrange(0, 6) * BLOCK
            n = rnd.randrange(1, 30) * BLOCK
            kind = rnd.random()
            if kind < 0.15:
                w.add_zeroed(pos, n)
            else:
                data = bytearray(rnd.randbytes(n) if kind < 0.8 else bytes(n))
                if kind < 0.5:  # some zero blocks inside data
                    data[BLOCK : 2 * BLOCK] = bytes(BLOCK)
                w.add_data(pos, bytes(data))
                flat[pos : pos + n] = data
            pos += n
        info = w.finish()
    return info.path, bytes(flat)


@pytest.mark.parametrize("compression", [None, "zstd"])
@pytest.mark.parametrize("zero_blocks", ["keep", "omit", "zeroed"])
def test_round_trip(tmp_path: Path, compression: str | None, zero_blocks: str) -> None:
    path, flat = _build(tmp_path, compression, zero_blocks)
    data = Path(path).read_bytes()
    assert os.path.basename(path) == hashlib.sha256(data).hexdigest() + ".layer"
    with LayerReader.open(path) as r:
        assert r.digest == hashlib.sha256(data).hexdigest()
        assert r.compressed == (compression == "zstd")
        assert r.read(0, len(flat)) == flat
        rnd = random.Random(1)
        for _ in range(200):
            o = rnd.randrange(len(flat))
            n = rnd.randrange(0, min(3 * BLOCK, len(flat) - o) + 1)
            assert r.read(o, n) == flat[o : o + n]
        r.verify()
        exts = list(r.iter_extents())
        assert all(isinstance(e, Extent) for e in exts)
        assert all(a.offset + a.length <= b.offset for a, b in zip(exts, exts[1:]))
        if zero_blocks != "keep":  # zero blocks stored no data
            for e in exts:
                if not e.zeroed:
                    assert any(flat[e.offset + i : e.offset + i + BLOCK] != bytes(BLOCK)
                               for i in range(0, e.length, BLOCK))


def test_same_content_same_digest(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a, _ = _build(tmp_path / "a", None)
    b, _ = _build(tmp_path / "b", None)
    assert os.path.basename(a) == os.path.basename(b)
    c, _ = _build(tmp_path / "b", "zstd")
    assert os.path.basename(c) != os.path.basename(b)


def test_crc32_layers_stay_readable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Layers written where xxhash is missing use crc32 data checksums; every reader accepts both."""
    from aenv_node.storage import layer_format as F

    monkeypatch.setattr(F, "default_csum_flag", lambda: 0)
    for comp in (None, "zstd"):
        d = tmp_path / str(comp)
        d.mkdir()
        path, flat = _build(d, comp)
        with LayerReader.open(path) as r:
            assert not r.geometry.flags & F.FLAG_CSUM_XXH3
            assert r.read(0, len(flat)) == flat
            r.verify()


def test_reader_works_over_any_source(tmp_path: Path) -> None:
    path, flat = _build(tmp_path, "zstd")
    with LayerReader(BytesSource(Path(path).read_bytes())) as r:
        assert r.read(0, len(flat)) == flat


def test_writer_rejects_bad_extents(tmp_path: Path) -> None:
    with LayerWriter(tmp_path, 16 * BLOCK) as w:
        with pytest.raises(LayerFormatError):
            w.add_data(100, bytes(BLOCK))  # unaligned
        w.add_data(4 * BLOCK, bytes(BLOCK))
        with pytest.raises(LayerFormatError):
            w.add_data(2 * BLOCK, bytes(BLOCK))  # goes backwards
        with pytest.raises(LayerFormatError):
            w.add_zeroed(15 * BLOCK, 2 * BLOCK)  # past the end
    assert [p for p in os.listdir(tmp_path) if p.startswith(".tmp")] == []  # aborted writer cleaned up


def test_empty_layer(tmp_path: Path) -> None:
    with LayerWriter(tmp_path, 8 * BLOCK) as w:
        info = w.finish()
    with LayerReader.open(info.path) as r:
        assert list(r.iter_extents()) == []
        assert r.read(0, 8 * BLOCK) == bytes(8 * BLOCK)


def _read_everything(blob: bytes) -> bytes:
    r = LayerReader(BytesSource(blob))
    out = r.read(0, r.virtual_size)
    r.verify()
    return out


_corrupt_settings = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_corruption_never_yields_wrong_data(tmp_path: Path, compression: str | None) -> None:
    path, flat = _build(tmp_path, compression)
    blob = Path(path).read_bytes()
    size = len(blob)

    @_corrupt_settings
    @given(pos=st.one_of(st.integers(0, size - 1), st.integers(0, 200), st.integers(size - 4096, size - 3900)),
           xor=st.integers(1, 255))
    def check(pos: int, xor: int) -> None:
        bad = bytearray(blob)
        bad[pos] ^= xor
        try:
            out = _read_everything(bytes(bad))
        except LayerCorrupt as e:
            assert e.what and str(e)
            return
        assert out == flat  # the flip hit padding that no reader uses

    check()


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_truncation_detected(tmp_path: Path, compression: str | None) -> None:
    path, _ = _build(tmp_path, compression)
    blob = Path(path).read_bytes()

    @_corrupt_settings
    @given(cut=st.integers(0, len(blob) - 1))
    def check(cut: int) -> None:
        with pytest.raises(LayerCorrupt):
            _read_everything(blob[:cut])

    check()


def test_corrupt_data_block_named(tmp_path: Path) -> None:
    path, flat = _build(tmp_path, None)
    with LayerReader.open(path) as r:
        e = next(x for x in r.iter_extents() if not x.zeroed)
    fd = os.open(path, os.O_RDWR)
    try:
        pos = 4096 + e.data_offset + 10
        os.pwrite(fd, bytes([os.pread(fd, 1, pos)[0] ^ 0xFF]), pos)
    finally:
        os.close(fd)
    with LayerReader(FileSource(path), name="L") as r:
        with pytest.raises(LayerCorrupt) as ei:
            r.read(e.offset, BLOCK)
        assert ei.value.what == "data block" and ei.value.where == pos - 10
        assert "L" in str(ei.value)


def test_a_writer_that_finds_no_room_for_its_header_leaves_no_temporary(tmp_path: Path) -> None:
    """On a full filesystem (a real tmpfs of 64 KiB, filled) the constructor's header write fails with ENOSPC:
    no ``.tmp-*`` file may stay (no ``with`` block ever runs to abort it)."""
    import errno
    import subprocess

    mnt = tmp_path / "full"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], check=True)
    try:
        # close-on-exec: a process another thread forks meanwhile must not hold the tmpfs busy
        fd = os.open(mnt / "ballast", os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC)
        try:
            with pytest.raises(OSError):
                while True:
                    os.write(fd, b"x" * 4096)
        finally:
            os.close(fd)
        with pytest.raises(OSError) as err:
            LayerWriter(mnt, 1 << 20)
        assert err.value.errno == errno.ENOSPC
        assert sorted(p.name for p in mnt.iterdir()) == ["ballast"]
    finally:  # a busy tmpfs (a child of another test's process holding a file) is detached all the same
        if subprocess.run(["umount", str(mnt)], check=False).returncode != 0:
            subprocess.run(["umount", "--lazy", str(mnt)], check=True)
        assert str(mnt) not in Path("/proc/self/mounts").read_text()
