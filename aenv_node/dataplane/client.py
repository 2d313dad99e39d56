"""The control plane's side of the data plane: start or find it, and the proxies for what it holds.

``DataPlaneClient`` starts the data-plane process when none answers (``ensure_running``: in its own session,
so a signal to the node never reaches it, with the node's effective configuration in its environment), and
hands out:

* ``RemoteDisk``: a sandbox disk the data plane serves, with the calls a live capture makes on an ``Image``
  (``freeze``, ``seal_frozen``, ``close``, ``layers``), blocking like theirs (the capture path calls them from
  worker threads);
* ``RemoteProcess``: a VMM the data plane started, watched and signalled through a pidfd of our own (race-free
  against pid reuse; readable once it exits, whoever its parent is), so ``vmm.process.VmmProcess`` treats it
  like a child of its own. Only the exit status is asked of the data plane, which reaped it.
"""

from __future__ import annotations

import base64
import logging
import os
import select
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import trio

from ..storage import LayerInfo, LayerRef
from ..storage.cache_stats import CacheStats
from ..storage.frontends import DiskFrontend
from ..vmm.seccomp import SeccompFilter
from .wire import MAX_LINE, DataPlaneError, DataPlaneUnavailable, call, call_blocking

__all__ = ["DataPlaneClient", "RemoteDisk", "RemoteProcess", "HeldDisk"]

log = logging.getLogger(__name__)

#: the most of a cached range one ``cache.read`` carries (base64 in a JSON line, under ``wire.MAX_LINE``)
_RANGE_PIECE = MAX_LINE // 2


@dataclass(frozen=True)
class _Layer:
    """One layer of a remote disk's stack as ``Image.layers`` gives it: its hex digest."""

    digest: Optional[str]


@dataclass(frozen=True)
class HeldDisk:
    """A disk the data plane holds (``disk.list``)."""

    sandbox_id: str
    source: str
    layers: tuple[LayerRef, ...]
    frozen: int


class RemoteDisk:
    """A running sandbox's disk, served by the data plane (see the module docstring)."""

    def __init__(self, client: "DataPlaneClient", sandbox_id: str, source: str, layers: Sequence[LayerRef]) -> None:
        self.client = client
        self.sandbox_id = sandbox_id
        self.source = source
        self._refs = list(layers)
        self._closed = False

    @property
    def refs(self) -> tuple[LayerRef, ...]:
        """The stack as layer references, bottom first (what the next capture's snapshot stacks)."""
        return tuple(self._refs)

    @property
    def layers(self) -> tuple[_Layer, ...]:
        return tuple(_Layer(r.hex) for r in self._refs)

    def freeze(self) -> int:
        return int(self.client.call_blocking("disk.freeze", sandbox_id=self.sandbox_id))

    def seal_frozen(self, frozen: int, layers_dir: str | os.PathLike[str]) -> LayerInfo:
        out = self.client.call_blocking("disk.seal_frozen", sandbox_id=self.sandbox_id, token=frozen,
                                        layers_dir=str(layers_dir))
        info = LayerInfo(**out)
        self._refs.append(LayerRef(f"sha256:{info.digest}", Path(info.path)))
        return info

    def close(self) -> None:
        if not self._closed:
            self.client.call_blocking("disk.close", sandbox_id=self.sandbox_id)
            self._closed = True

    async def aclose(self) -> None:
        """``close`` from a Trio task (no worker thread for one call)."""
        if not self._closed:
            await self.client.call("disk.close", sandbox_id=self.sandbox_id)
            self._closed = True


class RemoteProcess:
    """A VMM the data plane started (see the module docstring). Duck-types ``trio.Process`` for ``VmmProcess``."""

    def __init__(self, client: "DataPlaneClient", pid: int) -> None:
        self.client = client
        self.pid = pid
        self._fd: Optional[int]
        try:
            self._fd = os.pidfd_open(pid)
        except ProcessLookupError:  # it exited (and was reaped) already: its status is the data plane's
            self._fd = None
        self._rc: Optional[int] = None
        self._waiting: Optional[trio.Event] = None

    @property
    def returncode(self) -> Optional[int]:
        return self.poll()

    def _gone(self) -> bool:
        return self._fd is None or bool(select.select([self._fd], [], [], 0)[0])

    def _status_blocking(self) -> int:
        try:
            out = self.client.call_blocking("vmm.status", pid=self.pid)
        except DataPlaneError:
            return -signal.SIGKILL  # the data plane is gone too: its reaper took the status with it
        return self._returncode(out)

    async def _status(self) -> int:
        try:
            out = await self.client.call("vmm.status", pid=self.pid)
        except DataPlaneError:
            return -signal.SIGKILL
        return self._returncode(out)

    @staticmethod
    def _returncode(out: Any) -> int:
        rc = out.get("returncode")
        return int(rc) if rc is not None else -signal.SIGKILL

    def poll(self) -> Optional[int]:
        if self._rc is None and self._gone():
            self._rc = self._status_blocking()
        return self._rc

    async def wait(self) -> int:
        """Its exit status, once it exits (any number of tasks may wait: one watches the pidfd)."""
        while self._rc is None:
            if self._waiting is not None:
                await self._waiting.wait()
                continue
            self._waiting = trio.Event()
            try:
                if self._fd is not None:
                    await trio.lowlevel.wait_readable(self._fd)
                self._rc = await self._status()
            finally:
                self._waiting.set()
                self._waiting = None
        return self._rc

    def send_signal(self, sig: int) -> None:
        if self._fd is not None and self._rc is None:
            signal.pidfd_send_signal(self._fd, sig)

    def close(self) -> None:
        """Give the pidfd back (after the process was waited for)."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                trio.lowlevel.notify_closing(fd)
            except RuntimeError:  # not in a Trio thread: nobody waits on it there
                pass
            os.close(fd)


class DataPlaneClient:
    """The node's handle on its data plane (``run/dataplane.sock``)."""

    def __init__(self, run_dir: Path, frontend: DiskFrontend) -> None:
        self.run_dir = run_dir
        self.sock = run_dir / "dataplane.sock"
        self.pid_file = run_dir / "dataplane.pid"
        self.frontend = frontend
        #: the data plane's pid, once it answered
        self.pid: Optional[int] = None

    async def call(self, op: str, **args: Any) -> Any:
        return await call(self.sock, op, **args)

    def call_blocking(self, op: str, *, timeout_s: Optional[float] = None, **args: Any) -> Any:
        return call_blocking(self.sock, op, timeout_s=timeout_s, **args)

    # ---- the disks' layer cache, for peers (P2P) ---------------------------------------------------------

    def cached_layers_blocking(self, limit: int) -> list[str]:
        """The layers the data plane's cache holds bytes of (for the node's announcement; from a thread)."""
        return [str(d) for d in self.call_blocking("cache.layers", timeout_s=5.0, limit=limit)]

    def cache_stats_blocking(self) -> Optional[CacheStats]:
        """The counters of the data plane's cache (the sandboxes' disks), or None (no cache, no data plane)."""
        try:
            got = self.call_blocking("cache.stats", timeout_s=5.0)
        except DataPlaneError:
            return None
        return None if got is None else CacheStats(**got)

    async def read_cached(self, digest: str, offset: int, length: int) -> tuple[int, bytes, str]:
        """A range of a layer from the data plane's cache for a peer: (200, bytes, "") or (status, b"", why).
        Asked in pieces (a call's line carries base64 under ``wire.MAX_LINE``)."""
        out = bytearray()
        pos, end = offset, offset + length
        while pos < end:
            n = min(_RANGE_PIECE, end - pos)
            got = await self.call("cache.read", digest=digest, offset=pos, length=n)
            if got["status"] != 200:
                return int(got["status"]), b"", str(got["message"])
            out += base64.b64decode(got["data"])
            pos += n
        return 200, bytes(out), ""

    async def ping(self) -> Optional[int]:
        """The data plane's pid, or None when none answers."""
        try:
            out = await self.call("ping")
        except DataPlaneUnavailable:
            return None
        self.pid = int(out["pid"])
        return self.pid

    async def ensure_running(self, *, env: dict[str, str], log_path: Path, timeout_s: float = 30.0) -> int:
        """The running data plane's pid; starts one first if none answers."""
        pid = await self.ping()
        if pid is not None:
            return pid
        log_path.parent.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", "aenv_node.cli.node", "dataplane", "run"]
        with open(log_path, "ab") as out:
            # not a child to reap: it must outlive this process; a short-lived intermediate makes it init's
            proc = await trio.lowlevel.open_process(
                ["/bin/sh", "-c", '"$@" </dev/null >&2 & echo $!', "sh", *argv], stdout=subprocess.PIPE, stderr=out,
                env={**os.environ, **env}, start_new_session=True)
            assert proc.stdout is not None
            started = int((await proc.stdout.receive_some(64)).decode().strip() or 0)
            await proc.wait()
        with trio.move_on_after(timeout_s):
            while True:
                pid = await self.ping()
                if pid is not None:
                    log.info("data plane started (pid %d; log %s)", pid, log_path)
                    return pid
                if started and not os.path.exists(f"/proc/{started}"):
                    break
                await trio.sleep(0.05)
        raise DataPlaneUnavailable(f"the data plane did not start; see {log_path}")

    # ---- disks ---------------------------------------------------------------------------------------

    async def open_disk(self, sandbox_id: str, layers: Sequence[LayerRef], upper: Path, run_dir: Path) -> RemoteDisk:
        # the owner only when there is one: a data plane started before it existed still opens unjailed disks
        owner = {"owner": list(self.frontend.owner)} if self.frontend.owner is not None else {}
        out = await self.call("disk.open", sandbox_id=sandbox_id,
                              layers=[[r.digest, str(r.path) if r.path else None] for r in layers],
                              upper=str(upper), run_dir=str(run_dir), frontend=self.frontend.kind.value,
                              ublk_queues=self.frontend.ublk_queues, **owner)
        return RemoteDisk(self, sandbox_id, str(out["source"]), layers)

    async def held_disks(self) -> list[HeldDisk]:
        return [HeldDisk(d["sandbox_id"], d["source"],
                         tuple(LayerRef(dg, Path(p) if p else None) for dg, p in d["layers"]), int(d["frozen"]))
                for d in await self.call("disk.list")]

    async def recover_disk(self, sandbox_id: str, layers_dir: Path) -> RemoteDisk:
        """The disk a previous control plane opened, any upper its cut capture froze sealed into a layer."""
        layers = await self.call("disk.recover", sandbox_id=sandbox_id, layers_dir=str(layers_dir))
        held = {d.sandbox_id: d for d in await self.held_disks()}
        return RemoteDisk(self, sandbox_id, held[sandbox_id].source,
                          [LayerRef(dg, Path(p) if p else None) for dg, p in layers])

    def attach_disk(self, sandbox_id: str, source: str, layers: Sequence[LayerRef]) -> RemoteDisk:
        """The handle on a disk the data plane holds (``recover_disk`` gave its source and stack)."""
        return RemoteDisk(self, sandbox_id, source, layers)

    async def disk_error(self, sandbox_id: str) -> Optional[str]:
        """Why the data plane stopped serving the disk of ``sandbox_id`` (its server failed), or None."""
        try:
            out = await self.call("disk.error", sandbox_id=sandbox_id)
        except DataPlaneError:
            return None
        return str(out) if out is not None else None

    async def close_disk(self, sandbox_id: str) -> None:
        await self.call("disk.close", sandbox_id=sandbox_id)

    # ---- VMM processes ---------------------------------------------------------------------------------

    async def spawn(self, argv: Sequence[str], *, log_path: Path, stdout_path: Optional[Path], cwd: Optional[Path],
                    key: str, seccomp: Optional[SeccompFilter] = None) -> RemoteProcess:
        """Start ``argv`` as the data plane's child (the ``vmm.process.Spawner`` of a node with a data plane)."""
        pid = await self.call("vmm.spawn", argv=list(argv), log_path=str(log_path), key=key,
                              stdout_path=str(stdout_path) if stdout_path else None, cwd=str(cwd) if cwd else None,
                              seccomp=[seccomp.name, seccomp.program.hex()] if seccomp is not None else None)
        return RemoteProcess(self, int(pid))

    def adopt(self, pid: int) -> RemoteProcess:
        """A VMM the data plane started for an earlier control plane (raises ProcessLookupError if gone)."""
        return RemoteProcess(self, pid)

    async def children(self) -> dict[int, str]:
        """pid -> key (the sandbox or build) of every VMM the data plane runs."""
        return {int(c["pid"]): str(c["key"]) for c in await self.call("vmm.list")}
