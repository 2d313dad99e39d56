from __future__ import annotations

import random
from typing import Sequence

import os
import shutil
import subprocess
import tempfile
from collections.abc import AsyncIterator, Iterator

import pytest
import trio

from aenv_node.storage import FlatFileDevice
from aenv_node.storage.frontends import NbdServer, serve_nbd

DEVICE_SIZE = 16 * 1024 * 1024


@pytest.fixture
def short_dir() -> Iterator[str]:
    """A short directory for unix sockets (sun_path is limited to 108 bytes; pytest's tmp_path can be longer)."""
    d = tempfile.mkdtemp(prefix="aenv-fe-", dir="/tmp")
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def device(tmp_path) -> Iterator[FlatFileDevice]:  # type: ignore[no-untyped-def]
    dev = FlatFileDevice(tmp_path / "disk.img", DEVICE_SIZE)
    try:
        yield dev
    finally:
        dev.close()


@pytest.fixture
async def nbd(device: FlatFileDevice, short_dir: str) -> AsyncIterator[NbdServer]:
    async with serve_nbd(device, os.path.join(short_dir, "nbd.sock")) as server:
        yield server


async def run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[bytes]:
    """Run a tool (qemu-io, qemu-img, fio) to completion; on failure the assertion shows its output."""
    proc = await trio.run_process(list(argv), capture_stdout=True, capture_stderr=True, check=False)
    if check:
        assert proc.returncode == 0, (argv, proc.stdout.decode(), proc.stderr.decode())
    return proc


async def qemu_io(uri: str, *cmds: str, check: bool = True) -> str:
    argv = ["qemu-io", "-f", "raw", uri]
    for c in cmds:
        argv += ["-c", c]
    proc = await run(*argv, check=check)
    out = proc.stdout.decode() + proc.stderr.decode()
    if check:
        assert "failed" not in out, out
    return out


def random_workload(rng: "random.Random", ref: bytearray, count: int, lengths: "Sequence[int]", *,
                    ops: "Sequence[str]" = ("write", "write", "write", "zero", "discard"),
                    aligned: bool = False) -> list[str]:
    """qemu-io commands for random pattern writes, zero writes and discards, applied to ``ref`` as well
    (the reference a served disk must equal afterwards); ends with a flush."""
    size = len(ref)
    cmds = []
    for _ in range(count):
        op = rng.choice(list(ops))
        length = rng.choice(list(lengths))
        offset = (rng.randrange(0, (size - length) // 4096) * 4096 if aligned
                  else rng.randrange(0, size - length))
        if op == "write":
            pat = rng.randrange(1, 256)
            cmds.append(f"write -P {pat} {offset} {length}")
            ref[offset : offset + length] = bytes([pat]) * length
        elif op == "zero":
            cmds.append(f"write -z {offset} {length}")
            ref[offset : offset + length] = bytes(length)
        else:
            cmds.append(f"discard {offset} {length}")
            ref[offset : offset + length] = bytes(length)
    cmds.append("flush")
    return cmds
