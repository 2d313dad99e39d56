"""The ctypes io_uring ring that drives ublk, exercised on this host (io_uring works here; ublk does not)."""

from __future__ import annotations

import ctypes
import mmap
import os
import time

from aenv_node.storage.frontends.io_uring import OP_NOP, OP_READ, OP_WRITE, Ring


def _addr(buf: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def test_nops_wrap_around_the_ring_many_times() -> None:
    with Ring(8, sqe128=True) as ring:
        seen = []
        for batch in range(50):  # 50 x 5 entries through an 8-entry ring
            for i in range(5):
                ring.prep(OP_NOP, -1, user_data=batch * 5 + i, cmd=bytes([i]) * 80)
            assert ring.submit(wait=5) == 5
            got = list(ring.completions())
            assert all(res == 0 for _, res, _ in got)
            seen += [ud for ud, _, _ in got]
        assert sorted(seen) == list(range(250))


def test_read_and_write_a_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "f"
    data = os.urandom(8192)
    path.write_bytes(data)
    fd = os.open(path, os.O_RDWR)
    buf = mmap.mmap(-1, 8192)
    try:
        with Ring(4) as ring:
            ring.prep(OP_READ, fd, off=4096, addr=_addr(buf), length=4096, user_data=1)
            ring.submit(wait=1)
            assert list(ring.completions()) == [(1, 4096, 0)]
            assert buf[:4096] == data[4096:]
            buf[:100] = b"z" * 100
            ring.prep(OP_WRITE, fd, off=0, addr=_addr(buf), length=100, user_data=2)
            ring.submit(wait=1)
            assert list(ring.completions()) == [(2, 100, 0)]
        assert os.pread(fd, 101, 0) == b"z" * 100 + data[100:101]
    finally:
        os.close(fd)


def test_wait_with_timeout_returns_without_completions() -> None:
    with Ring(2) as ring:
        t = time.monotonic()
        assert ring.submit(wait=1, timeout=0.1) == 0
        assert 0.05 < time.monotonic() - t < 5
        assert list(ring.completions()) == []


def test_each_completion_is_reaped_exactly_once() -> None:
    """Taking only the first completion must not leave it in the ring for the next command (the control path
    waits for one command at a time; a stale entry made START_DEV look finished before it was)."""
    with Ring(4) as ring:
        for i in range(20):
            ring.prep(OP_NOP, -1, user_data=i)
            ring.submit(wait=1)
            assert ring.completions()[0][0] == i
        assert ring.completions() == []
