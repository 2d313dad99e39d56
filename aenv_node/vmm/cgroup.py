"""Resource limits of a VMM process, through cgroups: CPU time, memory and tasks, one cgroup per VMM.

A guest's own processes are bounded by its VM (its vCPUs, its RAM); what is bounded here is the VMM process
around it, on the host: at most ``vcpus`` CPUs of time (CFS quota), its guest's RAM plus a headroom for the
VMM's own memory (past it the kernel reclaims, then OOM-kills that VMM alone), and a number of tasks. A
runaway VMM (or a guest driving it hard) then hurts only its own sandbox.

Each VMM gets ``<controller root>/aenv-<tag>/<vmm name>`` in each of the cpu, memory and pids controllers
(cgroup v1, as this project's hosts have them; with the unified v2 hierarchy, one directory with the same three
limits). The node's ``aenv-<tag>`` exists only while it holds VMMs: the last one to go takes it along. The VMM joins it before it execs (the shell line ``join_script`` gives, run by the child itself), so
no instant of it runs unlimited; the directory goes when the VMM has exited (``remove``). The name is the
VMM's, so a node that takes a VMM over after a restart finds its cgroup again.

Why hand-written: the kernel interface is a few files per controller; the libraries that wrap it
(cgroupspy and the like) are unmaintained or v1-only, and each would still need the same join-before-exec.
"""

from __future__ import annotations

import errno
import logging
import os
import shlex
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CgroupError", "Cgroups", "ResourceLimits", "VmmCgroup", "VmmLimits"]

log = logging.getLogger(__name__)

_CONTROLLERS = ("cpu", "memory", "pids")
_PERIOD_US = 100_000


class CgroupError(Exception):
    """The host's cgroups cannot hold the limits asked for (a controller missing, not writable)."""


@dataclass(frozen=True)
class ResourceLimits:
    """What one VMM process may use on the host."""

    cpus: float  # CPU time per period, in CPUs
    memory_bytes: int
    pids: int

    def files(self, version: int) -> dict[str, str]:
        """controller file -> value, for cgroup ``version`` (1 or 2)."""
        quota = max(1000, int(self.cpus * _PERIOD_US))
        if version == 1:
            return {"cpu.cfs_period_us": str(_PERIOD_US), "cpu.cfs_quota_us": str(quota),
                    "memory.limit_in_bytes": str(self.memory_bytes), "pids.max": str(self.pids)}
        return {"cpu.max": f"{quota} {_PERIOD_US}", "memory.max": str(self.memory_bytes),
                "pids.max": str(self.pids)}


@dataclass(frozen=True)
class VmmCgroup:
    """The cgroup directories of one VMM (one per controller under v1, one under v2)."""

    dirs: tuple[Path, ...]

    def join_script(self) -> str:
        """Shell commands that move the running shell (``$$``) into every directory: the VMM it then execs
        starts inside."""
        return "".join(f"echo $$ > {shlex.quote(str(d / 'cgroup.procs'))}; " for d in self.dirs)

    def members(self) -> set[int]:
        pids: set[int] = set()
        for d in self.dirs:
            try:
                pids |= {int(p) for p in (d / "cgroup.procs").read_text().split()}
            except OSError:
                pass
        return pids

    def remove(self, timeout_s: float = 5.0) -> None:
        """Remove the directories (their VMM has exited; a moment may pass before the kernel lets go of it),
        and the node's root above each when this was the last VMM in it (a root exists only while it holds
        VMMs: a node that dies leaves none behind once its VMMs are gone)."""
        deadline = time.monotonic() + timeout_s
        for d in self.dirs:
            while True:
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError as exc:
                    if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                        log.warning("removing cgroup %s failed: %s", d, exc)
                        break
                    time.sleep(0.05)
            try:
                os.rmdir(d.parent)
            except OSError:  # another VMM of the node is in it (or it is gone already)
                pass


class Cgroups:
    """The node's part of the host's cgroup tree: ``aenv-<tag>`` under each controller's root."""

    def __init__(self, roots: tuple[Path, ...], version: int) -> None:
        self.roots = roots
        self.version = version

    @classmethod
    def detect(cls, tag: str, base: Path = Path("/sys/fs/cgroup")) -> Cgroups:
        """The node's cgroups on this host (created if missing); CgroupError if a controller is missing."""
        if all((base / c).is_dir() and (base / c / "cgroup.procs").exists() for c in _CONTROLLERS):
            roots = tuple(base / c / f"aenv-{tag}" for c in _CONTROLLERS)
            version = 1
        elif (base / "cgroup.controllers").exists():
            have = set((base / "cgroup.controllers").read_text().split())
            missing = [c for c in _CONTROLLERS if c not in have]
            if missing:
                raise CgroupError(f"the cgroup v2 hierarchy at {base} lacks the {', '.join(missing)} controller(s)")
            roots = (base / f"aenv-{tag}",)
            version = 2
        else:
            raise CgroupError(f"no cgroup v1 cpu, memory and pids controllers and no cgroup v2 hierarchy at {base}")
        found = cls(roots, version)
        try:  # can we? (the roots are made again by the first VMM that needs them)
            found._ensure_roots()
        except OSError as exc:
            raise CgroupError(f"cannot set up the node's cgroups under {base}: {exc}") from exc
        found.remove_roots()
        return found

    def _ensure_roots(self) -> None:
        for root in self.roots:
            if root.is_dir():
                continue
            root.mkdir(exist_ok=True)
            if self.version == 2:
                enable = " ".join(f"+{c}" for c in _CONTROLLERS)
                (root.parent / "cgroup.subtree_control").write_text(enable)
                (root / "cgroup.subtree_control").write_text(enable)

    def of(self, name: str) -> VmmCgroup:
        """The cgroup of the VMM named ``name`` (whether or not it exists)."""
        if not name or "/" in name or name in (".", ".."):
            raise CgroupError(f"not a usable cgroup name: {name!r}")
        return VmmCgroup(tuple(root / name for root in self.roots))

    def create(self, name: str, limits: ResourceLimits) -> VmmCgroup:
        """The VMM's cgroup with ``limits`` (made again if a previous one was left)."""
        cg = self.of(name)
        files = limits.files(self.version)
        try:
            for d in cg.dirs:
                for attempt in range(3):  # a root the last VMM of the node just took with it is made again
                    self._ensure_roots()
                    try:
                        d.mkdir(exist_ok=True)
                        break
                    except FileNotFoundError:
                        if attempt == 2:
                            raise
                for fname, value in files.items():
                    target = d / fname
                    if target.exists():  # v1: each directory has only its own controller's files
                        target.write_text(value)
        except OSError as exc:
            cg.remove()
            raise CgroupError(f"setting the limits of {name} failed: {exc}") from exc
        return cg

    def remove_roots(self) -> bool:
        """Remove the node's roots if no VMM cgroup is left in them (a node stopping with none running);
        True if they went."""
        try:
            for root in self.roots:
                if root.is_dir():
                    os.rmdir(root)
        except OSError:
            return False
        return True

    def leftovers(self) -> list[str]:
        """Names of the VMM cgroups under the node's roots (a reconcile removes those no VMM uses)."""
        names: set[str] = set()
        for root in self.roots:
            if root.is_dir():
                names |= {p.name for p in root.iterdir() if p.is_dir()}
        return sorted(names)


@dataclass(frozen=True)
class VmmLimits:
    """How a VMM's limits follow from its VM (node config ``vmm.cgroups``, ``vmm.memory_overhead_mib``,
    ``vmm.pids_max``): its vCPUs plus one CPU for its own threads (I/O, TCG's translation), its guest's RAM plus
    the overhead, and the task limit. A driver with limits puts each VMM it starts in its own cgroup."""

    cgroups: Cgroups
    memory_overhead_mib: int
    pids: int

    def for_vm(self, vcpus: int, mem_mib: int) -> ResourceLimits:
        return ResourceLimits(cpus=vcpus + 1, memory_bytes=(mem_mib + self.memory_overhead_mib) << 20, pids=self.pids)

    def create(self, name: str, vcpus: int, mem_mib: int) -> VmmCgroup:
        return self.cgroups.create(name, self.for_vm(vcpus, mem_mib))

    def members(self, name: str) -> set[int]:
        """The processes in the VMM cgroup ``name`` (none if it does not exist)."""
        return self.cgroups.of(name).members()

    def sweep(self) -> list[str]:
        """Remove the cgroups no process is in (their VMMs ended with a node that crashed); their names."""
        gone = []
        for name in self.cgroups.leftovers():
            cg = self.cgroups.of(name)
            if not cg.members():
                cg.remove()
                gone.append(name)
        return gone
