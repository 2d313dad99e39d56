"""Importing a VM without envd as a template: a kernel that is the whole guest (a unikernel, a test guest).

A template is normally a root filesystem or an image booted with the guest kit, and ready when envd answers.
Some guests have no envd and need no disk: a unikernel, or the tests' tiny PVH guest that measures what the
node itself costs per create (``bench/control_plane.py``: under Firecracker its restore is ~13 ms, so the
control plane is what is left). ``import_vm`` boots such a kernel on the node's build machine, waits until
its console prints a line it names, and captures a boot snapshot like any build (``build.build_template``),
with an empty ``envd_version``: its sandboxes run once their VMM does (no ``/init``), their pauses do not
quiesce, and their envd routes find no envd. The guest still gets the machine every sandbox has (a disk, a
NIC), which it may ignore: the disk is a small empty one.

The kernel is stored by its content digest under the images cache, so a restore years later finds it, and
checked first: an ELF64 for x86-64, no larger than ``MAX_KERNEL_BYTES``.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import struct
from pathlib import Path

import trio

from .build import BuildResult, TemplateSource
from .errors import KernelRefused
from .machine import BuildMachine

__all__ = ["MAX_KERNEL_BYTES", "import_vm", "check_kernel"]

#: the largest kernel accepted (a unikernel with its application fits; a Linux guest is a template build)
MAX_KERNEL_BYTES = 32 << 20
#: the imported VM's disk: it has one, as every sandbox machine does, and nothing on it
EMPTY_DISK_BYTES = 1 << 20
_EM_X86_64 = 62


def check_kernel(data: bytes) -> None:
    """Refuse what is not an ELF64 x86-64 executable (``KernelRefused``, one line saying why)."""
    if len(data) > MAX_KERNEL_BYTES:
        raise KernelRefused(f"the kernel is {len(data)} bytes: at most {MAX_KERNEL_BYTES} are accepted")
    if len(data) < 64 or data[:4] != b"\x7fELF":
        raise KernelRefused("the kernel is not an ELF file (it must be an ELF64 x86-64 executable with a "
                                   "PVH note, as Firecracker and QEMU's microvm boot)")
    ei_class, ei_data = data[4], data[5]
    (e_machine,) = struct.unpack_from("<H", data, 18)
    if ei_class != 2 or ei_data != 1 or e_machine != _EM_X86_64:
        raise KernelRefused("the kernel is an ELF file but not a 64-bit little-endian x86-64 one")


def _store(directory: Path, name: str, data: bytes) -> Path:
    """``data`` at ``directory/name``, written once (under a temporary name, renamed whole)."""
    path = directory / name
    if path.is_file() and path.stat().st_size == len(data):
        return path
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".{name}.{secrets.token_hex(4)}.tmp"
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


async def _console_says(console: Path, text: bytes) -> None:
    """Until the console log holds ``text`` (the build's timeout bounds it)."""
    while True:
        try:
            if text in await trio.to_thread.run_sync(console.read_bytes):
                return
        except FileNotFoundError:
            pass
        await trio.sleep(0.02)


async def import_vm(machine: BuildMachine, kernel: bytes, *, template_id: str, alias: str | None, vcpus: int,
                    mem_mib: int, ready_console: str) -> BuildResult:
    """Boot ``kernel`` on ``machine`` until its console prints ``ready_console``, and keep its boot snapshot as
    the template ``template_id`` (see the module docstring)."""
    check_kernel(kernel)
    if not ready_console:
        raise KernelRefused("readyConsole is empty: name a line the guest prints once it is up")
    digest = hashlib.sha256(kernel).hexdigest()
    vms = machine.images_cache_dir / "vms"
    path = await trio.to_thread.run_sync(_store, vms, f"{digest}.elf", kernel)
    disk = await trio.to_thread.run_sync(_store, vms, "empty-disk.raw", bytes(EMPTY_DISK_BYTES))
    source = TemplateSource(kernel=path, initrd=None, tools_img=None, cmdline="", kit_hash="", rootfs=disk,
                            description=f"vm kernel sha256:{digest}", source_digest=f"sha256:{digest}")
    marker = ready_console.encode()
    return await machine.build(source, template_id=template_id, alias=alias, vcpus=vcpus, mem_mib=mem_mib,
                               disk_size_mb=EMPTY_DISK_BYTES >> 20,
                               ready=lambda console: _console_says(console, marker))
