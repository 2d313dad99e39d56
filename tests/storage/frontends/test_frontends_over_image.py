"""The frontends over the real layered Image (base layer + writable upper), not just a flat file: a qemu-io
workload through NBD, then the same disk read back through FUSE, both compared with a reference file."""

from __future__ import annotations

import os
import random

from aenv_node.storage import Image, import_raw
from aenv_node.storage.frontends import mount_fuse, serve_nbd
from conftest import random_workload, qemu_io, run

MiB = 1024 * 1024
SIZE = 8 * MiB


async def test_nbd_then_fuse_over_a_layered_image(tmp_path, short_dir) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(42)
    base = bytearray(SIZE)
    for _ in range(40):  # a base image with data here and there, holes elsewhere
        off = rng.randrange(0, SIZE // 4096 - 16) * 4096
        base[off : off + 65536] = os.urandom(65536)[: len(base[off : off + 65536])]
    raw = tmp_path / "base.raw"
    raw.write_bytes(base)
    layers = tmp_path / "layers"
    layers.mkdir()
    info = import_raw(raw, layers, compression="zstd")

    ref = bytearray(base)
    cmds = random_workload(rng, ref, 100, [512, 4096, 12288, 65536, 100000], ops=["write", "write", "zero", "discard"])
    (tmp_path / "ref.img").write_bytes(ref)

    image = Image.open([info.path], tmp_path / "upper")
    try:
        assert image.size == SIZE
        async with serve_nbd(image, os.path.join(short_dir, "img.sock")) as server:
            await run("qemu-img", "compare", "-f", "raw", "-F", "raw", server.uri, str(raw))  # before any write
            await qemu_io(server.uri, *cmds)
            await run("qemu-img", "compare", "-f", "raw", "-F", "raw", server.uri, str(tmp_path / "ref.img"))
        assert image.pread(0, SIZE) == bytes(ref)
        mnt = tmp_path / "mnt"
        mnt.mkdir()
        async with mount_fuse({"disk.raw": image}, mnt) as fs:
            await run("qemu-img", "compare", "-f", "raw", "-F", "raw", str(fs.path("disk.raw")),
                      str(tmp_path / "ref.img"))
            await qemu_io(str(fs.path("disk.raw")), "write -P 0x77 1M 64k", "flush")
        ref[MiB : MiB + 65536] = b"\x77" * 65536
        assert image.pread(0, SIZE) == bytes(ref)
    finally:
        image.close()
