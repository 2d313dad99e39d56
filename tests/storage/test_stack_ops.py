"""Import, seal, compaction (also under concurrent I/O), diff, and materialize into flat files."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Iterator

import pytest

from aenv_node.storage.compact import diff_extents
from aenv_node.storage.image import Image
from aenv_node.storage.importer import import_raw, import_raw_cached
from aenv_node.storage.layer import LayerReader
from aenv_node.storage.materialize import materialize, reflink_supported
from aenv_node.storage.upper import Upper

BLOCK = 4096


def _sparse_raw(path: Path, size: int, seed: int) -> bytes:
    """A sparse raw image: some data segments, some allocated zero blocks, holes elsewhere."""
    rnd = random.Random(seed)
    flat = bytearray(size)
    with open(path, "wb") as f:
        f.truncate(size)
        for _ in range(20):
            off = rnd.randrange(0, size - 64 * BLOCK) // 512 * 512
            n = rnd.randrange(1, 64 * BLOCK)
            data = rnd.randbytes(n) if rnd.random() < 0.7 else bytes(n)  # written zeros are allocated
            f.seek(off)
            f.write(data)
            flat[off : off + n] = data
    return bytes(flat)


def test_import_skips_holes_and_zero_blocks(tmp_path: Path) -> None:
    size = 1024 * BLOCK + 1000  # not a block multiple: padded up
    flat = _sparse_raw(tmp_path / "disk.raw", size, 1)
    info = import_raw(tmp_path / "disk.raw", tmp_path)
    with LayerReader.open(info.path) as r:
        assert r.virtual_size == 1025 * BLOCK
        assert r.read(0, size) == flat and r.read(size, 25 * BLOCK - 1000) == bytes(25 * BLOCK - 1000)
        nonzero = sum(1 for b in range(0, size, BLOCK) if flat[b : b + BLOCK].strip(b"\0"))
        data_blocks = sum(e.length for e in r.iter_extents() if not e.zeroed) // BLOCK
        assert data_blocks == nonzero  # exactly the non-zero blocks were stored
        assert not any(e.zeroed for e in r.iter_extents())


def test_a_cached_import_is_linked_by_the_next_node_and_redone_when_its_record_is_wrong(tmp_path: Path) -> None:
    raw = tmp_path / "rootfs-0123abcd.ext4"
    flat = _sparse_raw(raw, 512 * BLOCK, 2)
    cache = tmp_path / "imported"
    nodes = [tmp_path / f"node{i}" for i in range(3)]
    for d in nodes:
        d.mkdir()
    first = import_raw_cached(raw, nodes[0], virtual_size=1024 * BLOCK, cache_dir=cache)
    second = import_raw_cached(raw, nodes[1], virtual_size=1024 * BLOCK, cache_dir=cache)
    assert (second.digest, second.file_size, second.data_bytes) == (first.digest, first.file_size, first.data_bytes)
    assert second.path == str(nodes[1] / f"{first.digest}.layer")
    cached = cache / f"{raw.name}.{1024 * BLOCK}.layer"
    assert os.stat(second.path).st_ino == os.stat(cached).st_ino  # linked, not imported again
    with LayerReader.open(second.path) as r:
        assert r.read(0, len(flat)) == flat and r.virtual_size == 1024 * BLOCK
    # another virtual size is another import; a record that does not match its file is not trusted
    other = import_raw_cached(raw, nodes[2], virtual_size=2048 * BLOCK, cache_dir=cache)
    assert other.virtual_size == 2048 * BLOCK and other.digest != first.digest
    record = cache / f"{raw.name}.{1024 * BLOCK}.json"
    record.write_text(record.read_text().replace(f'"file_size": {first.file_size}', '"file_size": 1'))
    again = import_raw_cached(raw, tmp_path / "node2", virtual_size=1024 * BLOCK, cache_dir=cache)
    assert again.digest == first.digest and f'"file_size": {first.file_size}' in record.read_text()
    assert not [p.name for p in cache.iterdir() if p.name.startswith(".")]  # no temporary left


def test_seal_reuses_upper_data_file(tmp_path: Path) -> None:
    (tmp_path / "layers").mkdir()
    img = Image.open([], tmp_path / "up", size=256 * BLOCK)
    img.pwrite(0, b"a" * 10 * BLOCK)
    img.write_zeroes(20 * BLOCK, 5 * BLOCK)
    ino = os.stat(img.upper.data_path).st_ino
    info = img.seal(tmp_path / "layers")
    assert os.stat(info.path).st_ino == ino  # the upper's file became the layer: no copy
    assert img.upper.empty and len(img.layers) == 1
    exts = list(img.layers[0].iter_extents())
    assert [(e.offset, e.length, e.zeroed) for e in exts] == [(0, 10 * BLOCK, False), (20 * BLOCK, 5 * BLOCK, True)]
    img.pwrite(BLOCK, b"b" * 100)
    assert img.pread(0, 2 * BLOCK) == b"a" * BLOCK + b"b" * 100 + b"a" * (BLOCK - 100)
    img.close()
    assert sorted(os.listdir(tmp_path / "up")) == ["data.1", "log.1", "stack.1"]


def test_diff_extents(tmp_path: Path) -> None:
    (tmp_path / "layers").mkdir()
    img = Image.open([], tmp_path / "up", size=256 * BLOCK)
    img.pwrite(0, b"a" * 8 * BLOCK)
    img.seal(tmp_path / "layers")
    img.pwrite(2 * BLOCK, b"b" * BLOCK)
    img.trim(6 * BLOCK, 4 * BLOCK)  # half over data of the base, half over a hole
    img.trim(100 * BLOCK, BLOCK)  # only over a hole: no visible change
    assert sorted(img.changed_extents()) == [(2 * BLOCK, BLOCK, False), (6 * BLOCK, 4 * BLOCK, True),
                                             (100 * BLOCK, BLOCK, True)]
    img.seal(tmp_path / "layers")
    base, top = img.layers
    changes = diff_extents([top], [base])
    assert [(c.offset, c.length, c.zeroed) for c in changes] == [(2 * BLOCK, BLOCK, False), (6 * BLOCK, 2 * BLOCK, True)]
    img.close()


def test_compaction_under_concurrent_io(tmp_path: Path) -> None:
    """Readers and a writer keep running while a 10-layer chain is compacted and swapped in."""
    layers_dir = tmp_path / "layers"
    layers_dir.mkdir()
    size = 512 * BLOCK
    rnd = random.Random(3)
    model = bytearray(size)
    img = Image.open([], tmp_path / "up", size=size)
    for _ in range(10):
        for _ in range(20):
            off = rnd.randrange(0, size - 8 * BLOCK)
            data = rnd.randbytes(rnd.randrange(1, 8 * BLOCK))
            img.pwrite(off, data)
            model[off : off + len(data)] = data
        img.seal(layers_dir)
    frozen = bytes(model)  # the writer below only touches the last 64 blocks
    stop = threading.Event()
    errors: list[BaseException] = []

    def reader(seed: int) -> None:
        r = random.Random(seed)
        try:
            while not stop.is_set():
                off = r.randrange(0, size - 64 * BLOCK - 3 * BLOCK)
                n = r.randrange(1, 3 * BLOCK)
                assert img.pread(off, n) == frozen[off : off + n]
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    def writer() -> None:
        r = random.Random(9)
        try:
            while not stop.is_set():
                off = size - 64 * BLOCK + r.randrange(0, 60 * BLOCK)
                img.pwrite(off, r.randbytes(r.randrange(1, 4 * BLOCK)))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(3)] + [threading.Thread(target=writer)]
    for t in threads:
        t.start()
    try:
        info = img.compact(0, 10, layers_dir, compression="zstd")
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors, errors[0]
    assert len(img.layers) == 1 and img.layers[0].name == info.path
    assert img.pread(0, size - 64 * BLOCK) == frozen[: size - 64 * BLOCK]
    img.close()


@pytest.fixture
def xfs_dir(tmp_path: Path) -> Iterator[Path]:
    """A small loop-mounted XFS (reflink-capable), unmounted afterwards."""
    if not shutil.which("mkfs.xfs") or os.geteuid() != 0:
        pytest.skip("needs mkfs.xfs and root")
    img, mnt = tmp_path / "xfs.img", tmp_path / "mnt"
    with open(img, "wb") as f:
        f.truncate(320 << 20)
    mnt.mkdir()
    if subprocess.run(["mkfs.xfs", "-q", "-m", "reflink=1", str(img)], capture_output=True).returncode:
        pytest.skip("mkfs.xfs failed")
    if subprocess.run(["mount", "-o", "loop", str(img), str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot loop-mount here")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def _stack(d: Path, size: int, n_layers: int, seed: int) -> tuple[list[LayerReader], list[bytes]]:
    """Layers bottom-first and the flat content of each prefix of the stack."""
    (d / "layers").mkdir()
    rnd = random.Random(seed)
    model = bytearray(size)
    img = Image.open([], d / "up", size=size)
    prefixes = []
    for _ in range(n_layers):
        for _ in range(30):
            off = rnd.randrange(0, size - 16 * BLOCK)
            if rnd.random() < 0.2:
                n = rnd.randrange(1, 16 * BLOCK)
                img.trim(off, n)
                model[off : off + n] = bytes(n)
            else:
                data = rnd.randbytes(rnd.randrange(1, 16 * BLOCK))
                img.pwrite(off, data)
                model[off : off + len(data)] = data
        img.seal(d / "layers")
        prefixes.append(bytes(model))
    paths = [l.name for l in img.layers]
    img.close()
    return [LayerReader.open(p) for p in paths], prefixes


def _materialize_checks(d: Path, expect_clone: bool) -> None:
    size = 1024 * BLOCK
    layers, prefixes = _stack(d, size, 4, 11)
    try:
        st = materialize(layers[:2], d / "flat2")
        assert (d / "flat2").read_bytes() == prefixes[1]
        st = materialize(layers, d / "flat4", base=(d / "flat2", 2))
        assert (d / "flat4").read_bytes() == prefixes[3]
        if expect_clone:
            assert st.base_cloned and st.cloned_bytes > 0 and st.written_bytes == 0
        st = materialize(layers, d / "flat4v", verify=True)
        assert (d / "flat4v").read_bytes() == prefixes[3] and st.written_bytes > 0
        assert (d / "flat4").stat().st_blocks * 512 < size  # stays sparse
    finally:
        for l in layers:
            l.close()


def test_materialize(tmp_path: Path) -> None:
    _materialize_checks(tmp_path, expect_clone=False)


def test_materialize_reflink(xfs_dir: Path) -> None:
    assert reflink_supported(xfs_dir)
    _materialize_checks(xfs_dir, expect_clone=True)


def test_seal_across_filesystems_copies(tmp_path: Path, xfs_dir: Path) -> None:
    """Layers on another filesystem than the upper: no hard link possible, the kernel copies the file."""
    img = Image.open([], tmp_path / "up", size=64 * BLOCK)
    img.pwrite(BLOCK, b"m" * 3 * BLOCK)
    info = img.seal(xfs_dir)
    assert os.path.dirname(info.path) == str(xfs_dir)
    img.close()
    with Image.open([info.path]) as ro:
        assert ro.pread(0, 5 * BLOCK) == bytes(BLOCK) + b"m" * 3 * BLOCK + bytes(BLOCK)
        ro.layers[0].verify()


def test_read_only_image_rejects_writes(tmp_path: Path) -> None:
    from aenv_node.storage import OutOfRange, ReadOnlyDevice

    with open(tmp_path / "r.raw", "wb") as f:
        f.write(b"z" * 8 * BLOCK)
    info = import_raw(tmp_path / "r.raw", tmp_path)
    with Image.open([info.path]) as img:
        assert img.size == 8 * BLOCK and img.pread(BLOCK, 3) == b"zzz"
        with pytest.raises(ReadOnlyDevice):
            img.pwrite(0, b"x")
        with pytest.raises(OutOfRange):
            img.pread(8 * BLOCK - 1, 2)


def test_layer_pool_shares_readers(tmp_path: Path) -> None:
    import gc

    from aenv_node.storage.layer_pool import LayerPool

    with open(tmp_path / "r.raw", "wb") as f:
        f.write(b"p" * 16 * BLOCK)
    info = import_raw(tmp_path / "r.raw", tmp_path)
    pool = LayerPool(tmp_path)
    base = pool.get(info.digest)
    imgs = [Image([base], Upper(tmp_path / f"u{i}", 16 * BLOCK)) for i in range(3)]
    same = pool.get(info.digest) is base  # (not inside assert: pytest would keep the reader alive)
    assert same
    imgs[0].pwrite(0, b"x")
    assert imgs[1].pread(0, 2) == b"pp" and imgs[0].pread(0, 2) == b"xp"
    fd = base.fileno()
    for img in imgs:
        img.close()
    assert os.fstat(fd)  # still open: the pool's caller holds it
    del base, imgs, img
    gc.collect()
    assert info.digest not in pool  # dropped with its last holder, file closed
    with pytest.raises(OSError):
        os.fstat(fd)


def test_seal_drops_trimmed_garbage(tmp_path: Path) -> None:
    (tmp_path / "layers").mkdir()
    img = Image.open([], tmp_path / "up", size=2048 * BLOCK)
    data = random.Random(2).randbytes(1024 * BLOCK)
    img.pwrite(0, data)
    img.trim(0, 900 * BLOCK)  # 900 of 1024 allocated blocks are garbage now
    ino = os.stat(img.upper.data_path).st_ino
    info = img.seal(tmp_path / "layers")
    assert os.stat(info.path).st_ino != ino  # copied, not adopted
    assert info.file_size < 200 * BLOCK
    assert img.pread(0, 1024 * BLOCK) == bytes(900 * BLOCK) + data[900 * BLOCK :]
    img.close()


def test_import_ext4_image(tmp_path: Path) -> None:
    """A real ext4 image built from a folder imports into a layer much smaller than the image, and
    materializes back to the identical bytes."""
    if not shutil.which("mkfs.ext4"):
        pytest.skip("needs mkfs.ext4 (e2fsprogs)")
    src = tmp_path / "tree"
    (src / "etc").mkdir(parents=True)
    (src / "etc" / "hostname").write_text("sandbox\n")
    (src / "blob.bin").write_bytes(random.Random(4).randbytes(3 << 20))
    img = tmp_path / "rootfs.ext4"
    subprocess.run(["mkfs.ext4", "-q", "-F", "-d", str(src), str(img), "64M"], check=True, capture_output=True)
    info = import_raw(img, tmp_path)
    assert info.virtual_size == 64 << 20
    assert info.file_size < 16 << 20  # only the used blocks were stored
    with LayerReader.open(info.path) as layer:
        materialize([layer], tmp_path / "back.ext4")
    assert (tmp_path / "back.ext4").read_bytes() == img.read_bytes()


def test_seal_while_threads_write_and_read(tmp_path: Path) -> None:
    """Seals swap the stack under writers and readers: each thread always reads back its own last writes."""
    layers_dir = tmp_path / "layers"
    layers_dir.mkdir()
    size = 256 * BLOCK
    img = Image.open([], tmp_path / "up", size=size)
    stop = threading.Event()
    errors: list[BaseException] = []
    models = [bytearray(64 * BLOCK) for _ in range(4)]

    def worker(k: int) -> None:
        r = random.Random(k)
        base = k * 64 * BLOCK
        model = models[k]
        try:
            while not stop.is_set():
                off = r.randrange(0, 63 * BLOCK)
                n = r.randrange(1, BLOCK + 1)
                if r.random() < 0.15:
                    img.trim(base + off, n)
                    model[off : off + n] = bytes(n)
                else:
                    data = r.randbytes(n)
                    img.pwrite(base + off, data)
                    model[off : off + n] = data
                s = r.randrange(0, 60 * BLOCK)
                assert img.pread(base + s, 4 * BLOCK) == model[s : s + 4 * BLOCK]
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    try:
        for _ in range(8):
            img.seal(layers_dir)
        img.compact(0, 4, layers_dir)
        img.seal(layers_dir)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors, errors[0]
    assert img.pread(0, size) == b"".join(bytes(m) for m in models)
    paths = [l.name for l in img.layers]
    img.close()
    with Image.open(paths, tmp_path / "up") as again:
        assert again.pread(0, size) == b"".join(bytes(m) for m in models)


def test_upper_records_its_stack(tmp_path: Path) -> None:
    """Seal and compaction record the layer list in the upper in the same commit, so a crash right after a
    seal (before the caller stored the new list) loses nothing, and a stale list is refused, not misread."""
    from aenv_node.storage import ImageError
    from aenv_node.storage.layer_pool import LayerPool

    layers_dir = tmp_path / "layers"
    layers_dir.mkdir()
    with open(tmp_path / "r.raw", "wb") as f:
        f.write(b"b" * 64 * BLOCK)
    base = import_raw(tmp_path / "r.raw", layers_dir)
    img = Image.open([base.path], tmp_path / "up")
    img.pwrite(0, b"1" * BLOCK)
    img.seal(layers_dir)
    img.pwrite(BLOCK, b"2" * BLOCK)
    img.seal(layers_dir)
    img.pwrite(2 * BLOCK, b"3" * BLOCK)
    img.flush()
    expect = img.pread(0, 64 * BLOCK)
    stack = [l.digest for l in img.layers]
    img.abandon()  # crash: the caller never learnt about the two seals
    with pytest.raises(ImageError, match="recorded stack"):
        Image.open([base.path], tmp_path / "up")
    with Image.reopen(tmp_path / "up", layers_dir) as again:
        assert [l.digest for l in again.layers] == stack
        assert again.pread(0, 64 * BLOCK) == expect
        again.compact(0, 3, layers_dir)
        stack = [l.digest for l in again.layers]
    pool = LayerPool(layers_dir)
    with Image.reopen(tmp_path / "up", pool) as again:
        assert [l.digest for l in again.layers] == stack and len(stack) == 1
        assert again.pread(0, 64 * BLOCK) == expect
