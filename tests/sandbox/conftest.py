"""A real node for the end-to-end tests: ``aenv-node serve`` as a subprocess.

One node per test session (building the ``base`` template boots a Linux guest
once: under QEMU TCG here). Its state directory is fresh; the guest kit and the
base rootfs come from the shared image cache the set-up script fills
(``/var/lib/aenv``), so they are not rebuilt. The session's node has egress and DNS
as in production, through a fake internet of its own (``internet.py``: its only uplink and
DNS upstream); the other nodes tests start get no route off the machine
(``net.egress = false``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from ..conftest import free_pool_cidr, free_port
from .internet import Internet, ip_forward

IMAGE_CACHE = os.environ.get("AENV_TEST_IMAGE_CACHE", "/var/lib/aenv")
DOMAIN = "aenv.test"


@dataclass
class NodeProcess:
    url: str
    api_key: str
    state_dir: Path
    proc: subprocess.Popen
    log_path: Path

    def api(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"X-API-KEY": self.api_key}, timeout=60)

    def sdk_env(self) -> dict[str, str]:
        return {"E2B_API_URL": self.url, "E2B_SANDBOX_URL": self.url, "E2B_API_KEY": self.api_key}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def sql(self, query: str) -> list[tuple]:
        import sqlite3

        con = sqlite3.connect(self.state_dir / "aenv.db")
        try:
            return con.execute(query).fetchall()
        finally:
            con.close()

    def wait_state(self, sandbox_id: str, state: str, timeout: float = 120) -> None:
        """Until the sandbox's row says ``state``. A pause answers once the guest is captured (with a data plane,
        the default): its row says paused, its VMM gone, once the capture is persisted a moment later."""
        deadline = time.monotonic() + timeout
        while (now := self.sql(f"SELECT state FROM sandboxes WHERE id = '{sandbox_id}'")) != [(state,)]:
            assert time.monotonic() < deadline, f"{sandbox_id} is {now}, not {state}"
            time.sleep(0.05)


def _wait_template(node: NodeProcess, template: str = "base", timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    with node.api() as c:
        while time.monotonic() < deadline:
            assert node.proc.poll() is None, f"node exited:\n{node.log()[-3000:]}"
            try:
                r = c.get(f"/templates/{template}")
                if r.status_code == 200 and r.json()["buildStatus"] == "ready":
                    return
                if r.status_code == 200 and r.json()["buildStatus"] == "error":
                    raise AssertionError(f"template build failed:\n{node.log()[-3000:]}")
            except httpx.HTTPError:
                pass
            time.sleep(1)
    raise AssertionError(f"template {template} not ready after {timeout}s:\n{node.log()[-3000:]}")


def start_node(state: Path, *, port: int | None = None, pool: str | None = None, wait_template: bool = True,
               args: tuple[str, ...] = (), host: str = "127.0.0.1", prefix: tuple[str, ...] = (),
               **extra_env: str) -> NodeProcess:
    """Start ``aenv-node serve`` on ``state`` and wait until it answers and (unless ``wait_template`` is
    False) its base template is ready. ``prefix``: what the command runs under (the cluster tests' hosts:
    ``nsenter --net=...``), with the API on ``host``."""
    state.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    env = {
        **os.environ,
        "AENV_STATE_DIR": str(state),
        "AENV_IMAGES_CACHE_DIR": IMAGE_CACHE,
        "AENV_NET_EGRESS": "false",
        "AENV_NET_WARM_SLOTS": "2",
        # several nodes may share this host (a developer's own node, benchmarks): give this one
        # slot addresses of its own
        "AENV_NET_POOL_CIDR": pool or free_pool_cidr(),
        # one test module builds code-interpreter-v1 (tests/templates/test_code_interpreter_template.py)
        "AENV_TEMPLATES_CODE_INTERPRETER": "false",
        **extra_env,
    }
    log_path = state / f"node-{time.monotonic_ns()}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "aenv_node.cli.node", "serve", "--listen", f"{host}:{port}", *args],
            env=env, stdout=log, stderr=subprocess.STDOUT,
        )
    _STATE_OF[proc.pid] = state
    try:
        url = f"http://{host}:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, log_path.read_text()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "node did not answer /health"
            time.sleep(0.2)
        node = NodeProcess(url, (state / "secrets" / "api-key").read_text().strip(), state, proc, log_path)
        if wait_template:
            _wait_template(node)
        return node
    except BaseException:
        stop_node(proc)
        raise


def processes_mentioning(needle: str) -> list[int]:
    """Pids of the processes whose command line contains ``needle`` (a VMM left behind names its directories)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if needle.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


#: the state directory of each node process ``start_node`` started (by pid): ``stop_node`` stops its data plane
_STATE_OF: dict[int, Path] = {}


def stop_node(proc: subprocess.Popen, *, keep_dataplane: bool = False) -> None:
    """SIGTERM (a graceful stop), SIGKILL if it takes over a minute; then its data plane is stopped too (every
    sandbox left running in it ends), unless ``keep_dataplane``."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    state = _STATE_OF.get(proc.pid)
    if state is not None and not keep_dataplane:
        subprocess.run([sys.executable, "-m", "aenv_node.cli.node", "dataplane", "stop"],
                       env={**os.environ, "AENV_STATE_DIR": str(state)}, capture_output=True, timeout=120)


def kill_running(node: NodeProcess) -> None:
    """Kill what still runs on a node whose state directory is about to go: a stop leaves running sandboxes to
    the data plane and their network slots to the next start, and this node has no next start (the fuzzer's
    node ends with dozens running)."""
    if node.proc.poll() is not None:
        return
    try:
        with node.api() as c:
            for sb in c.get("/sandboxes").json():
                c.delete(f"/sandboxes/{sb['sandboxID']}")
    except (httpx.HTTPError, ValueError, TypeError, KeyError):
        pass  # a node that does not answer: the stop and the data plane's stop end what they can


@contextlib.contextmanager
def node_in_tmp(prefix: str, **kwargs: Any) -> Iterator[NodeProcess]:
    """A node (``start_node(state, **kwargs)``) in a fresh state directory under /var/tmp: stopped at the end and
    its directory removed, also when it fails to start; its log is kept as /var/tmp/<prefix>last-node.log for
    post-mortems."""
    state = Path(tempfile.mkdtemp(prefix=prefix, dir="/var/tmp"))
    n = None
    try:
        n = start_node(state, **kwargs)
        yield n
    finally:
        if n is not None:
            kill_running(n)
            stop_node(n.proc)
            try:
                shutil.copy(n.log_path, Path("/var/tmp") / f"{prefix}last-node.log")
            except OSError:
                pass
        shutil.rmtree(state, ignore_errors=True)


@pytest.fixture(scope="session")
def internet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Internet]:
    forward = ip_forward()
    inet = Internet.make(tmp_path_factory.mktemp("internet"))
    try:
        yield inet
    finally:
        inet.remove()
        if forward and ip_forward() != forward:  # the node switches forwarding on for good: put it back
            Path("/proc/sys/net/ipv4/ip_forward").write_text(forward + "\n")


@pytest.fixture(scope="session")
def node(internet: Internet) -> Iterator[NodeProcess]:
    with node_in_tmp("aenv-e2e-", AENV_API_DOMAIN=DOMAIN, AENV_SANDBOX_TTL_CHECK_INTERVAL_S="0.5",
                     AENV_SNAPSHOT_COMPACT_AFTER_LAYERS="4", **internet.node_env()) as n:
        yield n


@pytest.fixture
def sdk_env(node: NodeProcess, monkeypatch: pytest.MonkeyPatch) -> NodeProcess:
    """Point the unmodified E2B SDK at the node, the way a user would (environment variables)."""
    for k, v in node.sdk_env().items():
        monkeypatch.setenv(k, v)
    return node
