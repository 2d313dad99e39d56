"""``aenv-node layer import``: a raw disk image becomes a base layer in the repository and a ``layers`` row."""

from __future__ import annotations

import os
from pathlib import Path

from aenv_node.storage import LayerReader, import_raw
from aenv_node.storage.repository import layer_key

from .conftest import IMAGE_SIZE, Cli, sha256_file


def test_import_ext4_prints_digest_stores_layer_and_row(cli: Cli, ext4_image: Path, tmp_path: Path) -> None:
    p = cli.run("layer", "import", str(ext4_image))
    digest = p.stdout.strip()
    assert p.stdout.count("\n") == 1 and digest.startswith("sha256:")
    assert "importing disk.img" in p.stderr  # progress went to stderr, not stdout

    stored = cli.repository / layer_key(digest)
    assert sha256_file(stored) == digest  # content-addressed: the digest is the sha256 of the stored file
    # the layer and its per-chunk checksum record (what P2P checks peers' ranges against); no temp file left
    record = stored.with_name(stored.name + ".chunks")
    assert cli.repo_files() == [stored, record]
    assert not any((cli.state_dir / "tmp").iterdir())  # staging removed

    # the same layer the library's importer writes (the CLI's progress loop must not change a byte)
    lib = import_raw(ext4_image, tmp_path)
    assert "sha256:" + lib.digest == digest

    with LayerReader.open(stored) as r:
        assert r.virtual_size == IMAGE_SIZE
        assert r.read(0, IMAGE_SIZE) == ext4_image.read_bytes()

    rows = cli.layer_rows()
    assert rows == {digest: ("disk", stored.stat().st_size, IMAGE_SIZE, layer_key(digest), 0)}

    # importing again is a no-op with the same answer (content-addressed), still one row
    assert cli.import_layer(ext4_image) == digest
    assert len(cli.layer_rows()) == 1 and cli.repo_files() == [stored, record]


def test_import_sparse_unaligned_file_with_virtual_size(cli: Cli, tmp_path: Path) -> None:
    """A sparse file whose size is not 4 KiB-aligned, imported into a larger disk: holes cost nothing, the tail
    past the file reads as zeros."""
    raw = tmp_path / "raw.bin"
    head, tail = os.urandom(12288), os.urandom(1000)
    with open(raw, "wb") as f:
        f.write(head)
        f.seek(3 << 20)
        f.write(tail)  # size 3 MiB + 1000: a hole in the middle, a partial last block
    digest = cli.import_layer(raw, "--virtual-size", "16M", "--compress")
    stored = cli.repository / layer_key(digest)
    with LayerReader.open(stored) as r:
        assert r.virtual_size == 16 << 20 and r.compressed
        assert r.read(0, len(head)) == head
        assert r.read(len(head), (3 << 20) - len(head)) == bytes((3 << 20) - len(head))
        assert r.read(3 << 20, 4096) == tail + bytes(4096 - len(tail))
        assert r.read(4 << 20, 4096) == bytes(4096)
        data = sum(e.length for e in r.iter_extents() if not e.zeroed)
    assert data == 3 * 4096 + 4096  # four data blocks (12 KiB head, one tail block), no hole stored
    assert cli.layer_rows()[digest][2] == 16 << 20
