"""The data plane on its own (no VM): the calls a node makes, against a real data plane serving in this test's
Trio run, with real processes, a real layer file and Debian's qemu-io as the NBD client.

* a disk opened over a layer is served over NBD; writes through it are frozen and sealed into a layer file
  whose content is what was written, and the stack the data plane reports grows by it; ``disk.recover`` seals
  what a freeze left (the control plane died between the two);
* a VMM it spawns is its child, watched and signalled by the control plane through a pidfd, with the exit
  status the data plane reaped; a seccomp filter is installed in the child when the node has no helper;
* errors: an unknown call, a second disk for one sandbox, a missing disk, and a second data plane on the
  same run directory are refused with their reason; a call after the data plane is gone says so.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import AsyncIterator

import pytest
import trio

from aenv_node.dataplane import DataPlaneClient, DataPlaneError, DataPlaneUnavailable, serve_dataplane
from aenv_node.dataplane.wire import call
from aenv_node.storage import LayerReader, LayerRef
from aenv_node.storage.frontends import DiskFrontend, FrontendKind
from aenv_node.storage.importer import import_raw
from aenv_node.vmm.seccomp import punch_hole_guard, seccomp_available

MiB = 1 << 20


@pytest.fixture
async def plane() -> AsyncIterator[tuple[DataPlaneClient, Path]]:
    """A data plane serving in this test (its own short run directory), and a client of it."""
    run_dir = Path(tempfile.mkdtemp(prefix="aenv-dp-", dir="/tmp"))
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(serve_dataplane, run_dir)
            client = DataPlaneClient(run_dir, DiskFrontend(FrontendKind.NBD))
            assert await client.ping() == os.getpid()
            yield client, run_dir
            nursery.cancel_scope.cancel()
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def _qemu_io(uri: str, *cmds: str) -> str:
    argv = ["qemu-io", "-f", "raw", uri]
    for c in cmds:
        argv += ["-c", c]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "failed" not in out.stdout + out.stderr, out
    return out.stdout


async def test_a_disk_is_served_frozen_sealed_and_recovered(plane: tuple[DataPlaneClient, Path],
                                                            tmp_path: Path) -> None:
    client, run_dir = plane
    raw = tmp_path / "base.raw"
    raw.write_bytes(b"\x5a" * MiB)
    layers_dir = tmp_path / "layers"
    layers_dir.mkdir()
    base = import_raw(raw, layers_dir, virtual_size=4 * MiB)
    ref = LayerRef.local(base.path)
    disk = await client.open_disk("sbx1", [ref], tmp_path / "upper", run_dir / "sbx1")
    assert disk.source.startswith("nbd+unix://")
    await trio.to_thread.run_sync(_qemu_io, disk.source, "read -P 0x5a 0 1M", "write -P 0xab 1M 64k", "flush")

    # a live capture's two halves: writes after the freeze go to a fresh upper; the frozen one becomes a layer
    frozen = await trio.to_thread.run_sync(disk.freeze)
    await trio.to_thread.run_sync(_qemu_io, disk.source, "write -P 0xcd 2M 64k", "flush")
    info = await trio.to_thread.run_sync(disk.seal_frozen, frozen, layers_dir)
    assert Path(info.path).is_file() and [r.digest for r in disk.refs] == [ref.digest, f"sha256:{info.digest}"]
    sealed = LayerReader.open(info.path)
    try:
        assert sealed.read(MiB, 64 * 1024) == b"\xab" * 64 * 1024  # what was written before the freeze
        assert sealed.read(2 * MiB, 64 * 1024) == bytes(64 * 1024)  # and nothing after it
    finally:
        sealed.close()
    await trio.to_thread.run_sync(_qemu_io, disk.source, "read -P 0xab 1M 64k", "read -P 0xcd 2M 64k")
    (held,) = await client.held_disks()
    assert held.sandbox_id == "sbx1" and [r.digest for r in held.layers] == [r.digest for r in disk.refs]

    # a freeze the control plane never sealed (it died): the take-over seals it, in order
    await trio.to_thread.run_sync(disk.freeze)
    recovered = await client.recover_disk("sbx1", layers_dir)
    assert len(recovered.refs) == 3 and recovered.refs[:2] == disk.refs
    assert recovered.source == disk.source
    await trio.to_thread.run_sync(_qemu_io, recovered.source, "read -P 0xcd 2M 64k")

    await trio.to_thread.run_sync(disk.close)
    assert await client.held_disks() == []
    assert not (run_dir / "sbx1" / "disk.sock").exists()


async def test_a_spawned_vmm_is_its_child_watched_by_pidfd(plane: tuple[DataPlaneClient, Path],
                                                           tmp_path: Path) -> None:
    client, _ = plane
    log = tmp_path / "vmm.log"
    proc = await client.spawn(["/bin/sh", "-c", "echo started; exec sleep 100"], log_path=log, stdout_path=None,
                              cwd=tmp_path, key="aenv-sbx2")
    assert await client.children() == {proc.pid: "aenv-sbx2"}
    with trio.fail_after(10):  # it runs: its output is in the log the data plane opened for it
        while "started" not in log.read_text():
            await trio.sleep(0.01)
    assert proc.poll() is None
    proc.send_signal(signal.SIGKILL)
    with trio.fail_after(10):
        assert await proc.wait() == -signal.SIGKILL
    assert proc.returncode == -signal.SIGKILL
    proc.close()
    with trio.fail_after(10):  # reaped by the data plane (its reaper task runs a moment after the exit)
        while await client.children():
            await trio.sleep(0.01)
    # a quick exit: its status is kept for the control plane to ask
    quick = await client.spawn(["/bin/sh", "-c", "exit 3"], log_path=log, stdout_path=None, cwd=None, key="k")
    with trio.fail_after(10):
        assert await quick.wait() == 3
    quick.close()


@pytest.mark.skipif(seccomp_available() is not None, reason="seccomp filters cannot be installed here")
async def test_a_seccomp_filter_is_installed_in_the_child(plane: tuple[DataPlaneClient, Path],
                                                          tmp_path: Path) -> None:
    client, _ = plane
    out = tmp_path / "status"
    proc = await client.spawn(["/bin/sh", "-c", "grep Seccomp_filters /proc/self/status"], log_path=tmp_path / "log",
                              stdout_path=out, cwd=None, key="k", seccomp=punch_hole_guard())
    with trio.fail_after(10):
        assert await proc.wait() == 0
    proc.close()
    assert out.read_text().split() == ["Seccomp_filters:", "1"]


async def test_bad_calls_are_refused_with_their_reason(plane: tuple[DataPlaneClient, Path], tmp_path: Path) -> None:
    client, run_dir = plane
    with pytest.raises(DataPlaneError, match="unknown call 'disk.explode'"):
        await client.call("disk.explode")
    with pytest.raises(DataPlaneError, match="no disk open for nope"):
        await client.call("disk.freeze", sandbox_id="nope")
    with pytest.raises(OSError):  # the layer file does not exist: the errno crosses
        await client.open_disk("sbx3", [LayerRef.local(tmp_path / ("0" * 64 + ".layer"))], tmp_path / "u",
                               run_dir / "sbx3")
    assert await client.held_disks() == []
    with pytest.raises(Exception, match="already runs"):
        await serve_dataplane(run_dir)
    with pytest.raises(DataPlaneUnavailable):
        await call(tmp_path / "no.sock", "ping")


async def test_a_failed_disk_server_ends_only_its_own_sandbox(plane: tuple[DataPlaneClient, Path], tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A disk whose server fails after it started (a ublk device stopped from outside, say) kills its sandbox's
    VMM and says why; the data plane and every other disk serve on."""
    import contextlib

    from aenv_node.dataplane import server
    from aenv_node.storage.frontends._nursery import open_service_nursery

    real_export = server.export_disk
    failing: dict[str, trio.Event] = {}

    @contextlib.asynccontextmanager
    async def export(frontend: DiskFrontend, device: object, run_dir: Path) -> AsyncIterator[object]:
        """The real export, with a task of its own that fails on demand (as a ublk queue does)."""
        async with real_export(frontend, device, run_dir) as exported:  # type: ignore[arg-type]
            async with open_service_nursery() as nursery:
                async def fail() -> None:
                    await failing[run_dir.name].wait()
                    raise RuntimeError("the device ended under its server")

                if run_dir.name in failing:
                    nursery.start_soon(fail)
                yield exported
                nursery.cancel_scope.cancel()

    monkeypatch.setattr(server, "export_disk", export)
    client, run_dir = plane
    raw = tmp_path / "base.raw"
    raw.write_bytes(b"\x11" * MiB)
    base = LayerRef.local(import_raw(raw, tmp_path, virtual_size=MiB).path)
    failing["bad"] = trio.Event()
    bad = await client.open_disk("bad", [base], tmp_path / "u1", run_dir / "bad")
    good = await client.open_disk("good", [base], tmp_path / "u2", run_dir / "good")
    vmm_bad = await client.spawn(["sleep", "100"], log_path=tmp_path / "b.log", stdout_path=None, cwd=None,
                                 key="aenv-bad")
    vmm_good = await client.spawn(["sleep", "100"], log_path=tmp_path / "g.log", stdout_path=None, cwd=None,
                                  key="aenv-good")
    assert await client.disk_error("bad") is None
    failing["bad"].set()  # the bad disk's server fails
    with trio.fail_after(10):
        assert await vmm_bad.wait() == -signal.SIGKILL
    assert await client.disk_error("bad") == "RuntimeError: the device ended under its server"
    assert vmm_good.poll() is None and [d.sandbox_id for d in await client.held_disks()] == ["good"]
    await trio.to_thread.run_sync(_qemu_io, good.source, "read -P 0x11 0 64k")
    vmm_good.send_signal(signal.SIGKILL)
    await vmm_good.wait()
    for p in (vmm_bad, vmm_good):
        p.close()
    await trio.to_thread.run_sync(bad.close)  # the control plane's teardown: the disk is gone already
    await trio.to_thread.run_sync(good.close)


async def test_a_stopped_data_plane_leaves_nothing_under_run(tmp_path: Path) -> None:
    """Its socket, its pid file and, when nothing else is in it, the node's run directory go with it (one empty
    directory under /run was left by every node that ever ran)."""
    for other in (False, True):
        run_dir = Path(tempfile.mkdtemp(prefix="aenv-dp-", dir="/tmp")) / "node"
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(serve_dataplane, run_dir)
                if other:  # a sandbox's directory the control plane still has there
                    (run_dir / "sbx1").mkdir()
                assert (run_dir / "dataplane.sock").exists() and (run_dir / "dataplane.pid").exists()
                nursery.cancel_scope.cancel()
            if other:
                assert [p.name for p in run_dir.iterdir()] == ["sbx1"]
            else:
                assert not run_dir.exists()
        finally:
            shutil.rmtree(run_dir.parent, ignore_errors=True)
