"""Crash safety with a real kill -9: a child process writes, flushes and seals; everything a flush acknowledged
survives (reopened from the stack the upper recorded); unflushed writes read as either the old or the new
data; a torn log tail is ignored, a damaged log is refused."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from aenv_node.storage.image import Image
from aenv_node.storage.upper import Upper

BLOCK = 4096
NBLOCKS = 2048
SIZE = NBLOCKS * BLOCK

CHILD = textwrap.dedent(
    """
    import random, sys
    sys.path.insert(0, {root!r})
    from aenv_node.storage.image import Image
    img = Image.open([], {upper!r}, size={size})
    order = list(range({nblocks}))
    random.Random(5).shuffle(order)
    for i, b in enumerate(order):
        data = random.Random(b).randbytes({block})
        if i % 3 == 0:  # unaligned write straddling two blocks
            img.pwrite(b * {block} + 100, data[:200])
        else:
            img.pwrite(b * {block}, data)
        if i % 7 == 6:
            img.flush()
            print(i, flush=True)
        if i % 97 == 96:  # seals too: the kill may land in one
            img.seal({layers!r})
            print(i, flush=True)
    print("done", flush=True)
    import time; time.sleep(60)
    """
)


def _expected(i: int, b: int) -> bytes:
    data = random.Random(b).randbytes(BLOCK)
    if i % 3 == 0:
        out = bytearray(BLOCK)
        out[100:300] = data[:200]
        return bytes(out)
    return data


def test_kill9_keeps_flushed_writes(tmp_path: Path) -> None:
    upper = tmp_path / "upper"
    layers = tmp_path / "layers"
    layers.mkdir()
    root = str(Path(__file__).resolve().parents[2])
    code = CHILD.format(root=root, upper=str(upper), layers=str(layers), size=SIZE, nblocks=NBLOCKS, block=BLOCK)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    acked = -1
    try:
        for line in proc.stdout:  # type: ignore[union-attr]
            line = line.strip()
            if line == "done":
                break
            acked = int(line)
            if acked >= 600:
                break
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()  # type: ignore[union-attr]
    assert acked >= 6
    order = list(range(NBLOCKS))
    random.Random(5).shuffle(order)
    with Image.reopen(upper, layers) as img:
        assert len(img.layers) >= acked // 97 - 1
        for i, b in enumerate(order):
            got = img.pread(b * BLOCK, BLOCK)
            if i <= acked:
                assert got == _expected(i, b), f"write {i} (block {b}) acknowledged by a flush was lost"
            else:
                assert got in (bytes(BLOCK), _expected(i, b)), f"block {b} holds data never written to it"


def test_torn_log_tail_ignored(tmp_path: Path) -> None:
    up = Upper(tmp_path / "u", 64 * BLOCK)
    up.write_blocks(1, b"a" * BLOCK)
    up.write_blocks(5, b"b" * 2 * BLOCK)
    up.flush()
    up.zero_blocks(1, 1)
    up.flush()
    up.close()
    log = tmp_path / "u" / "log.0"
    size = log.stat().st_size
    with open(log, "ab") as f:  # half a record, as if the process died mid-append
        f.write(b"\x01" * 17)
    up = Upper(tmp_path / "u", 64 * BLOCK)
    assert [(vb, n) for vb, n, _ in up.all_runs()] == [(1, 1), (5, 2)]
    assert log.stat().st_size == size  # the torn tail was cut off
    # and a damaged last record is dropped, earlier ones kept
    up.close()
    with open(log, "r+b") as f:
        f.seek(size - 5)
        f.write(b"\xff")
    up = Upper(tmp_path / "u", 64 * BLOCK)
    runs = list(up.all_runs())
    assert [(vb, n) for vb, n, _ in runs] == [(1, 1), (5, 2)] and runs[0][2] >= 0  # the zeroing was lost
    assert up.read_pblocks(runs[0][2], 0, BLOCK) == b"a" * BLOCK
    up.close()


def test_unflushed_allocations_are_lost_not_garbage(tmp_path: Path) -> None:
    up = Upper(tmp_path / "u", 64 * BLOCK)
    up.write_blocks(3, b"x" * BLOCK)
    up.abandon()  # no flush
    up = Upper(tmp_path / "u", 64 * BLOCK)
    assert list(up.all_runs()) == []
    up.write_blocks(4, b"y" * BLOCK)  # must not reuse the physical block of the lost write... nor break
    up.flush()
    up.close()
    up = Upper(tmp_path / "u", 64 * BLOCK)
    (vb, n, pb), = up.all_runs()
    assert (vb, n) == (4, 1) and up.read_pblocks(pb, 0, BLOCK) == b"y" * BLOCK
    bitmap = up.dirty_bitmap()
    assert bitmap[0] == 0b10000 and not bitmap[1:].any()
    up.close()


def test_seal_interrupted_before_reset_keeps_upper(tmp_path: Path) -> None:
    """A crash after the layer file was written but before the upper was reset leaves a usable upper."""
    from aenv_node.storage.seal import seal_upper

    layers = tmp_path / "layers"
    layers.mkdir()
    img = Image.open([], tmp_path / "u", size=64 * BLOCK)
    img.pwrite(0, b"q" * 3 * BLOCK)
    info = seal_upper(img.upper, layers)  # no reset: as if killed right after
    img.abandon()
    with Image.open([], tmp_path / "u", size=64 * BLOCK) as img2:
        assert img2.pread(0, 3 * BLOCK) == b"q" * 3 * BLOCK
        img2.pwrite(10 * BLOCK, b"r" * BLOCK)  # allocations go past the appended index
        assert img2.pread(10 * BLOCK, BLOCK) == b"r" * BLOCK
        info2 = img2.seal(layers)
    with Image.open([info2.path], None) as ro:
        assert ro.pread(0, 3 * BLOCK) == b"q" * 3 * BLOCK and ro.pread(10 * BLOCK, BLOCK) == b"r" * BLOCK
    with Image.open([info.path], None) as ro:
        assert ro.pread(0, 4 * BLOCK) == b"q" * 3 * BLOCK + bytes(BLOCK)


def test_damaged_record_before_a_commit_is_an_error(tmp_path: Path) -> None:
    from aenv_node.storage import UpperCorrupt

    up = Upper(tmp_path / "u", 64 * BLOCK)
    up.write_blocks(1, b"a" * BLOCK)
    up.flush()
    up.write_blocks(2, b"b" * BLOCK)
    up.flush()
    up.close()
    log = tmp_path / "u" / "log.0"
    with open(log, "r+b") as f:
        f.seek(64 + 3)  # inside the first record, acknowledged by the first flush
        f.write(b"\xee")
    with pytest.raises(UpperCorrupt, match="damaged record"):
        Upper(tmp_path / "u", 64 * BLOCK)


def test_flush_without_commit_record_is_dropped(tmp_path: Path) -> None:
    """Records of a flush whose commit record never reached the disk are a torn tail."""
    up = Upper(tmp_path / "u", 64 * BLOCK)
    up.write_blocks(1, b"a" * BLOCK)
    up.flush()
    up.write_blocks(7, b"c" * BLOCK)
    up.flush()
    up.close()
    log = tmp_path / "u" / "log.0"
    size = log.stat().st_size
    os.truncate(log, size - 32)  # the last commit record is missing
    up = Upper(tmp_path / "u", 64 * BLOCK)
    assert [(vb, n) for vb, n, _ in up.all_runs()] == [(1, 1)]
    assert log.stat().st_size == size - 64
    up.close()
