"""Paused sandboxes survive a node restart, kill -9 included; running ones are reconciled."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox

from ..conftest import free_port
from .conftest import IMAGE_CACHE, NodeProcess, _wait_template

pytestmark = pytest.mark.vm


def _start(state: Path, port: int, pool: str) -> NodeProcess:
    env = {**os.environ, "AENV_STATE_DIR": str(state), "AENV_IMAGES_CACHE_DIR": IMAGE_CACHE,
           "AENV_NET_EGRESS": "false", "AENV_NET_POOL_CIDR": pool, "AENV_NET_WARM_SLOTS": "1"}
    log_path = state / f"node-{time.monotonic_ns()}.log"
    state.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "aenv_node.cli.node", "serve", "--listen",
                                 f"127.0.0.1:{port}"], env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, log_path.read_text()
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline
        time.sleep(0.2)
    node = NodeProcess(url, (state / "secrets" / "api-key").read_text().strip(), state, proc, log_path)
    _wait_template(node)
    return node


def test_paused_sandbox_survives_kill_9_and_resumes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = Path("/var/tmp") / f"aenv-restart-{os.getpid()}-{random.randrange(10**6)}"
    pool = f"10.11.{random.randrange(64, 250)}.0/24"
    port = free_port()
    node = _start(state, port, pool)
    try:
        for k, v in node.sdk_env().items():
            monkeypatch.setenv(k, v)
        paused = Sandbox.create()
        paused.files.write("/home/user/durable.txt", "survives kill -9")
        paused.pause()
        running = Sandbox.create()
        running_pid = node.sql(f"SELECT vmm_pid FROM sandboxes WHERE id = '{running.sandbox_id}'")[0][0]
        builds = node.sql("SELECT count(*) FROM template_builds")[0][0]

        node.proc.send_signal(signal.SIGKILL)
        node.proc.wait()
        node = _start(state, port, pool)

        # the template was not rebuilt; the running sandbox's orphaned VMM was reconciled away
        assert node.sql("SELECT count(*) FROM template_builds")[0][0] == builds
        assert node.sql(f"SELECT state FROM sandboxes WHERE id = '{running.sandbox_id}'") == [("killed",)]
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{running_pid}") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not os.path.exists(f"/proc/{running_pid}") or \
            running.sandbox_id.encode() not in Path(f"/proc/{running_pid}/cmdline").read_bytes()

        back = Sandbox.connect(paused.sandbox_id)
        assert back.files.read("/home/user/durable.txt") == "survives kill -9"
        assert back.commands.run("echo alive").stdout == "alive\n"
        back.kill()
    finally:
        node.proc.send_signal(signal.SIGTERM)
        try:
            node.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            node.proc.kill()
        import shutil

        shutil.rmtree(state, ignore_errors=True)
