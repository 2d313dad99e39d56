"""The data-plane process: every running sandbox's disk and the VMM processes, kept apart from the control plane.

A running guest depends on two things in the host: its VMM process and the server of its disk (the image over
its layers plus its writable upper, exported over NBD, ublk or FUSE). When both live in the node's own process,
a restart of the node (an upgrade, SIGKILL, an OOM kill) takes every guest's disk away. The data plane holds
them instead: one small Trio process per node, started by the node (``client.ensure_running``) in its own
session, that outlives any number of control-plane restarts. It is the parent of every VMM the control plane
starts (so it reaps them), and it serves every sandbox disk; it holds no database and makes no decision. The
control plane drives it through a handful of calls (``wire.py``), finds it again after its own restart by
``run/dataplane.pid`` and ``run/dataplane.sock``, and asks it what it holds (``disk.list``, ``vmm.list``).

Calls: ``ping``; ``disk.open`` (layers, upper directory, frontend; answers the source a VMM is given),
``disk.freeze``/``disk.seal_frozen`` (the two halves of a live capture's disk seal), ``disk.recover`` (seals
what a capture cut by a control-plane crash left frozen), ``disk.close``, ``disk.list``, ``disk.error``;
``vmm.spawn`` (argv as the control plane built it), ``vmm.status``, ``vmm.list``; ``cache.layers`` and
``cache.read`` (P2P: the layers the disks' cache holds, and a range of one for a peer, from chunks cached here
only), ``cache.stats`` (that cache's counters, for the node's ``/metrics``). A disk whose server fails
(a ublk device deleted under it, say) takes down only its own sandbox: its VMM is killed, and ``disk.error``
tells the control plane why. The control plane signals and watches a VMM
through a pidfd of its own; only its exit status comes from here.

SIGTERM or SIGINT ends the data plane and, with it, every VMM and disk it holds (the sandboxes then fall back to
their last periodic snapshot when the node next starts, as a crash of the whole node would leave them).
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import logging
import os
import signal
import subprocess
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, Optional

import trio

from ..storage import Image, LayerRef, LayerSourceProvider, open_image
from ..storage.cache_peers import PeerServeRefused
from ..storage.frontends import DiskFrontend, FrontendKind, export_disk
from ..vmm.seccomp import SeccompFilter
from .wire import MAX_LINE, encode_error, vmm_key

__all__ = ["DataPlane", "serve_dataplane"]

log = logging.getLogger(__name__)

#: exit statuses of reaped VMMs kept for ``vmm.status`` (the control plane asks once, right after the exit)
_KEEP_EXITED = 4096


class CallError(Exception):
    """A call the data plane refuses (unknown sandbox, disk already open, bad arguments)."""


@dataclass
class _Disk:
    sandbox_id: str
    image: Image
    run_dir: Path
    #: the stack as layer references, bottom first (what the image was opened over, then each sealed upper)
    refs: list[tuple[str, Optional[str]]]
    source: str = ""
    frozen: dict[int, Any] = field(default_factory=dict)
    next_token: int = 1
    closing: trio.Event = field(default_factory=trio.Event)
    closed: trio.Event = field(default_factory=trio.Event)


@dataclass
class _Child:
    pid: int
    key: str
    proc: trio.Process
    returncode: Optional[int] = None


def _kill(child: _Child) -> None:
    try:
        child.proc.send_signal(signal.SIGKILL)
    except ProcessLookupError:
        pass


class DataPlane:
    """What the process holds, and the calls on it (see the module docstring)."""

    def __init__(self, cache: Optional[LayerSourceProvider] = None) -> None:
        self.cache = cache
        self.disks: dict[str, _Disk] = {}
        self.children: dict[int, _Child] = {}
        self.exited: OrderedDict[int, tuple[str, int]] = OrderedDict()
        #: why a disk's server failed, by sandbox (kept for the control plane to ask once its VMM is gone)
        self.disk_errors: OrderedDict[str, str] = OrderedDict()
        self._nursery: Optional[trio.Nursery] = None
        self._ops: dict[str, Callable[..., Awaitable[Any]]] = {
            "ping": self.ping, "disk.open": self.disk_open, "disk.freeze": self.disk_freeze,
            "disk.seal_frozen": self.disk_seal_frozen, "disk.recover": self.disk_recover,
            "disk.close": self.disk_close, "disk.list": self.disk_list, "disk.error": self.disk_error,
            "vmm.spawn": self.vmm_spawn, "vmm.status": self.vmm_status, "vmm.list": self.vmm_list,
            "cache.layers": self.cache_layers, "cache.read": self.cache_read, "cache.stats": self.cache_stats,
        }

    # ---- serving ------------------------------------------------------------------------------------

    async def serve(self, listener: trio.SocketListener, *,
                    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Answer calls until cancelled; then every VMM is killed and every disk closed."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(trio.serve_listeners, self._connection, [listener])
                task_status.started()
                await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True):
                await self._teardown()

    async def _connection(self, stream: trio.abc.Stream) -> None:
        async with stream:
            buf = bytearray()
            try:
                while not buf.endswith(b"\n"):
                    chunk = await stream.receive_some(65536)
                    if not chunk:
                        return
                    buf += chunk
                    if len(buf) > MAX_LINE:
                        return
            except trio.BrokenResourceError:
                return
            answer: dict[str, Any]
            try:
                request = json.loads(buf)
                fn = self._ops.get(request.get("op", ""))
                if fn is None:
                    raise CallError(f"unknown call {request.get('op')!r}")
                answer = {"ok": True, "result": await fn(**(request.get("args") or {}))}
            except Exception as exc:
                log.info("call failed: %s: %s", type(exc).__name__, exc)
                answer = {"ok": False, "error": encode_error(exc)}
            try:
                await stream.send_all(json.dumps(answer).encode() + b"\n")
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass

    async def _teardown(self) -> None:
        for child in list(self.children.values()):
            _kill(child)
            await child.proc.wait()
        for disk in list(self.disks.values()):
            disk.closing.set()
            await disk.closed.wait()

    # ---- calls --------------------------------------------------------------------------------------

    async def ping(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "disks": len(self.disks), "vmms": len(self.children)}

    def _disk(self, sandbox_id: str) -> _Disk:
        disk = self.disks.get(sandbox_id)
        if disk is None:
            raise CallError(f"no disk open for {sandbox_id}")
        return disk

    async def disk_open(self, sandbox_id: str, layers: list[list[Optional[str]]], upper: str, run_dir: str,
                        frontend: str, ublk_queues: int = 1, owner: Optional[list[int]] = None) -> dict[str, Any]:
        if sandbox_id in self.disks:
            raise CallError(f"a disk is already open for {sandbox_id}")
        assert self._nursery is not None
        refs = [LayerRef(str(d), Path(p) if p else None) for d, p in layers]
        image = await trio.to_thread.run_sync(open_image, refs, upper, self.cache)
        disk = _Disk(sandbox_id, image, Path(run_dir), [(r.digest, str(r.path) if r.path else None) for r in refs])
        self.disks[sandbox_id] = disk
        try:
            disk.source = await self._nursery.start(
                self._serve_disk, disk, DiskFrontend(FrontendKind(frontend), ublk_queues,
                                                     (owner[0], owner[1]) if owner is not None else None))
        except BaseException:
            self.disks.pop(sandbox_id, None)
            raise
        return {"source": disk.source}

    async def _serve_disk(self, disk: _Disk, frontend: DiskFrontend, *, task_status: trio.TaskStatus[str]) -> None:
        started = False
        try:
            disk.run_dir.mkdir(parents=True, exist_ok=True)
            async with export_disk(frontend, disk.image, disk.run_dir) as exported:
                task_status.started(exported.source)
                started = True
                try:
                    await disk.closing.wait()
                finally:
                    if not disk.closing.is_set():
                        # the frontend failed (its own task cancelled this wait): the guest has no disk any
                        # more, and its VMM goes first, before the frontend is taken down (a ublk device is
                        # only deleted once nothing holds it open)
                        self._kill_vmms_of(disk.sandbox_id)
        except Exception as exc:
            if not started:
                raise  # the open fails with it
            # this sandbox's alone: its guest has no disk any more, so its VMM goes; every other disk serves on
            leaf: BaseException = exc
            while isinstance(leaf, BaseExceptionGroup):  # the frontend's own tasks raise in groups
                leaf = leaf.exceptions[0]
            error = f"{type(leaf).__name__}: {leaf}"
            log.warning("the disk server of %s failed: %s", disk.sandbox_id, error)
            # not held any more from the moment its error is known (a caller that reads the error and then the
            # held disks must not see it in both; its image closes below)
            if self.disks.get(disk.sandbox_id) is disk:
                del self.disks[disk.sandbox_id]
            self.disk_errors[disk.sandbox_id] = error
            while len(self.disk_errors) > _KEEP_EXITED:
                self.disk_errors.popitem(last=False)
        finally:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(disk.image.close)
                if self.disks.get(disk.sandbox_id) is disk:
                    del self.disks[disk.sandbox_id]
                disk.closed.set()

    def _kill_vmms_of(self, sandbox_id: str) -> None:
        for child in list(self.children.values()):
            if child.key == vmm_key(sandbox_id):
                _kill(child)

    async def disk_freeze(self, sandbox_id: str) -> int:
        disk = self._disk(sandbox_id)
        frozen = await trio.to_thread.run_sync(disk.image.freeze)
        token = disk.next_token
        disk.next_token += 1
        disk.frozen[token] = frozen
        return token

    async def disk_seal_frozen(self, sandbox_id: str, token: int, layers_dir: str) -> dict[str, Any]:
        disk = self._disk(sandbox_id)
        frozen = disk.frozen.get(token)
        if frozen is None:
            raise CallError(f"no frozen upper {token} in the disk of {sandbox_id}")
        info = await trio.to_thread.run_sync(disk.image.seal_frozen, frozen, layers_dir)
        del disk.frozen[token]
        disk.refs.append((f"sha256:{info.digest}", str(info.path)))
        return asdict(info)

    async def disk_recover(self, sandbox_id: str, layers_dir: str) -> list[list[Optional[str]]]:
        """Seal every upper a cut capture left frozen (in freeze order); the stack as it now is."""
        disk = self._disk(sandbox_id)
        tokens = sorted(disk.frozen)
        for token in tokens:
            await self.disk_seal_frozen(sandbox_id, token, layers_dir)
        if tokens:
            log.info("disk of %s: sealed %d upper(s) a cut capture froze", sandbox_id, len(tokens))
        return [list(r) for r in disk.refs]

    async def disk_close(self, sandbox_id: str) -> None:
        disk = self.disks.get(sandbox_id)
        if disk is None:
            return
        disk.closing.set()
        await disk.closed.wait()

    async def disk_error(self, sandbox_id: str) -> Optional[str]:
        """Why the disk of ``sandbox_id`` stopped being served, if its server failed."""
        return self.disk_errors.get(sandbox_id)

    async def disk_list(self) -> list[dict[str, Any]]:
        return [{"sandbox_id": d.sandbox_id, "source": d.source, "layers": [list(r) for r in d.refs],
                 "frozen": len(d.frozen)} for d in self.disks.values()]

    async def vmm_spawn(self, argv: list[str], log_path: str, key: str, stdout_path: Optional[str] = None,
                        cwd: Optional[str] = None, seccomp: Optional[list[str]] = None) -> int:
        """Start ``argv``; ``seccomp`` ([name, program in hex]): installed in the child before it execs (where
        the node has no ``aenv-seccomp-exec`` helper to put in ``argv``)."""
        assert self._nursery is not None
        preexec = SeccompFilter(seccomp[0], bytes.fromhex(seccomp[1])).install if seccomp else None
        with open(log_path, "ab") as log_f:
            out_f = open(stdout_path, "wb") if stdout_path else None
            try:
                proc = await trio.lowlevel.open_process(
                    argv, stdin=subprocess.DEVNULL, stdout=out_f if out_f is not None else log_f, stderr=log_f,
                    cwd=cwd, start_new_session=True, preexec_fn=preexec)
            finally:
                if out_f is not None:
                    out_f.close()
        child = _Child(proc.pid, key, proc)
        self.children[proc.pid] = child
        self._nursery.start_soon(self._reap, child)
        return proc.pid

    async def _reap(self, child: _Child) -> None:
        child.returncode = await child.proc.wait()
        self.children.pop(child.pid, None)
        self.exited[child.pid] = (child.key, child.returncode)
        while len(self.exited) > _KEEP_EXITED:
            self.exited.popitem(last=False)

    async def vmm_status(self, pid: int) -> dict[str, Any]:
        """``returncode`` None while it runs; ``known`` False for a pid this process never started (or forgot)."""
        child = self.children.get(pid)
        if child is not None:
            rc = child.proc.poll()  # reaps it if it exited a moment ago and the reaper has not run yet
            return {"known": True, "returncode": rc}
        if pid in self.exited:
            return {"known": True, "returncode": self.exited[pid][1]}
        return {"known": False, "returncode": None}

    async def vmm_list(self) -> list[dict[str, Any]]:
        return [{"pid": c.pid, "key": c.key} for c in self.children.values()]


    # ---- the disks' layer cache, for peers (P2P) ---------------------------------------------------------

    async def cache_layers(self, limit: int) -> list[str]:
        """Layers the cache holds bytes of, most recently used first (the node announces them)."""
        held = getattr(self.cache, "cached_layers", None)
        return [] if held is None else list(await trio.to_thread.run_sync(held, int(limit)))

    async def cache_stats(self) -> Optional[dict[str, Any]]:
        """The disks' cache's counters (``CacheStats``), or None without a cache."""
        stats = getattr(self.cache, "stats", None)
        return None if stats is None else dataclasses.asdict(await trio.to_thread.run_sync(stats))

    async def cache_read(self, digest: str, offset: int, length: int) -> dict[str, Any]:
        """A range of a layer for a peer, only from chunks cached here (``LayerCache.serve_range``): ``data`` in
        base64, or the ``status`` and ``message`` of a refusal (404 not held, 400, 503 busy)."""
        serve = getattr(self.cache, "serve_range", None)
        if serve is None:
            return {"status": 404, "message": "the data plane has no layer cache"}
        try:
            data = await trio.to_thread.run_sync(serve, digest, int(offset), int(length))
        except PeerServeRefused as exc:
            return {"status": exc.status, "message": str(exc)}
        return {"status": 200, "data": base64.b64encode(data).decode()}


async def serve_dataplane(run_dir: Path, cache: Optional[LayerSourceProvider] = None, *,
                          task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Run the data plane of the node whose run directory is ``run_dir`` until SIGTERM/SIGINT (or cancelled).

    Refuses to start when another data plane already answers there."""
    sock, pid_file = run_dir / "dataplane.sock", run_dir / "dataplane.pid"
    run_dir.mkdir(parents=True, exist_ok=True)
    if sock.exists():
        try:
            stream = await trio.open_unix_socket(str(sock))
        except OSError:
            sock.unlink()  # a dead one's socket
        else:
            await stream.aclose()
            raise CallError(f"a data plane already runs at {sock}")
    plane = DataPlane(cache)
    raw = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
    await raw.bind(str(sock))
    os.chmod(sock, 0o600)
    raw.listen(128)
    listener = trio.SocketListener(raw)
    tmp = pid_file.with_suffix(".tmp")
    tmp.write_text(f"{os.getpid()}\n")
    tmp.rename(pid_file)
    try:
        async with trio.open_nursery() as nursery:
            async def on_signal() -> None:
                with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                    async for signum in signals:
                        log.info("%s: stopping every VMM and disk", signal.Signals(signum).name)
                        nursery.cancel_scope.cancel()
                        return

            nursery.start_soon(on_signal)
            await nursery.start(plane.serve, listener)
            task_status.started()
    finally:
        with trio.CancelScope(shield=True):
            sock.unlink(missing_ok=True)
            if pid_file.exists() and pid_file.read_text().strip() == str(os.getpid()):
                pid_file.unlink()
            with contextlib.suppress(OSError):  # the node's directory under /run, if nothing is left in it
                run_dir.rmdir()
