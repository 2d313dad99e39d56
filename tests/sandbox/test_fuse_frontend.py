"""Sandbox disks through the FUSE frontend (Firecracker's fallback where the kernel has no ublk), exercised
here under QEMU, which opens the exported file like any raw drive: a node with ``storage.block_frontend =
fuse`` builds its template, creates, writes (fsync'd through the mount), pauses and resumes; every FUSE mount
goes away with its sandbox. And a pair the node cannot run is refused at start with one line."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from e2b import Sandbox

from ..conftest import free_port
from .conftest import start_node, stop_node

pytestmark = pytest.mark.vm


def _fuse_mounts() -> list[str]:
    with open("/proc/mounts") as f:
        return [line.split()[1] for line in f if line.split()[2].startswith("fuse") and "/run/aenv" in line]


def test_sandbox_on_a_fuse_disk_survives_pause_and_leaves_no_mount(monkeypatch: pytest.MonkeyPatch) -> None:
    state = Path(tempfile.mkdtemp(prefix="aenv-fuse-", dir="/var/tmp"))
    before = set(_fuse_mounts())
    node = start_node(state, AENV_STORAGE_BLOCK_FRONTEND="fuse", AENV_VMM_FREE_PAGE_REPORTING="false")
    try:
        assert "sandbox disks through fuse" in node.log()
        for k, v in node.sdk_env().items():
            monkeypatch.setenv(k, v)
        sb = Sandbox.create()
        try:
            assert len(set(_fuse_mounts()) - before) == 1  # this sandbox's disk
            sb.files.write("/home/user/a.txt", "on a fuse disk")
            r = sb.commands.run("dd if=/dev/urandom of=/home/user/big bs=1M count=16 conv=fsync 2>/dev/null; "
                                "sha256sum /home/user/big | cut -d' ' -f1")
            digest = r.stdout.strip()
            sb.pause()
            node.wait_state(sb.sandbox_id, "paused")
            assert set(_fuse_mounts()) == before  # paused: no process, no mount
            sb = Sandbox.connect(sb.sandbox_id)
            assert sb.files.read("/home/user/a.txt") == "on a fuse disk"
            assert sb.commands.run("sha256sum /home/user/big | cut -d' ' -f1").stdout.strip() == digest
        finally:
            Sandbox.kill(sb.sandbox_id)
        deadline = time.monotonic() + 10
        while set(_fuse_mounts()) != before and time.monotonic() < deadline:
            time.sleep(0.1)
        assert set(_fuse_mounts()) == before
    finally:
        stop_node(node.proc)
        shutil.rmtree(state, ignore_errors=True)


def test_fuse_with_free_page_reporting_is_refused_at_start() -> None:
    state = Path(tempfile.mkdtemp(prefix="aenv-fuse-bad-", dir="/var/tmp"))
    try:
        env = {**os.environ, "AENV_STATE_DIR": str(state), "AENV_STORAGE_BLOCK_FRONTEND": "fuse",
               "AENV_VMM_FREE_PAGE_REPORTING": "true", "AENV_NET_EGRESS": "false"}
        p = subprocess.run([sys.executable, "-m", "aenv_node.cli.node", "serve", "--listen", f"127.0.0.1:{free_port()}"],
                           env=env, capture_output=True, text=True, timeout=60)
        assert p.returncode != 0
        last = p.stderr.strip().splitlines()[-1]
        assert last.startswith("Error: vmm.free_page_reporting needs NBD disks under QEMU"), p.stderr[-2000:]
    finally:
        shutil.rmtree(state, ignore_errors=True)
