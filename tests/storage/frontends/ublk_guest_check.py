"""Runs INSIDE a QEMU TCG guest whose kernel has ublk_drv (started by test_ublk_guest.py).

Serves a FlatFileDevice through serve_ublk and drives /dev/ublkbN with ordinary block-device I/O: buffered
writes + fsync, O_DIRECT reads, BLKDISCARD, BLKZEROOUT, comparing every result with the backing device.
Then the isolation check: two devices served at once, one of them stopped from outside (STOP_DEV through a
control ring of its own, as an operator's ``ublk del`` or a crashed server's cleanup would): its ``serve_ublk``
must end with ``UblkError`` within seconds, and the other must go on serving verified I/O.
Prints ``UBLK-CHECK-OK`` and ``UBLK-ISOLATION-OK`` on success; any failure raises (the host test sees the
traceback on the console).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import random
import struct
import sys
import time

sys.path.insert(0, "/src")

import trio  # noqa: E402

from aenv_node.storage.blockdev import FlatFileDevice  # noqa: E402
from aenv_node.storage.frontends.errors import UblkError  # noqa: E402
from aenv_node.storage.frontends.ublk import serve_ublk, stop_device  # noqa: E402

BLKGETSIZE64 = 0x80081272
BLKDISCARD = 0x1277
BLKZEROOUT = 0x127F
MiB = 1 << 20
SIZE = 32 * MiB


def exercise(path: str, dev: FlatFileDevice) -> dict:
    rng = random.Random(7)
    out = {}
    fd = os.open(path, os.O_RDWR)
    try:
        size = struct.unpack("<Q", fcntl.ioctl(fd, BLKGETSIZE64, b"\0" * 8))[0]
        assert size == SIZE, size
        # the device starts with known contents written behind ublk's back, before the disk existed
        expect = bytearray(dev.pread(0, SIZE))
        for _ in range(64):
            off = rng.randrange(SIZE // 4096 - 64) * 4096
            data = os.urandom(rng.choice([4096, 65536, 256 * 1024]))
            os.pwrite(fd, data, off)
            expect[off : off + len(data)] = data
        t = time.monotonic()
        os.fsync(fd)
        out["fsync_s"] = round(time.monotonic() - t, 3)
        assert dev.pread(0, SIZE) == bytes(expect), "backing device differs after fsync"
        # discard and write-zeroes reach trim / write_zeroes
        fcntl.ioctl(fd, BLKDISCARD, struct.pack("<QQ", 1 * MiB, 1 * MiB))
        fcntl.ioctl(fd, BLKZEROOUT, struct.pack("<QQ", 3 * MiB, 512 * 1024))
        expect[1 * MiB : 2 * MiB] = bytes(MiB)
        expect[3 * MiB : 3 * MiB + 512 * 1024] = bytes(512 * 1024)
        assert dev.pread(MiB, MiB) == bytes(MiB), "discard did not zero the range"
        assert dev.pread(3 * MiB, 512 * 1024) == bytes(512 * 1024), "write-zeroes did not zero the range"
    finally:
        os.close(fd)
    # O_DIRECT reads of the whole disk (bypassing the guest page cache) equal the device
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        buf = mmap.mmap(-1, MiB)
        t = time.monotonic()
        for off in range(0, SIZE, MiB):
            n = os.preadv(fd, [buf], off)
            assert n == MiB
            assert buf[:] == expect[off : off + MiB], f"O_DIRECT read differs at {off}"
        out["direct_read_MiB_s"] = round(SIZE / MiB / (time.monotonic() - t), 1)
    finally:
        os.close(fd)
    return out


async def main() -> None:
    os.makedirs("/tmp/u", exist_ok=True)
    dev = FlatFileDevice("/tmp/u/backing.img", SIZE)
    dev.pwrite(0, os.urandom(SIZE))
    async with serve_ublk(dev, queues=2, queue_depth=32) as srv:
        path = srv.block_path
        print("ublk device", path, "char", srv.char_path, flush=True)
        # one blk-mq hardware context per queue we serve
        hctx = os.listdir(f"/sys/block/{os.path.basename(path)}/mq")
        assert len(hctx) == 2, f"the disk has {len(hctx)} hardware queues, not 2: {hctx}"
        result = await trio.to_thread.run_sync(exercise, path, dev)
        per_queue = list(srv._ios)  # which queue serves depends on the CPU that submitted: not asserted
    for _ in range(500):  # the node goes away with the disk (devtmpfs may lag a moment)
        if not os.path.exists(path):
            break
        time.sleep(0.01)
    assert not os.path.exists(path), f"{path} still exists after the server stopped"
    print(f"UBLK-CHECK-OK ios={srv.ios} per_queue={per_queue} {result}", flush=True)


def stop_from_outside(dev_id: int) -> None:
    """STOP_DEV for ``dev_id`` through a control ring of our own (not the server's)."""
    try:
        stop_device(dev_id)
    except UblkError as exc:  # not the server's ending the check waits for: say so plainly
        raise AssertionError(f"STOP_DEV from outside failed: {exc}") from exc


def roundtrip(path: str, dev: FlatFileDevice, seed: int) -> None:
    """Write 1 MiB through the disk, fsync, read it back with O_DIRECT; the backing device must hold it."""
    data = random.Random(seed).randbytes(MiB)
    off = 4 * MiB
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, data, off)
        os.fsync(fd)
    finally:
        os.close(fd)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        buf = mmap.mmap(-1, MiB)
        assert os.preadv(fd, [buf], off) == MiB and buf[:] == data, f"{path}: read back differs"
    finally:
        os.close(fd)
    assert dev.pread(off, MiB) == data, f"{path}: the backing device differs"


async def isolation() -> None:
    a_dev = FlatFileDevice("/tmp/u/a.img", 16 * MiB)
    b_dev = FlatFileDevice("/tmp/u/b.img", 16 * MiB)
    ended: BaseException | None = None
    async with serve_ublk(b_dev, queues=2, queue_depth=16) as b:
        a_path = ""
        t = time.monotonic()
        try:
            async with serve_ublk(a_dev, queues=2, queue_depth=16) as a:
                a_path = a.block_path
                await trio.to_thread.run_sync(roundtrip, a.block_path, a_dev, 1)
                await trio.to_thread.run_sync(roundtrip, b.block_path, b_dev, 2)
                await trio.to_thread.run_sync(stop_from_outside, a.dev_id)
                t = time.monotonic()
                with trio.fail_after(30):  # the dead disk must end its server's body, not leave it waiting
                    await trio.sleep_forever()
        except BaseException as exc:  # noqa: BLE001 - inspected below
            ended = exc
        errors = list(ended.exceptions) if isinstance(ended, BaseExceptionGroup) else [ended]
        assert errors and all(isinstance(e, UblkError) for e in errors), f"ended with {ended!r}"
        assert "ended under its server" in str(errors[0]), errors[0]
        took = time.monotonic() - t
        # the other device is untouched
        await trio.to_thread.run_sync(roundtrip, b.block_path, b_dev, 3)
        assert os.path.exists(b.block_path)
    for _ in range(500):
        if not os.path.exists(a_path):
            break
        time.sleep(0.01)
    assert not os.path.exists(a_path), f"{a_path} still exists"
    print(f"UBLK-ISOLATION-OK ended in {took:.2f}s: {errors[0]}", flush=True)


def diagnostics() -> None:
    print("diag /dev:", sorted(n for n in os.listdir("/dev") if "ublk" in n), flush=True)
    print("diag /sys/block:", sorted(os.listdir("/sys/block")), flush=True)
    print("diag /proc/partitions:", open("/proc/partitions").read(), flush=True)


if __name__ == "__main__":
    try:
        trio.run(main)
        trio.run(isolation)
    except BaseException:
        diagnostics()
        raise
