"""The issue's proof: an image served over NBD stays identical to the flat file it mirrors through a
random workload with seals in between and a compaction at the end, checked with `qemu-img compare`."""

from __future__ import annotations

import os
import random

import trio

from aenv_node.storage import Image, import_raw
from aenv_node.storage.frontends import serve_nbd
from conftest import qemu_io, random_workload, run

MiB = 1024 * 1024
SIZE = 16 * MiB


def _workload(rng: random.Random, ref: bytearray, n: int) -> list[str]:
    return random_workload(rng, ref, n, [4096, 8192, 65536, 200704], aligned=True)


async def test_workload_with_seals_and_compaction_matches_flat_file(tmp_path, short_dir) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(7)
    base = bytearray(SIZE)
    for _ in range(30):
        off = rng.randrange(0, SIZE // 4096 - 32) * 4096
        base[off : off + 131072] = os.urandom(131072)
    raw = tmp_path / "base.raw"
    raw.write_bytes(base)
    layers = tmp_path / "layers"
    layers.mkdir()
    info = import_raw(raw, layers)
    ref = bytearray(base)
    flat = tmp_path / "flat.img"

    image = Image.open([info.path], tmp_path / "upper")
    try:
        async with serve_nbd(image, os.path.join(short_dir, "img.sock")) as server:
            for _round in range(4):
                await qemu_io(server.uri, *_workload(rng, ref, 60))
                await trio.to_thread.run_sync(image.seal, layers)  # live: the export keeps serving
            assert len(image.layers) == 5
            await qemu_io(server.uri, *_workload(rng, ref, 40))  # writes into the fresh upper
            await trio.to_thread.run_sync(lambda: image.compact(1, len(image.layers), layers))
            assert len(image.layers) == 2
            flat.write_bytes(ref)
            await run("qemu-img", "compare", "-f", "raw", "-F", "raw", server.uri, str(flat))
        assert image.pread(0, SIZE) == bytes(ref)
    finally:
        image.close()
