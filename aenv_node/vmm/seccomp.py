"""A seccomp filter that keeps QEMU 7.2 from punching holes in a memory image other VMs map.

Why it exists: a VM restored from a snapshot maps the memory image `share=off` (MAP_PRIVATE), and many VMs
map the same file. When the guest gives memory back (virtio-balloon inflation or free page reporting), QEMU
7.2's `ram_block_discard_range()` does two things, in this order:

1. `fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, length)` on the backing FILE: this
   zeroes the image under every other VM (and every later restore); if it fails, QEMU gives up;
2. `madvise(addr, length, MADV_DONTNEED)` on its private mapping: the private (copy-on-write) copies go back
   to the host and the range reads the image again. That is all we want.

`punch_hole_guard()` builds a filter that makes step 1 return success without running it (SECCOMP_RET_ERRNO
with errno 0 makes the syscall return 0), so QEMU goes on to step 2. (Upstream QEMU later added a warning
for discards in private file mappings, "possibly dangerous ... will modify the underlying file", rather than
changing what it does.)

The filter matches `fallocate` with mode exactly PUNCH_HOLE|KEEP_SIZE on ANY file descriptor (BPF cannot
tell which file an fd is). So it is only correct for a process in which nothing else relies on punching
holes: QEMU's raw file driver uses the same call for guest discards and for write-zeroes with unmap, which
would then "succeed" without zeroing. The QEMU driver therefore only installs it when no drive is a
writable file (NBD drives go over a socket; read-only drives never discard). Every other syscall, including
every other `fallocate` mode, runs normally. Syscalls of a foreign ABI (i386 via int 0x80) fail with
ENOSYS: QEMU never makes them, and letting them through would bypass the filter.

Hand-written (ten BPF instructions and two prctl calls through ctypes) rather than libseccomp: libseccomp's
own Python bindings are not on PyPI, `pyseccomp` (a ctypes wrapper) has had no release since 2021, Debian's
python3-seccomp lives outside the venv, and this filter needs nothing libseccomp offers (one syscall, one
argument, one architecture). A program built once in the parent also keeps the child's work between fork
and exec down to two syscalls, where `seccomp_load()` would compile it there.

How the VMM gets it: through `aenv-seccomp-exec` (`native/seccomp_exec.c`, compiled into the venv's bin
by scripts/setup.d/25-seccomp-exec.sh), a 60-line C helper that installs the program it is given in hex and
execs the VMM; or, when the helper is missing, in the child between fork and exec
(`subprocess.Popen(preexec_fn=...)`). Both are inherited across exec (and across `nsenter`'s exec into the
VMM). The helper exists because preexec_fn makes Python fork the whole node instead of using vfork: 8.5 ms
per VMM start measured here, against 0.2 ms. `PR_SET_NO_NEW_PRIVS` is set first, as the kernel requires for
an unprivileged caller; a VMM never gains privileges through exec anyway.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import struct
import sys
from collections.abc import Callable
from pathlib import Path

from .errors import VmmConfigError

__all__ = ["EXEC_HELPER", "SeccompFilter", "SeccompUnavailable", "exec_helper", "punch_hole_guard",
           "seccomp_available"]

#: The helper's name; set-up installs it next to the venv's python.
EXEC_HELPER = "aenv-seccomp-exec"


def exec_helper() -> Path | None:
    """The installed `aenv-seccomp-exec` (next to this interpreter), or None (then `preexec_fn` is used)."""
    p = Path(sys.executable).parent / EXEC_HELPER
    return p if os.access(p, os.X_OK) else None

# <linux/filter.h>, <linux/bpf_common.h>
_BPF_LD_W_ABS = 0x00 | 0x00 | 0x20  # BPF_LD | BPF_W | BPF_ABS
_BPF_JEQ_K = 0x05 | 0x10 | 0x00  # BPF_JMP | BPF_JEQ | BPF_K
_BPF_RET_K = 0x06 | 0x00  # BPF_RET | BPF_K
# <linux/seccomp.h>
_SECCOMP_RET_ALLOW = 0x7FFF0000
_SECCOMP_RET_ERRNO = 0x00050000
_SECCOMP_SET_MODE_FILTER = 1
_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_SECCOMP = 22
_SECCOMP_MODE_FILTER = 2
# <linux/audit.h>: EM_X86_64 | __AUDIT_ARCH_64BIT | __AUDIT_ARCH_LE
_AUDIT_ARCH_X86_64 = 0xC000003E
_X32_SYSCALL_BIT = 0x40000000
_NR_FALLOCATE_X86_64 = 285
# struct seccomp_data: int nr; __u32 arch; __u64 instruction_pointer; __u64 args[6];
_OFF_NR = 0
_OFF_ARCH = 4
_OFF_ARG1_LOW = 16 + 8 * 1  # little endian: the low 32 bits of args[1] (fallocate's int mode)

FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
PUNCH_HOLE_MODE = FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE


class SeccompUnavailable(VmmConfigError):
    """This host (or this architecture) cannot install the seccomp filter a configuration needs."""


def _insn(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


class SeccompFilter:
    """A classic-BPF seccomp program, ready to install in a forked child.

    Everything the child needs (the program in a ctypes buffer, the `sock_fprog`, the libc function) is
    prepared here, in the parent, so `install()` between fork and exec only makes two syscalls.
    """

    def __init__(self, name: str, program: bytes) -> None:
        if len(program) % 8 or not program:
            raise ValueError("a BPF program is a non-empty sequence of 8-byte instructions")
        self.name = name
        self.program = program
        self._buf = ctypes.create_string_buffer(program, len(program))
        self._fprog = _SockFprog(len(program) // 8, ctypes.cast(self._buf, ctypes.c_void_p))
        libc = ctypes.CDLL(None, use_errno=True)
        self._prctl = libc.prctl
        self._prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
        self._prctl.restype = ctypes.c_int
        self._fprog_addr = ctypes.addressof(self._fprog)

    def __len__(self) -> int:
        return len(self.program) // 8

    def install(self) -> None:
        """Install the filter on the calling thread (and everything it execs). Irreversible.

        Meant for `preexec_fn`; raises OSError (which makes Popen fail in the parent) if the kernel refuses.
        """
        if self._prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            e = ctypes.get_errno()
            raise OSError(e, f"prctl(PR_SET_NO_NEW_PRIVS): {os.strerror(e)}")
        if self._prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, self._fprog_addr, 0, 0) != 0:
            e = ctypes.get_errno()
            raise OSError(e, f"prctl(PR_SET_SECCOMP, {self.name}): {os.strerror(e)}")

    def preexec(self) -> Callable[[], None]:
        """The function to pass as `preexec_fn`."""
        return self.install

    def exec_prefix(self, helper: Path) -> list[str]:
        """argv to put before a command so that it runs under this filter through `helper`."""
        return [str(helper), self.program.hex(), "--"]


def seccomp_available() -> str | None:
    """None if this host can run `punch_hole_guard()`, else the reason it cannot."""
    if platform.machine() != "x86_64":
        return f"the seccomp filter is written for x86_64, this host is {platform.machine()}"
    try:
        actions = Path("/proc/sys/kernel/seccomp/actions_avail").read_text().split()
    except OSError:
        return "the kernel has no seccomp filter support (/proc/sys/kernel/seccomp/actions_avail missing)"
    if "errno" not in actions or "allow" not in actions:
        return f"the kernel's seccomp lacks the errno/allow actions (has: {' '.join(actions)})"
    return None


def punch_hole_guard() -> SeccompFilter:
    """The filter: `fallocate(fd, PUNCH_HOLE|KEEP_SIZE, ...)` returns 0 without running; all else runs."""
    reason = seccomp_available()
    if reason is not None:
        raise SeccompUnavailable(reason)
    ret_allow = _SECCOMP_RET_ALLOW
    ret_fake_success = _SECCOMP_RET_ERRNO | 0  # errno 0: the syscall "returns" 0, the kernel skips it
    ret_enosys = _SECCOMP_RET_ERRNO | errno.ENOSYS
    program = b"".join(
        [
            _insn(_BPF_LD_W_ABS, 0, 0, _OFF_ARCH),  # 0: A = arch
            _insn(_BPF_JEQ_K, 1, 0, _AUDIT_ARCH_X86_64),  # 1: x86_64? -> 3
            _insn(_BPF_RET_K, 0, 0, ret_enosys),  # 2: foreign ABI: refuse
            _insn(_BPF_LD_W_ABS, 0, 0, _OFF_NR),  # 3: A = syscall number
            _insn(_BPF_JEQ_K, 1, 0, _NR_FALLOCATE_X86_64),  # 4: fallocate -> 6
            _insn(_BPF_JEQ_K, 0, 3, _NR_FALLOCATE_X86_64 | _X32_SYSCALL_BIT),  # 5: x32 fallocate -> 6, else 9
            _insn(_BPF_LD_W_ABS, 0, 0, _OFF_ARG1_LOW),  # 6: A = mode
            _insn(_BPF_JEQ_K, 0, 1, PUNCH_HOLE_MODE),  # 7: PUNCH_HOLE|KEEP_SIZE -> 8, else 9
            _insn(_BPF_RET_K, 0, 0, ret_fake_success),  # 8: pretend it worked
            _insn(_BPF_RET_K, 0, 0, ret_allow),  # 9: everything else runs
        ]
    )
    return SeccompFilter("punch-hole guard", program)
