"""Real Redis servers (Debian's redis-server, on a unix socket in the test's directory, nothing saved to disk)
and real scheduler processes (``aenv-node scheduler``), started and ended by the tests that use them."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from ..conftest import free_port

REDIS = shutil.which("redis-server")


@dataclass
class RedisServer:
    socket: Path
    proc: subprocess.Popen[bytes]

    @property
    def url(self) -> str:
        return f"unix://{self.socket}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


def start_redis(where: Path) -> RedisServer:
    if REDIS is None:
        pytest.fail("redis-server is missing: scripts/setup.sh installs it")
    where.mkdir(parents=True, exist_ok=True)
    sock = where / "redis.sock"
    proc = subprocess.Popen([REDIS, "--port", "0", "--unixsocket", str(sock), "--unixsocketperm", "700",
                             "--save", "", "--appendonly", "no", "--dir", str(where)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while not sock.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"redis-server did not start (exit {proc.poll()})")
        time.sleep(0.02)
    return RedisServer(sock, proc)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = start_redis(tmp_path / "redis")
    yield server
    server.stop()


@dataclass
class ClusterProcess:
    """A scheduler or gateway process (``aenv-node scheduler|gateway``) on 127.0.0.1, its output in a log."""

    url: str
    api_key: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    args: list[str] = field(default_factory=list)

    def client(self, *, key: str | None = None) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"X-API-KEY": self.api_key if key is None else key},
                            timeout=120)

    def sdk_env(self) -> dict[str, str]:
        """The unmodified E2B SDK pointed at a gateway, as a user points it at a node."""
        return {"E2B_API_URL": self.url, "E2B_SANDBOX_URL": self.url, "E2B_API_KEY": self.api_key}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode


SchedulerProcess = GatewayProcess = ClusterProcess


def _start(tmp: Path, command: str, api_key: str, extra: tuple[str, ...], port: int = 0,
           host: str = "127.0.0.1") -> ClusterProcess:
    """``aenv-node COMMAND --listen HOST:PORT --api-key-file F *extra``, once it answers ``/health``."""
    tmp.mkdir(parents=True, exist_ok=True)
    key_file = tmp / "api-key"
    key_file.write_text(api_key)
    port = port or free_port()
    log_path = tmp / f"{command}-{port}.log"
    args = [sys.executable, "-m", "aenv_node.cli.node", command, "--listen", f"{host}:{port}",
            "--api-key-file", str(key_file), *extra]
    env = {k: v for k, v in os.environ.items() if not k.startswith("AENV_")}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
    started = ClusterProcess(f"http://{host}:{port}", api_key, proc, log_path, args)
    deadline = time.monotonic() + 30
    while True:
        if proc.poll() is not None:
            pytest.fail(f"{command} exited {proc.returncode}: {started.log()[-3000:]}")
        try:
            if httpx.get(f"{started.url}/health", timeout=1).status_code == 200:
                return started
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            started.stop(signal.SIGKILL)
            pytest.fail(f"{command} did not answer: {started.log()[-3000:]}")
        time.sleep(0.05)


def start_scheduler(tmp: Path, redis_url: str, api_key: str, *extra: str, port: int = 0,
                    host: str = "127.0.0.1") -> ClusterProcess:
    return _start(tmp, "scheduler", api_key, ("--redis", redis_url, *extra), port, host)


def start_gateway(tmp: Path, scheduler_url: str, api_key: str, *extra: str) -> ClusterProcess:
    return _start(tmp, "gateway", api_key, ("--scheduler", scheduler_url, *extra))


@pytest.fixture
def scheduler(tmp_path: Path, redis_server: RedisServer) -> Iterator[SchedulerProcess]:
    sched = start_scheduler(tmp_path / "sched", redis_server.url, "cluster-key")
    yield sched
    assert sched.stop() == 0, sched.log()[-3000:]
