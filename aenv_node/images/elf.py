"""Just enough ELF reading for the guest kit: section contents, DT_NEEDED entries, kernel-module info.

Why hand-written: the kit build needs two facts from ELF files, the shared libraries a binary links
(``DT_NEEDED``, to copy a closed set of libraries next to the bundled Python) and the ``depends=`` entry of a
kernel module's ``.modinfo`` section (to load modules in dependency order from a busybox initramfs that has
no ``modprobe``/``depmod`` data). ``ldd`` executes the binary's interpreter (the host's, not the bundled one)
and ``modinfo``/``readelf`` are extra host tools; parsing 64-bit little-endian ELF headers is ~50 lines.
"""

from __future__ import annotations

import struct
from pathlib import Path

__all__ = ["is_elf", "module_info", "needed_libraries", "soname"]

_DT_NEEDED = 1
_DT_SONAME = 14
_SHT_DYNAMIC = 6


def is_elf(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            return f.read(4) == b"\x7fELF"
    except OSError:
        return False


def _sections(data: bytes) -> list[tuple[str, int, int, int, int]]:
    """(name, type, offset, size, link) of every section of a 64-bit little-endian ELF."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF file")
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    raw = []
    for i in range(shnum):
        base = shoff + i * shentsize
        name, stype, _flags, _addr, offset, size, link = struct.unpack_from("<IIQQQQI", data, base)
        raw.append((name, stype, offset, size, link))
    if not raw:
        return []
    str_off, str_size = raw[shstrndx][2], raw[shstrndx][3]
    strtab = data[str_off : str_off + str_size]
    out = []
    for name, stype, offset, size, link in raw:
        end = strtab.find(b"\0", name)
        out.append((strtab[name:end].decode(), stype, offset, size, link))
    return out


def _dynamic_strings(data: bytes, tag: int) -> list[str]:
    secs = _sections(data)
    found: list[str] = []
    for _name, stype, offset, size, link in secs:
        if stype != _SHT_DYNAMIC:
            continue
        str_off, str_size = secs[link][2], secs[link][3]
        strtab = data[str_off : str_off + str_size]
        for pos in range(offset, offset + size, 16):
            d_tag, d_val = struct.unpack_from("<qQ", data, pos)
            if d_tag == 0:
                break
            if d_tag == tag:
                end = strtab.find(b"\0", d_val)
                found.append(strtab[d_val:end].decode())
    return found


def needed_libraries(path: Path) -> list[str]:
    """The ``DT_NEEDED`` sonames of an ELF file (empty for static executables)."""
    return _dynamic_strings(path.read_bytes(), _DT_NEEDED)


def soname(path: Path) -> str | None:
    names = _dynamic_strings(path.read_bytes(), _DT_SONAME)
    return names[0] if names else None


def module_info(path: Path) -> dict[str, str]:
    """The ``key=value`` pairs of a kernel module's ``.modinfo`` section (first value per key)."""
    data = path.read_bytes()
    for name, _stype, offset, size, _link in _sections(data):
        if name == ".modinfo":
            info: dict[str, str] = {}
            for entry in data[offset : offset + size].split(b"\0"):
                if b"=" in entry:
                    k, _, v = entry.decode(errors="replace").partition("=")
                    info.setdefault(k, v)
            return info
    return {}
