"""The tests' tiny PVH guest (guest/tiny.S): building it and reading what it does.

Built from source with Debian binutils (`as` + `ld`) into an ELF64 with a PVH note; see tiny.S for its
memory layout and console protocol. Both VMMs run it under this host's (PVM) KVM.
"""

from __future__ import annotations

import shutil
import struct
import subprocess
from pathlib import Path

import trio

from aenv_node.vmm import Accel, VmConfig

GUEST_DIR = Path(__file__).parent / "guest"
PAGE = 4096
STATUS = 0x200000
PATTERN = 0x300000
PATTERN_PAGES = 64
SWEEP = 0x400000
SWEEP_PAGES = 16
MAGIC = b"AENVTINY"
MEM_MIB = 64


def build_tiny_guest(out_dir: Path) -> Path:
    """Assemble and link guest/tiny.S into out_dir/tiny.elf."""
    for tool in ("as", "ld"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"{tool} not found: apt-get install binutils")
    out_dir.mkdir(parents=True, exist_ok=True)
    obj, elf = out_dir / "tiny.o", out_dir / "tiny.elf"
    subprocess.run(["as", "--64", "-o", str(obj), str(GUEST_DIR / "tiny.S")], check=True)
    subprocess.run(
        ["ld", "-m", "elf_x86_64", "-nostdlib", "-static", "--no-warn-rwx-segments",
         "-T", str(GUEST_DIR / "tiny.ld"), "-o", str(elf), str(obj)],
        check=True,
    )  # fmt: skip
    return elf


def console_ticks(console: Path) -> list[int]:
    """Tick numbers of the complete "T tttttttt" lines on the console so far."""
    try:
        text = console.read_bytes().decode(errors="replace")
    except FileNotFoundError:
        return []
    lines = text.split("\n")[:-1]  # the last element is an incomplete line (or "")
    out = []
    for ln in lines:
        ln = ln.strip()
        if ln.startswith("T ") and len(ln) == 10:
            out.append(int(ln[2:], 16))
    return out


def last_tick(console: Path) -> int | None:
    t = console_ticks(console)
    return t[-1] if t else None


async def wait_for_tick(console: Path, at_least: int, timeout: float = 20.0) -> int:
    """Wait until the console shows a tick >= at_least; that tick."""
    with trio.move_on_after(timeout):
        while True:
            t = last_tick(console)
            if t is not None and t >= at_least:
                return t
            await trio.sleep(0.02)
    text = console.read_bytes()[-2000:] if console.exists() else b"<no console file>"
    raise AssertionError(f"tick {at_least} not reached in {timeout} s; console tail:\n{text!r}")


def image_status(image: Path) -> tuple[bytes, int]:
    """(magic, tick) from the status page of a memory image (or a diff file that holds that page)."""
    with open(image, "rb") as f:
        f.seek(STATUS)
        data = f.read(12)
    return data[:8], struct.unpack("<I", data[8:12])[0]


def pattern_ok(image: Path) -> bool:
    """The boot-time pattern region is intact: every dword = its address XOR 0x5A5A5A5A."""
    import numpy as np

    with open(image, "rb") as f:
        f.seek(PATTERN)
        got = np.frombuffer(f.read(PATTERN_PAGES * PAGE), dtype="<u4")
    want = (np.arange(PATTERN, PATTERN + PATTERN_PAGES * PAGE, 4, dtype=np.uint32)) ^ np.uint32(0x5A5A5A5A)
    return bool(np.array_equal(got, want))


def tiny_config(workdir: Path, kernel: Path, **kw: object) -> VmConfig:
    """A VmConfig for the tiny guest under KVM."""
    kw.setdefault("mem_mib", MEM_MIB)
    kw.setdefault("accel", Accel.KVM)
    return VmConfig(workdir=workdir, kernel=kernel, **kw)  # type: ignore[arg-type]
