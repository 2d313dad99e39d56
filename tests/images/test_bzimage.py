"""The vmlinux extractor: synthetic bzImages in every compression we decode, the LZ4 block decoder against the
reference ``lz4`` tool, and the real Debian kernel of the kit (compared with ``lz4 -d``)."""

from __future__ import annotations

import gzip
import lzma
import shutil
import struct
import subprocess

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aenv_node.images.bzimage import extract_vmlinux, lz4_legacy_decompress
from aenv_node.images.errors import KernelImageError

LZ4 = shutil.which("lz4")


def fake_elf(body: bytes = b"kernel text " * 100) -> bytes:
    header = bytearray(64)
    header[:4] = b"\x7fELF"
    header[4] = 2  # ELFCLASS64
    header[5] = 1  # little endian
    struct.pack_into("<H", header, 18, 62)  # EM_X86_64
    return bytes(header) + body


def fake_bzimage(payload: bytes, setup_sects: int = 3, version: int = 0x20F) -> bytes:
    setup = bytearray((setup_sects + 1) * 512)
    setup[0x1F1] = setup_sects
    setup[0x202:0x206] = b"HdrS"
    struct.pack_into("<H", setup, 0x206, version)
    pm_code = b"\x90" * 300  # decompressor code before the payload
    struct.pack_into("<II", setup, 0x248, len(pm_code), len(payload))
    return bytes(setup) + pm_code + payload + b"\0" * 64


def lz4_legacy(data: bytes) -> bytes:
    assert LZ4 is not None
    out = subprocess.run([LZ4, "-l", "-c", "-9"], input=data, capture_output=True, check=True).stdout
    return out + struct.pack("<I", len(data))  # the kernel build appends the uncompressed size


def test_gzip_and_xz_payloads() -> None:
    elf = fake_elf()
    assert extract_vmlinux(fake_bzimage(gzip.compress(elf))) == elf
    assert extract_vmlinux(fake_bzimage(lzma.compress(elf, format=lzma.FORMAT_XZ))) == elf


def test_zstd_payload_with_appended_size() -> None:
    zstandard = pytest.importorskip("zstandard")
    elf = fake_elf(bytes(range(256)) * 50)
    payload = zstandard.ZstdCompressor().compress(elf) + struct.pack("<I", len(elf))
    assert extract_vmlinux(fake_bzimage(payload)) == elf


@pytest.mark.skipif(LZ4 is None, reason="lz4 tool not installed (apt: lz4)")
def test_lz4_legacy_payload_spanning_several_blocks() -> None:
    # > 8 MiB so the legacy framing splits it into several blocks; repetitive and random parts mixed.
    body = (b"abcabcabc" * 400_000) + bytes(range(256)) * 20_000 + b"\0" * 1_000_000
    elf = fake_elf(body)
    assert extract_vmlinux(fake_bzimage(lz4_legacy(elf))) == elf


@pytest.mark.skipif(LZ4 is None, reason="lz4 tool not installed (apt: lz4)")
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(st.binary(max_size=300), st.builds(lambda b, n: b * n, st.binary(min_size=1, max_size=7),
                                                               st.integers(1, 500))), max_size=30))
def test_lz4_decoder_matches_reference_tool(parts: list[bytes]) -> None:
    data = b"".join(parts)
    stream = subprocess.run([LZ4, "-l", "-c"], input=data, capture_output=True, check=True).stdout
    assert lz4_legacy_decompress(stream) == data


def test_rejects_what_is_not_a_bzimage() -> None:
    with pytest.raises(KernelImageError, match="HdrS"):
        extract_vmlinux(b"\0" * 4096)
    with pytest.raises(KernelImageError, match="2.08"):
        extract_vmlinux(fake_bzimage(gzip.compress(fake_elf()), version=0x206))
    with pytest.raises(KernelImageError, match="compression"):
        extract_vmlinux(fake_bzimage(b"\x11\x22\x33\x44 not compressed"))


def test_rejects_payload_that_is_not_a_64bit_x86_elf() -> None:
    with pytest.raises(KernelImageError, match="not an ELF"):
        extract_vmlinux(fake_bzimage(gzip.compress(b"plain data" * 10)))
    elf32 = bytearray(fake_elf())
    elf32[4] = 1
    with pytest.raises(KernelImageError, match="32-bit"):
        extract_vmlinux(fake_bzimage(gzip.compress(bytes(elf32))))
