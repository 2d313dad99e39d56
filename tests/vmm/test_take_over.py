"""Both drivers, real VMs under KVM with the tiny guest, started by a real data plane (``serve_dataplane`` in this
test's Trio run): a VM its owner detached runs on, and the next owner takes it over with ``VmmDriver.attach``.

* detached: leaving the VM's context kills and removes nothing (the VMM is the data plane's child, still
  running, its console still written);
* taken over: the new owner finds it running where it was and captures it whole: base image + the capture's
  pages restore it where it was. Firecracker's dirty log restarts at every snapshot Firecracker takes, and the
  first owner took one it never committed (the node died before): so the first capture after a take-over is a
  FULL one even when a Diff is asked, and says so. QEMU's dirty pages come from the pagemap of the memory
  image it was restored from, which no capture resets: its Diff stays a Diff;
* owned: leaving the new owner's context kills and reaps the VMM and removes its sockets.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from aenv_node.dataplane import DataPlaneClient, serve_dataplane
from aenv_node.storage.frontends import DiskFrontend, FrontendKind
from aenv_node.vmm import CaptureKind, VmmDriver, VmState, memfile
from aenv_node.vmm.process import read_pid_file

from .test_vm_lifecycle import alive, boot_and_capture
from .tinyguest import (
    MEM_MIB,
    SWEEP_PAGES,
    console_ticks,
    image_status,
    last_tick,
    pattern_ok,
    tiny_config,
    wait_for_tick,
)

pytestmark = pytest.mark.vm


async def test_a_detached_vm_runs_on_and_is_taken_over_whole(driver: VmmDriver, tiny_kernel: Path,
                                                            workroot: Path) -> None:
    base = await boot_and_capture(driver, tiny_kernel, workroot)
    _, base_tick = image_status(base.memory)
    cfg = tiny_config(workroot / "vm", tiny_kernel, name="aenv-takeover", pid_file=workroot / "vm.pid")
    out = workroot / "capture"
    out.mkdir()
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_dataplane, workroot / "dp")
        client = DataPlaneClient(workroot / "dp", DiskFrontend(FrontendKind.NBD))
        driver.spawner = client.spawn
        try:
            async with driver.restore(cfg, base.snapshot_files()) as vm:
                pid = vm.pid
                await wait_for_tick(cfg.console_path, base_tick + 3)
                # a capture the first owner never committed (it died right after): Firecracker's dirty log
                # restarted here
                await vm.capture(workroot / "lost.vmstate", workroot / "lost.memory", kind=CaptureKind.DIFF)
                await vm.resume()
                vm.detach()
            assert alive(pid) and await client.children() == {pid: "aenv-takeover"}
            assert read_pid_file(cfg.pid_file) == pid  # what the next owner finds it by, kept
            seen = last_tick(cfg.console_path)
            assert seen is not None
            await wait_for_tick(cfg.console_path, seen + 2)  # it runs on with no owner

            async with driver.attach(cfg, base.snapshot_files(), client.adopt(pid)) as taken:
                assert taken.pid == pid and taken.state is VmState.RUNNING
                now = last_tick(cfg.console_path)
                assert now is not None
                await wait_for_tick(cfg.console_path, now + SWEEP_PAGES + 2)
                res = await taken.capture(out / "vmstate", out / "memory", kind=CaptureKind.DIFF)
                assert taken.state is VmState.PAUSED
            assert not alive(pid) and await client.children() == {}
        finally:
            driver.spawner = None
            nursery.cancel_scope.cancel()

    assert res.kind is (CaptureKind.FULL if driver.name == "firecracker" else CaptureKind.DIFF)
    if res.kind is CaptureKind.FULL:
        assert res.dirty_bytes == MEM_MIB << 20
    merged = workroot / "merged.memory"
    await trio.to_thread.run_sync(memfile.materialize, base.memory, [(res.memory, res.dirty_ranges)], merged)
    _, at = image_status(merged)
    assert at >= now + SWEEP_PAGES + 2 and pattern_ok(merged)
    again = tiny_config(workroot / "again", tiny_kernel)
    async with driver.restore(again, res.snapshot_files(merged)):
        await wait_for_tick(again.console_path, at + 3)
        assert console_ticks(again.console_path)[0] in (at, at + 1)
