"""The FUSE frontend, really mounted: files compared with their devices, qemu-io/qemu-img on the exported file,
fallocate mapped to trim/write_zeroes, and unmount always leaving no mount behind."""

from __future__ import annotations

import ctypes
import errno
import os
import random
import stat
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
import trio

from aenv_node.storage import FlatFileDevice
from aenv_node.storage.frontends import FuseMountError
from aenv_node.storage.frontends.fuse import mount_fuse
from conftest import random_workload, DEVICE_SIZE, qemu_io, run

KiB = 1024
MiB = 1024 * 1024

_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


def fallocate(fd: int, mode: int, offset: int, length: int) -> None:
    if _libc.fallocate(fd, mode, offset, length) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def mounted(path) -> bool:  # type: ignore[no-untyped-def]
    real = os.path.realpath(path)
    with open("/proc/mounts") as f:
        return any(line.split()[1] == real for line in f)


class CountingDevice:
    def __init__(self, inner: FlatFileDevice) -> None:
        self.inner = inner
        self.size = inner.size
        self.flushes = 0
        self.trims: list[tuple[int, int]] = []
        self.zeroes: list[tuple[int, int]] = []
        self._lock = threading.Lock()

    def pread(self, offset: int, length: int) -> bytes:
        return self.inner.pread(offset, length)

    def pwrite(self, offset: int, data: bytes) -> None:
        self.inner.pwrite(offset, data)

    def trim(self, offset: int, length: int) -> None:
        self.trims.append((offset, length))
        self.inner.trim(offset, length)

    def write_zeroes(self, offset: int, length: int) -> None:
        self.zeroes.append((offset, length))
        self.inner.write_zeroes(offset, length)

    def flush(self) -> None:
        with self._lock:
            self.flushes += 1
        self.inner.flush()


@pytest.fixture
def mnt(tmp_path):  # type: ignore[no-untyped-def]
    d = tmp_path / "mnt"
    d.mkdir()
    yield d
    if mounted(d):  # clean up first, then fail
        _libc.umount2(os.fsencode(str(d)), 2)  # MNT_DETACH
        pytest.fail("a test left its FUSE mount behind")


async def test_files_mirror_devices(device: FlatFileDevice, tmp_path, mnt) -> None:  # type: ignore[no-untyped-def]
    content = os.urandom(DEVICE_SIZE)
    device.pwrite(0, content)
    other = FlatFileDevice(tmp_path / "b.img", 3 * MiB + 512)
    try:
        async with mount_fuse({"a.img": device, "b.img": other}, mnt) as fs:
            assert mounted(mnt)
            assert sorted(os.listdir(mnt)) == ["a.img", "b.img"]
            st = os.stat(fs.path("a.img"))
            assert stat.S_ISREG(st.st_mode) and st.st_size == DEVICE_SIZE and stat.S_IMODE(st.st_mode) == 0o600
            assert os.stat(fs.path("b.img")).st_size == 3 * MiB + 512
            with open(fs.path("a.img"), "rb") as f:
                assert f.read() == content  # sequential reads in 1 MiB requests
            fd = os.open(fs.path("a.img"), os.O_RDWR)
            try:
                rng = random.Random(5)
                for _ in range(200):  # random reads, unaligned too
                    off = rng.randrange(DEVICE_SIZE)
                    n = rng.randrange(1, 200000)
                    assert os.pread(fd, n, off) == content[off : off + n]
                assert os.pread(fd, 100, DEVICE_SIZE - 10) == content[-10:]  # short read at the end
                assert os.pread(fd, 100, DEVICE_SIZE) == b""
                os.pwrite(fd, b"hello fuse", 12345)
                assert device.pread(12345, 10) == b"hello fuse"
                with pytest.raises(OSError) as ei:  # the file cannot grow past its device
                    os.pwrite(fd, b"xx", DEVICE_SIZE - 1)
                assert ei.value.errno == errno.ENOSPC
                with pytest.raises(OSError) as ei:
                    os.ftruncate(fd, 4096)
                assert ei.value.errno == errno.EPERM
                assert os.fstat(fd).st_size == DEVICE_SIZE
            finally:
                os.close(fd)
            with pytest.raises(FileNotFoundError):
                os.stat(mnt / "nope.img")
            with pytest.raises(OSError):
                open(mnt / "new.img", "wb")
    finally:
        other.close()
    assert not mounted(mnt)


async def test_fsync_and_fallocate_reach_the_device(device: FlatFileDevice, mnt) -> None:  # type: ignore[no-untyped-def]
    dev = CountingDevice(device)
    device.pwrite(0, b"\xff" * 256 * KiB)
    async with mount_fuse({"d": dev}, mnt) as fs:
        fd = os.open(fs.path("d"), os.O_RDWR)
        try:
            os.pwrite(fd, b"x" * 4096, 0)
            os.fsync(fd)
            assert dev.flushes == 1
            fallocate(fd, 0x02 | 0x01, 64 * KiB, 32 * KiB)  # PUNCH_HOLE | KEEP_SIZE
            assert dev.trims == [(64 * KiB, 32 * KiB)]
            assert os.pread(fd, 32 * KiB, 64 * KiB) == bytes(32 * KiB)
            fallocate(fd, 0x10 | 0x01, 128 * KiB, 8 * KiB)  # ZERO_RANGE | KEEP_SIZE
            assert dev.zeroes == [(128 * KiB, 8 * KiB)]
            assert device.pread(128 * KiB, 8 * KiB) == bytes(8 * KiB)
            assert device.pread(136 * KiB, 4) == b"\xff" * 4
            fallocate(fd, 0, 0, 4096)  # plain allocation inside the file: nothing to do
            with pytest.raises(OSError) as ei:
                fallocate(fd, 0x08, 0, 4096)  # COLLAPSE_RANGE is not something a disk can do
            assert ei.value.errno == errno.EOPNOTSUPP
        finally:
            os.close(fd)


async def test_qemu_workload_on_the_fuse_file_matches_a_reference(device: FlatFileDevice, tmp_path, mnt) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(99)
    ref = bytearray(DEVICE_SIZE)
    cmds = random_workload(rng, ref, 120, [4096, 8192, 65536, 131072, 1 << 20], ops=["write", "write", "zero", "discard"], aligned=True)
    (tmp_path / "ref.img").write_bytes(ref)
    async with mount_fuse({"disk.raw": device}, mnt) as fs:
        path = str(fs.path("disk.raw"))
        await qemu_io(path, *cmds)
        await qemu_io(path, "read -P 0 0 0")  # open/close once more
        await run("qemu-io", "-f", "raw", "-t", "none", path, "-c", "read 0 64k")  # O_DIRECT open works
        await run("qemu-img", "compare", "-f", "raw", "-F", "raw", path, str(tmp_path / "ref.img"))
    assert device.pread(0, DEVICE_SIZE) == bytes(ref)


async def test_unmount_on_error_and_with_a_file_still_open(device: FlatFileDevice, mnt) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(RuntimeError, match="boom"):
        async with mount_fuse({"d": device}, mnt):
            assert mounted(mnt)
            raise RuntimeError("boom")
    assert not mounted(mnt)
    # a holder that never closes its file must not keep the exit from finishing
    with trio.fail_after(10):
        async with mount_fuse({"d": device}, mnt) as fs:
            fd = os.open(fs.path("d"), os.O_RDWR)
            assert os.pread(fd, 4, 0) == bytes(4)
    try:
        assert not mounted(mnt)
        with pytest.raises(OSError) as ei:  # the connection is aborted: I/O fails instead of hanging
            os.pread(fd, 4, 0)
        assert ei.value.errno in (errno.ENOTCONN, errno.EIO, errno.ENODEV)
    finally:
        try:
            os.close(fd)  # the descriptor is released even though the FLUSH on close fails (ENOTCONN)
        except OSError:
            pass


async def test_cancelling_the_owner_unmounts(device: FlatFileDevice, mnt) -> None:  # type: ignore[no-untyped-def]
    with trio.move_on_after(0.3) as scope:
        async with mount_fuse({"d": device}, mnt):
            assert mounted(mnt)
            await trio.sleep_forever()
    assert scope.cancelled_caught
    assert not mounted(mnt)


async def test_add_and_remove_exports(device: FlatFileDevice, tmp_path, mnt) -> None:  # type: ignore[no-untyped-def]
    second = FlatFileDevice(tmp_path / "2.img", MiB)
    second.pwrite(0, b"second")
    try:
        async with mount_fuse({}, mnt) as fs:
            assert os.listdir(mnt) == []
            fs.add("one", device)
            fs.add("two", second)
            with pytest.raises(ValueError):
                fs.add("two", device)
            with pytest.raises(ValueError):
                fs.add("a/b", device)
            assert sorted(os.listdir(mnt)) == ["one", "two"]
            with open(fs.path("two"), "rb") as f:
                fs.remove("two")  # an open file keeps working
                assert f.read(6) == b"second"
            assert os.listdir(mnt) == ["one"]
            assert fs.names == ["one"]
    finally:
        second.close()


async def test_mount_errors_are_typed(device: FlatFileDevice, tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(FuseMountError, match="not a directory"):
        async with mount_fuse({"d": device}, tmp_path / "missing"):
            pass
    d = tmp_path / "busy"
    d.mkdir()
    async with mount_fuse({"d": device}, d):
        with pytest.raises(FuseMountError, match="already has"):
            async with mount_fuse({"d": device}, d):
                pass
        assert mounted(d)
    assert not mounted(d)


_CHILD = """
import sys, trio
from aenv_node.storage import FlatFileDevice
from aenv_node.storage.frontends.fuse import mount_fuse
async def main():
    dev = FlatFileDevice(sys.argv[1], 1 << 20)
    async with mount_fuse({"d": dev}, sys.argv[2]):
        print("ready", flush=True)
        await trio.sleep_forever()
trio.run(main)
"""


async def test_a_mount_left_by_a_killed_process_is_replaced(device: FlatFileDevice, tmp_path, mnt) -> None:  # type: ignore[no-untyped-def]
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(tmp_path / "c.img"), str(mnt)],
                             stdout=subprocess.PIPE, cwd=os.path.dirname(os.path.dirname(os.path.dirname(
                                 os.path.dirname(os.path.abspath(__file__))))))
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == b"ready"
        assert mounted(mnt)
    finally:
        child.kill()  # SIGKILL by PID: no cleanup runs in the child
        child.wait()
    assert mounted(mnt)
    with pytest.raises(OSError) as ei:
        os.listdir(mnt)
    assert ei.value.errno == errno.ENOTCONN
    async with mount_fuse({"d": device}, mnt) as fs:
        assert os.stat(fs.path("d")).st_size == DEVICE_SIZE


async def test_read_only_device(device: FlatFileDevice, tmp_path, mnt) -> None:  # type: ignore[no-untyped-def]
    device.pwrite(0, b"base")
    ro = FlatFileDevice(device.path, read_only=True)
    try:
        async with mount_fuse({"ro": ro}, mnt) as fs:
            fd = os.open(fs.path("ro"), os.O_RDWR)
            try:
                assert os.pread(fd, 4, 0) == b"base"
                with pytest.raises(OSError) as ei:
                    os.pwrite(fd, b"x", 0)
                assert ei.value.errno == errno.EROFS
            finally:
                os.close(fd)
    finally:
        ro.close()


_FUSE_OPCODES = [1, 2, 3, 4, 14, 15, 16, 17, 18, 20, 22, 23, 25, 26, 27, 28, 29, 30, 34, 36, 38, 42, 43, 99, 4096]
_NO_REPLY = {2, 36, 42}  # FORGET, INTERRUPT, BATCH_FORGET


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(requests=st.lists(st.tuples(st.sampled_from(_FUSE_OPCODES), st.integers(0, 2**64 - 1),
                                   st.binary(max_size=160)), min_size=1, max_size=20),
       fh=st.sampled_from([0, 1, 2, 2**64 - 1]))
def test_fuzzed_requests_get_one_reply_each_and_touch_nothing(requests, fh, device: FlatFileDevice,  # type: ignore[no-untyped-def]
                                                               tmp_path, caplog) -> None:
    """Requests with any opcode, node id and body (too short, too long, random fields; a file handle that is
    open or not, offsets and sizes out of range) as the kernel would frame them: each gets exactly one reply
    with its own id (none for FORGET and INTERRUPT, as the protocol says), an error or a well-formed answer,
    and nothing is written to the read-only device; no request ends in an unexpected exception."""
    import socket as sk

    from aenv_node.storage.frontends import fuse_protocol as F
    from aenv_node.storage.frontends.fuse import FuseExport

    caplog.clear()  # one fixture for every example
    before = device.pread(0, DEVICE_SIZE)
    fs = FuseExport({"disk": device}, tmp_path / "never-mounted")
    handle = fs._handles.setdefault(1, fs._by_name["disk"])  # file handle 1 open, as after an OPEN
    assert handle is fs._by_name["disk"]
    ours, theirs = sk.socketpair(sk.AF_UNIX, sk.SOCK_SEQPACKET)  # one message per reply, as /dev/fuse
    device.read_only = True
    try:
        for unique, (opcode, nodeid, body) in enumerate(requests, start=1):
            if opcode in (F.READ, F.WRITE) and len(body) >= 8:
                body = fh.to_bytes(8, "little") + body[8:]  # mostly a known handle, else any
            msg = bytearray(F.IN_HEADER.pack(F.IN_HEADER.size + len(body), opcode, unique, nodeid % 4, 0, 0, 0, 0,
                                             0) + body)
            msg += bytes(4096)  # the buffer the server reads into is larger than the request
            with caplog.at_level("ERROR"):
                fs._dispatch(ours.fileno(), memoryview(msg), F.IN_HEADER.size + len(body))
            theirs.setblocking(False)
            replies = []
            while True:
                try:
                    replies.append(theirs.recv(1 << 20))
                except BlockingIOError:
                    break
            if opcode in _NO_REPLY:
                assert replies == [], opcode
                continue
            assert len(replies) == 1, (opcode, replies)
            length, err, got = F.OUT_HEADER.unpack_from(replies[0])
            assert got == unique and length == len(replies[0]) and err <= 0, (opcode, length, err)
        # an INIT from a kernel whose protocol is not ours is refused and logged as an error; what must not
        # happen is a request ending in an exception nobody expected (logged with its traceback)
        unexpected = [r.getMessage() for r in caplog.records if r.exc_info]
        assert not unexpected, unexpected
    finally:
        device.read_only = False
        ours.close()
        theirs.close()
    assert device.pread(0, DEVICE_SIZE) == before
