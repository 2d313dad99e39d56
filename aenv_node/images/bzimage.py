"""Extract the uncompressed ELF ``vmlinux`` from an x86 ``bzImage`` (``vmlinuz``).

Why this exists: Firecracker boots only an ELF kernel, while Debian ships its kernels only as ``bzImage``. The
Linux tree has ``scripts/extract-vmlinux``, but it is a shell script that greps for every known compression
magic and pipes each candidate through external decompressors; it is not installed with the kernel and it
guesses. The x86 boot protocol (>= 2.08) tells us exactly where the compressed payload is
(``payload_offset``/``payload_length`` in the setup header, relative to the start of the protected-mode
code), so we read those fields, identify the format by its magic and decompress in-process.

Debian's 6.1 cloud kernel is LZ4-compressed in the legacy LZ4 framing (``lz4 -l``), which neither the
standard library nor the ``lz4`` PyPI package (frame format only) decodes; the LZ4 *block* format is small
and fully specified, so a pure-Python block decoder lives here. The other formats the kernel can use map to
the standard library (gzip, xz, lzma, bzip2) or ``zstandard``.

The result is checked to be a 64-bit x86-64 ELF executable before it is returned.
"""

from __future__ import annotations

import bz2
import lzma
import struct
import zlib
from pathlib import Path

from .errors import KernelImageError

__all__ = ["extract_vmlinux", "extract_vmlinux_file", "lz4_block_decompress", "lz4_legacy_decompress"]

_SETUP_SECTS = 0x1F1
_HEADER_MAGIC = 0x202  # b"HdrS"
_VERSION = 0x206
_PAYLOAD = 0x248  # u32 payload_offset, u32 payload_length

_LZ4_LEGACY_MAGIC = b"\x02\x21\x4c\x18"
_LZ4_LEGACY_BLOCK = 8 << 20  # legacy frames decompress to at most 8 MiB per block

_ELF_MAGIC = b"\x7fELF"
_EM_X86_64 = 62


def lz4_block_decompress(src: bytes | memoryview, out: bytearray) -> None:
    """Decode one raw LZ4 block from ``src``, appending to ``out``.

    Matches may reach back into data already in ``out`` (legacy frames share no dictionary between blocks,
    but appending to one buffer is harmless and avoids copies).
    """
    src = bytes(src)
    n = len(src)
    i = 0
    block_start = len(out)
    while i < n:
        token = src[i]
        i += 1
        lit = token >> 4
        if lit == 15:
            while True:
                b = src[i]
                i += 1
                lit += b
                if b != 255:
                    break
        if lit:
            out += src[i : i + lit]
            i += lit
        if i >= n:  # the last sequence carries literals only
            break
        off = src[i] | (src[i + 1] << 8)
        i += 2
        ml = token & 15
        if ml == 15:
            while True:
                b = src[i]
                i += 1
                ml += b
                if b != 255:
                    break
        ml += 4
        start = len(out) - off
        if off == 0 or start < block_start:
            raise KernelImageError(f"corrupt LZ4 block: match offset {off} points before the block")
        if off >= ml:
            out += out[start : start + ml]
        else:  # overlapping match: the pattern of length `off` repeats
            pattern = bytes(out[start:])
            reps = ml // off + 1
            out += (pattern * reps)[:ml]


def lz4_legacy_decompress(data: bytes | memoryview) -> bytes:
    """Decode an LZ4 legacy-framed stream (as produced by ``lz4 -l``, used by the kernel build).

    Stops at the end of input or at trailing bytes too short to be a block (the kernel build appends the
    4-byte uncompressed size after the stream).
    """
    mv = memoryview(data)
    if bytes(mv[:4]) != _LZ4_LEGACY_MAGIC:
        raise KernelImageError("not an LZ4 legacy stream (bad magic)")
    i = 4
    out = bytearray()
    n = len(mv)
    while i + 4 <= n:
        (size,) = struct.unpack_from("<I", mv, i)
        if bytes(mv[i : i + 4]) == _LZ4_LEGACY_MAGIC:  # concatenated streams
            i += 4
            continue
        if size == 0 or i + 4 + size > n:
            break  # the appended uncompressed-size trailer, or padding
        i += 4
        lz4_block_decompress(mv[i : i + size], out)
        i += size
    return bytes(out)


def _decompress(payload: bytes) -> bytes:
    if payload.startswith(_LZ4_LEGACY_MAGIC):
        return lz4_legacy_decompress(payload)
    if payload.startswith(b"\x1f\x8b"):
        return zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(payload)
    if payload.startswith(b"\xfd7zXZ\x00"):
        return lzma.LZMADecompressor(format=lzma.FORMAT_XZ).decompress(payload)
    if payload.startswith(b"\x5d\x00\x00"):
        return lzma.LZMADecompressor(format=lzma.FORMAT_ALONE).decompress(payload)
    if payload.startswith(b"BZh"):
        return bz2.BZ2Decompressor().decompress(payload)
    if payload.startswith(b"\x28\xb5\x2f\xfd"):
        import zstandard  # a node dependency; imported lazily as only zstd kernels need it

        return zstandard.ZstdDecompressor().decompressobj().decompress(payload)
    raise KernelImageError(f"unsupported kernel compression (payload starts with {payload[:6].hex()})")


def _check_elf(image: bytes) -> None:
    if len(image) < 64 or image[:4] != _ELF_MAGIC:
        raise KernelImageError("decompressed kernel payload is not an ELF file")
    if image[4] != 2:
        raise KernelImageError("decompressed kernel is a 32-bit ELF; Firecracker needs a 64-bit vmlinux")
    (machine,) = struct.unpack_from("<H", image, 18)
    if machine != _EM_X86_64:
        raise KernelImageError(f"decompressed kernel is an ELF for machine {machine}, not x86-64")


def extract_vmlinux(bzimage: bytes) -> bytes:
    """Return the uncompressed ELF kernel inside ``bzimage`` (raises :class:`KernelImageError`)."""
    if len(bzimage) < 0x260 or bzimage[_HEADER_MAGIC : _HEADER_MAGIC + 4] != b"HdrS":
        raise KernelImageError("not an x86 bzImage (no 'HdrS' setup header)")
    (version,) = struct.unpack_from("<H", bzimage, _VERSION)
    if version < 0x208:
        raise KernelImageError(f"boot protocol {version:#x} predates payload_offset (needs >= 2.08)")
    setup_sects = bzimage[_SETUP_SECTS] or 4
    payload_offset, payload_length = struct.unpack_from("<II", bzimage, _PAYLOAD)
    start = (setup_sects + 1) * 512 + payload_offset
    end = start + payload_length
    if payload_length == 0 or end > len(bzimage):
        raise KernelImageError("bzImage payload fields point outside the file")
    image = _decompress(bzimage[start:end])
    _check_elf(image)
    return image


def extract_vmlinux_file(vmlinuz: Path, vmlinux: Path) -> None:
    """Extract ``vmlinuz`` into the ELF file ``vmlinux``."""
    vmlinux.write_bytes(extract_vmlinux(vmlinuz.read_bytes()))
