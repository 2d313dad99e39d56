"""The reference FlatFileDevice and the Image both satisfy the BlockDevice contract."""

from __future__ import annotations

from pathlib import Path

import pytest

from aenv_node.storage import BlockDevice, FlatFileDevice, Image, OutOfRange


@pytest.fixture(params=["flat", "image"])
def dev(request: pytest.FixtureRequest, tmp_path: Path):  # type: ignore[no-untyped-def]
    size = 64 * 4096
    d = FlatFileDevice(tmp_path / "f", size) if request.param == "flat" else Image.open([], tmp_path / "u", size=size)
    yield d
    d.close()


def test_contract(dev: BlockDevice) -> None:
    assert isinstance(dev, BlockDevice)
    assert dev.pread(0, 4096 * 64) == bytes(4096 * 64)
    dev.pwrite(4000, b"hello world" * 100)
    assert dev.pread(4000, 1100) == b"hello world" * 100
    dev.trim(4096, 4096)
    assert dev.pread(4096, 4096) == bytes(4096)
    assert dev.pread(4000, 96) == (b"hello world" * 100)[:96]
    dev.write_zeroes(4000, 10)
    assert dev.pread(3990, 30) == bytes(20) + (b"hello world" * 100)[10:20]
    dev.flush()
    with pytest.raises(OutOfRange):
        dev.pread(64 * 4096 - 1, 2)
    with pytest.raises(OutOfRange):
        dev.pwrite(64 * 4096, b"x")
    assert dev.pread(64 * 4096, 0) == b""
