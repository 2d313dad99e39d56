"""One VMM process, owned by one async context manager.

`vmm_process()` starts the process and guarantees, however the block is left (return, exception, Trio
cancellation), that the process is killed (SIGKILL: a VMM holds no state we could lose by it; snapshots are
explicit) and reaped, and that its control sockets are removed. The cleanup runs in a shielded cancel scope,
so a cancelled sandbox scope still leaves nothing behind.

We do not use PR_SET_PDEATHSIG: Trio spawns processes from a worker thread, and the signal fires when that
*thread* exits, not the node. VMM processes orphaned by a node crash are the reconciler's job; drivers name
them (`-name` / `--id`) so it can find them.

A VMM starts behind ``aenv-vmm-exec`` (``native/vmm_exec.c``) where set-up compiled it: one small program
joins its cgroup, writes its pid file, enters its network namespace and makes its stable links, then execs
it, where a shell, ``nsenter``, ``unshare`` and another shell did (still the fallback; ``_launch_argv``).

A node with a data plane starts its VMMs there (a `Spawner`: the process is the data plane's child, so it
outlives the node); `adopted_process` takes over one a previous run of the node started. Either way the
`VmmProcess` here holds something that behaves as a `ChildProcess`.

Also here: the /proc readings every driver's `stats()` needs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import trio

from .cgroup import VmmCgroup
from .errors import VmmExited, VmmNotInstalled, VmmStartError
from .seccomp import SeccompFilter, exec_helper

_CLK_TCK = os.sysconf("SC_CLK_TCK")

#: the native launcher's name (``native/vmm_exec.c``); set-up installs it next to the venv's python
VMM_EXEC_HELPER = "aenv-vmm-exec"


class ChildProcess(Protocol):
    """What `VmmProcess` needs of its process: `trio.Process`, or a data plane's child watched by pidfd."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    async def wait(self) -> int: ...

    def send_signal(self, sig: int) -> None: ...


class Spawner(Protocol):
    """Starts a VMM's full command line somewhere else (the node's data plane) and returns its process;
    ``seccomp``: a filter to install in the child between fork and exec there (no helper to do it)."""

    async def __call__(self, argv: Sequence[str], *, log_path: Path, stdout_path: Path | None, cwd: Path | None,
                       key: str, seccomp: SeccompFilter | None = None) -> ChildProcess: ...


class VmmProcess:
    """A started VMM process. Created only by `vmm_process()` and `adopted_process()`."""

    def __init__(self, proc: ChildProcess, log_path: Path, extra_logs: Sequence[Path] = ()) -> None:
        self._proc = proc
        self.log_path = log_path
        self.extra_logs = tuple(extra_logs)
        self.started_at = time.monotonic()
        #: set when the node stops and leaves this VMM running for its next run to take over (data plane):
        #: leaving the owning block then kills nothing and removes nothing
        self.detached = False

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.poll()

    def alive(self) -> bool:
        return self._proc.poll() is None

    async def wait(self) -> int:
        return await self._proc.wait()

    def log_tail(self, n_bytes: int = 4000) -> str:
        """The end of the VMM's output (and of its own log files, if it keeps any)."""
        parts = []
        for path in (*self.extra_logs, self.log_path):
            try:
                with open(path, "rb") as f:
                    f.seek(0, os.SEEK_END)
                    f.seek(max(0, f.tell() - n_bytes))
                    text = f.read().decode(errors="replace").strip()
            except OSError:
                continue
            if text:
                parts.append(f"[{path.name}]\n{text}" if self.extra_logs else text)
        return "\n".join(parts)

    def check_alive(self, doing: str) -> None:
        if self._proc.poll() is not None:
            raise VmmExited(
                f"VMM process {self.pid} exited with status {self._proc.returncode} while {doing}\n"
                f"--- VMM output (tail) ---\n{self.log_tail()}"
            )

    async def kill(self) -> None:
        """SIGKILL and reap. Idempotent; never raises for an already-dead process."""
        if self._proc.poll() is None:
            try:
                self._proc.send_signal(signal.SIGKILL)
            except ProcessLookupError:
                pass
        with trio.CancelScope(shield=True):
            await self._proc.wait()
        close = getattr(self._proc, "close", None)  # a pidfd to give back
        if close is not None:
            close()

    async def wait_for_socket(self, path: Path, timeout: float) -> None:
        """Until `path` accepts connections; fails fast if the process exits first."""
        deadline = trio.current_time() + timeout
        delay = 0.0005
        while True:
            if self._proc.poll() is not None:
                raise VmmStartError(
                    f"VMM process {self.pid} exited with status {self._proc.returncode} before opening {path}",
                    log_tail=self.log_tail(),
                )
            if path.exists():
                try:
                    stream = await trio.open_unix_socket(str(path))
                except OSError:
                    pass
                else:
                    await stream.aclose()
                    return
            if trio.current_time() > deadline:
                raise VmmStartError(
                    f"VMM process {self.pid} did not open {path} within {timeout:.1f} s", log_tail=self.log_tail()
                )
            await trio.sleep(delay)
            delay = min(delay * 2, 0.002)


_LINK_SCRIPT = (
    'mount -t tmpfs -o size=64k,mode=0755 aenv-vm "$1" || exit 125; shift; '
    'while [ "$1" != -- ]; do ln -s "$1" "$2" || exit 125; shift 2; done; shift; exec "$@"'
)


#: writes the shell's own pid (which the VMM keeps: everything after it execs in place); the caller appends the
#: exec (one write of a few bytes: a reader sees no file, or all of it; the writer is never killed by our crash)
_PID_SCRIPT = 'echo $$ > "$1" || exit 125; shift; '


def read_pid_file(path: Path) -> int | None:
    """The pid a ``vmm_process(pid_file=...)`` recorded, or None (no file, or not a pid)."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def kill_recorded(pid_file: Path, marker: str) -> int | None:
    """SIGKILL the VMM a previous run recorded in ``pid_file`` if it still runs: only if that pid's command
    line names ``marker`` (the sandbox or build it ran for), so a pid reused since is left alone. Returns the
    pid killed. For reconcilers: a process is found by what was recorded, never by a scan of every process."""
    pid = read_pid_file(pid_file)
    if pid is None or pid == os.getpid():
        return None
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    if marker.encode() not in cmdline:
        return None
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return None
    return pid


class MountWrapper(Protocol):
    """A command prefix that runs the VMM in a mount namespace of its own, prepared for it (``StableLinks``,
    or the bind mounts of a jailed Firecracker): what it mounts goes with the process."""

    def exec_prefix(self) -> list[str]: ...


@dataclass(frozen=True)
class StableLinks:
    """Fixed paths for a VMM's files, the same in every process: ``dir/name`` -> ``target``.

    Why: a VMM snapshot records the host paths of the VM's drives (Firecracker 1.12 has no override for them
    in ``/snapshot/load``), but each restore serves its disk somewhere else (``/dev/ublkbN`` with another N, a
    file in another FUSE mount). The VMM is started in a private mount namespace (``unshare --mount``) where
    a tmpfs over ``dir`` holds one symlink per file; a snapshot then names only ``dir/name``, and every
    restore points those names at its own files. The shell that makes the links execs the VMM, so the pid we
    hold stays the VMM's, and the namespace (with its tmpfs) goes away with the process.
    """

    dir: Path
    links: tuple[tuple[str, Path], ...]

    def path(self, name: str) -> Path:
        return self.dir / name

    def exec_prefix(self) -> list[str]:
        self.dir.mkdir(parents=True, exist_ok=True)  # the mount point, empty and unused on the host
        argv = ["unshare", "--mount", "--propagation", "private", "--", "/bin/sh", "-c", _LINK_SCRIPT, "sh",
                str(self.dir)]
        for name, target in self.links:
            argv += [str(target), str(self.dir / name)]
        return [*argv, "--"]

    def helper_args(self) -> list[str]:
        """The same for ``aenv-vmm-exec`` (``--links DIR --link TARGET PATH ...``)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        args = ["--links", str(self.dir)]
        for name, target in self.links:
            args += ["--link", str(target), str(self.dir / name)]
        return args


def vmm_exec_helper() -> Path | None:
    """The installed ``aenv-vmm-exec`` (``native/vmm_exec.c``, next to this interpreter), or None."""
    p = Path(sys.executable).parent / VMM_EXEC_HELPER
    return p if os.access(p, os.X_OK) else None


def _launch_argv(argv: Sequence[str], *, netns: Path | None, stable_links: MountWrapper | None,
                 seccomp: SeccompFilter | None, pid_file: Path | None, cgroup: VmmCgroup | None
                 ) -> tuple[list[str], Callable[[], None] | None]:
    """The command that starts ``argv`` as ``vmm_process`` documents (every step execs in place, so the pid
    is the VMM's), and the ``preexec_fn`` it needs (None: a vfork). With ``aenv-vmm-exec``, in order: the
    cgroup joined, the pid written, the network namespace entered, the mount namespace and its links made (one
    small program), then the seccomp filter installed. Without it (a node whose set-up did not compile it), a
    shell joins the cgroup and writes the pid, the filter is installed, then ``nsenter``, ``unshare`` and
    another shell do the rest, under the filter: four execs more per start."""
    full = list(argv)
    helper = vmm_exec_helper()
    links = stable_links if isinstance(stable_links, StableLinks) and helper is not None else None
    if stable_links is not None and links is None:  # (a jailer's bind mounts: its own wrapper, innermost)
        full = [*stable_links.exec_prefix(), *full]
    preexec: Callable[[], None] | None = None
    if helper is not None:
        if seccomp is not None:  # last of all: the filter covers the VMM from its first instruction
            full, preexec = _with_seccomp(full, seccomp)
        opts: list[str] = []
        for d in cgroup.dirs if cgroup is not None else ():  # first of all: nothing runs outside its limits
            opts += ["--cgroup", str(d)]
        if pid_file is not None:
            opts += ["--pid-file", str(pid_file)]
        if netns is not None:
            opts += ["--netns", str(netns)]
        if links is not None:
            opts += links.helper_args()
        return [str(helper), *opts, "--", *full], preexec
    if netns is not None:  # nsenter execs the VMM in place: the pid we hold is the VMM's
        full = ["nsenter", f"--net={netns}", "--", *full]
    if seccomp is not None:
        full, preexec = _with_seccomp(full, seccomp)
    # one shell in front of all that (an exec less per start than a shell for each):
    script, script_args = "", []
    if cgroup is not None:
        script += cgroup.join_script()
    if pid_file is not None:
        script, script_args = script + _PID_SCRIPT, [str(pid_file)]
    if script:
        full = ["/bin/sh", "-c", script + 'exec "$@"', "sh", *script_args, *full]
    return full, preexec


def _with_seccomp(full: list[str], seccomp: SeccompFilter) -> tuple[list[str], Callable[[], None] | None]:
    helper = exec_helper()
    if helper is not None:  # it installs the filter and execs: the pid stays the VMM's
        return [*seccomp.exec_prefix(helper), *full], None
    return full, seccomp.install  # two prctl() calls through pre-built ctypes objects in the child


@asynccontextmanager
async def vmm_process(
    argv: Sequence[str],
    *,
    log_path: Path,
    stdout_path: Path | None = None,
    sockets: Sequence[Path] = (),
    netns: Path | None = None,
    cwd: Path | None = None,
    extra_logs: Sequence[Path] = (),
    seccomp: SeccompFilter | None = None,
    stable_links: MountWrapper | None = None,
    pid_file: Path | None = None,
    spawner: Spawner | None = None,
    key: str = "",
    cgroup: VmmCgroup | None = None,
) -> AsyncIterator[VmmProcess]:
    """Start `argv` (inside `netns` if given); kill, reap and remove `sockets` on exit.

    stderr goes to `log_path`; stdout to `stdout_path` (e.g. a serial console) or also to `log_path`.
    `extra_logs`: log files the VMM writes itself, included in error messages.
    `stable_links`: run the VMM in a private mount namespace where `stable_links.dir` is a tmpfs holding
    symlinks `name -> target`, so the VMM sees the same paths in every process (see `StableLinks`), or
    where another ``MountWrapper`` mounted what it needs.
    `seccomp`: a filter the VMM runs under from its first instruction: installed by the `aenv-seccomp-exec`
    helper (the last before the VMM) when it is installed, else in the child between fork and exec (which
    costs a fork of this process instead of a vfork; see `seccomp.py`).
    `pid_file`: the child writes its pid there before anything else runs; every wrapper execs
    in place, so it is the VMM's pid. Written by the child, not by us after the spawn: a node killed between
    the fork and its own write would leave a VMM nobody recorded. Removed with the process.
    `spawner`: start the command there (the node's data plane) instead of as our child; `key` names what it
    runs for (the sandbox or build).
    `cgroup`: the VMM's resource limits (``cgroup.py``): the child joins it before anything else runs, and
    it is removed with the process.
    """
    exe = argv[0]
    if not (os.path.isfile(exe) and os.access(exe, os.X_OK)):
        raise VmmNotInstalled(f"VMM binary not found or not executable: {exe}")
    for s in sockets:
        s.unlink(missing_ok=True)
    if netns is not None and not netns.exists():
        raise VmmStartError(f"network namespace {netns} does not exist")
    if pid_file is not None:
        pid_file.parent.mkdir(parents=True, exist_ok=True)
    full_argv, preexec = _launch_argv(argv, netns=netns, stable_links=stable_links, seccomp=seccomp,
                                      pid_file=pid_file, cgroup=cgroup)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    proc: ChildProcess
    if spawner is not None:
        proc = await spawner(full_argv, log_path=log_path, stdout_path=stdout_path, cwd=cwd, key=key,
                             seccomp=seccomp if preexec is not None else None)
    else:
        with open(log_path, "ab") as log_f:
            out_f = open(stdout_path, "wb") if stdout_path is not None else None
            try:
                proc = await trio.lowlevel.open_process(
                    full_argv,
                    stdin=subprocess.DEVNULL,
                    stdout=out_f if out_f is not None else log_f,
                    stderr=log_f,
                    cwd=str(cwd) if cwd else None,
                    start_new_session=True,  # a ^C to the node must not reach VMMs before we clean up
                    preexec_fn=preexec,
                )
            finally:
                if out_f is not None:
                    out_f.close()
    async with adopted_process(proc, log_path=log_path, sockets=sockets, extra_logs=extra_logs,
                               pid_file=pid_file, cgroup=cgroup) as vp:
        yield vp


@asynccontextmanager
async def adopted_process(
    proc: ChildProcess,
    *,
    log_path: Path,
    sockets: Sequence[Path] = (),
    extra_logs: Sequence[Path] = (),
    pid_file: Path | None = None,
    cgroup: VmmCgroup | None = None,
) -> AsyncIterator[VmmProcess]:
    """A VMM process started (``vmm_process``) or found (one an earlier run of the node started, found by what
    it recorded), owned from here on: killed, reaped and its sockets, pid file and cgroup removed however the
    block is left, unless it was detached."""
    vp = VmmProcess(proc, log_path, extra_logs)
    try:
        yield vp
    finally:
        with trio.CancelScope(shield=True):
            await _end(vp, pid_file, sockets, cgroup)


async def _end(vp: VmmProcess, pid_file: Path | None, sockets: Sequence[Path], cgroup: VmmCgroup | None) -> None:
    if vp.detached:
        close = getattr(vp._proc, "close", None)
        if close is not None:
            close()
        return
    await vp.kill()
    if cgroup is not None:
        await trio.to_thread.run_sync(cgroup.remove)
    if pid_file is not None:
        pid_file.unlink(missing_ok=True)
    for s in sockets:
        try:
            s.unlink(missing_ok=True)
        except OSError:
            pass


# ---- /proc readings ------------------------------------------------------------------------------------


def proc_memory(pid: int) -> tuple[int, int]:
    """(Rss, Pss) of a process in bytes, from /proc/PID/smaps_rollup."""
    rss = pss = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Rss:"):
                    rss = int(line.split()[1]) * 1024
                elif line.startswith("Pss:"):
                    pss = int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return rss, pss


def proc_seccomp_filters(pid: int) -> int:
    """How many seccomp filters process `pid` runs under (0 if none or if it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Seccomp_filters:"):
                    return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def proc_cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all threads), in seconds."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    # fields[0] is field 3 (state); utime and stime are fields 14 and 15.
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK
