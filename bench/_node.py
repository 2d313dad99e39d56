"""A real node for benchmarks: ``aenv-node serve`` as a subprocess with a fresh state directory.

Why a helper and not the tests' fixture (tests/sandbox/conftest.py): benches are plain scripts (no pytest),
run by hand, and must clean up on Ctrl-C or SIGTERM too. The node runs in its own session so a terminal ^C
reaches only the bench, which then stops the node in order (SIGTERM to its PID, wait, SIGKILL if it hangs)
and removes the state directory. The guest kit and the base rootfs come from the shared image cache
(``/var/lib/aenv``), so only the ``base`` template's boot (a Linux guest under QEMU TCG here) is paid per run.
Sandboxes get no route off the machine (``AENV_NET_EGRESS=false``).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import httpx

ROOT = Path(__file__).resolve().parent.parent
IMAGE_CACHE = "/var/lib/aenv"


class NodeStartError(RuntimeError):
    """The node exited, never answered /health, or its template build failed."""


POOL_LOCK_DIR = Path("/run/aenv-bench-pools")


@contextlib.contextmanager
def claim_pool_cidr() -> Iterator[str]:
    """A /16 for the node's network slots that no route on the host touches and no other bench holds.

    Every node defaults to 10.11.0.0/16; two nodes on one host with the same pool (other workers' test
    nodes, or two benches at once) give slots the same addresses, and the host routes one's traffic into
    the other's namespace. A route check alone races (a node adds its routes seconds after it starts), so
    each bench also holds an exclusive lock on its /16 (a flock, released by the kernel if the bench dies)
    for as long as its node runs. Candidates are tried in random order.
    """
    routes = subprocess.run(["ip", "-4", "route", "show"], capture_output=True, text=True).stdout
    used = {ln.split()[0] for ln in routes.splitlines() if ln.strip()}
    POOL_LOCK_DIR.mkdir(parents=True, exist_ok=True)
    candidates = list(range(200, 250))
    random.shuffle(candidates)
    for second in candidates:
        if any(r.startswith(f"10.{second}.") for r in used):
            continue
        fd = os.open(POOL_LOCK_DIR / f"10.{second}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        try:
            yield f"10.{second}.0.0/16"
            return
        finally:
            os.close(fd)  # releases the lock
    raise NodeStartError("no free 10.x.0.0/16 for the node's slot pool (10.200 .. 10.249 all taken)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class BenchNode:
    url: str
    api_key: str
    state_dir: Path
    proc: subprocess.Popen[bytes]
    log_path: Path
    started_at: float  # time.monotonic() at Popen
    health_s: float = 0.0  # Popen -> /health answered
    template_ready_s: float = 0.0  # Popen -> GET /templates/base buildStatus == ready
    env: dict[str, str] = field(default_factory=dict)  # the AENV_* variables it was started with

    def api(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"X-API-KEY": self.api_key}, timeout=60)

    def sdk_env(self) -> dict[str, str]:
        return {"E2B_API_URL": self.url, "E2B_SANDBOX_URL": self.url, "E2B_API_KEY": self.api_key}

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def sql(self, query: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        """Read the node's SQLite database (read-only connection; the node keeps writing)."""
        con = sqlite3.connect(f"file:{self.state_dir / 'aenv.db'}?mode=ro", uri=True, timeout=10)
        try:
            return con.execute(query, params).fetchall()
        finally:
            con.close()

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise NodeStartError(f"node exited with status {self.proc.returncode}:\n{self.log_tail()}")


def _wait_template(node: BenchNode, template: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    with node.api() as c:
        while time.monotonic() < deadline:
            node.check_alive()
            try:
                r = c.get(f"/templates/{template}")
                if r.status_code == 200:
                    status = r.json().get("buildStatus")
                    if status == "ready":
                        return
                    if status == "error":
                        raise NodeStartError(f"template {template} build failed:\n{node.log_tail()}")
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
    raise NodeStartError(f"template {template} not ready after {timeout:.0f} s:\n{node.log_tail()}")


def stop_node(proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
    """SIGTERM the node (by its PID), wait, SIGKILL if it does not exit. Idempotent."""
    if proc.poll() is not None:
        return
    try:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def stop_dataplane(state: Path) -> None:
    """Stop the data plane of the node on ``state`` (``node.data_plane``: it outlives the node), if one runs."""
    subprocess.run([sys.executable, "-m", "aenv_node.cli.node", "dataplane", "stop"], cwd=str(ROOT),
                   env={**os.environ, "AENV_STATE_DIR": str(state)}, capture_output=True, timeout=120)


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """While inside: SIGTERM to the bench is turned into SIGINT, so it ends like a ^C and every `finally`
    cleans up. Re-raising the signal (rather than raising from this handler) lets whoever handles SIGINT at
    that moment (Python's default handler, or Trio's inside `trio.run`) deliver KeyboardInterrupt safely."""

    def handler(signum: int, frame: Any) -> None:
        signal.raise_signal(signal.SIGINT)

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


@contextlib.contextmanager
def run_node(
    *,
    template_timeout_s: float = 900,
    image_cache: str = IMAGE_CACHE,
    extra_env: dict[str, str] | None = None,
    keep_state: bool = False,
    stop_hook: list[Any] | None = None,
) -> Iterator[BenchNode]:
    """Start a node, wait until it serves and the ``base`` template is ready; stop it and remove its state
    on exit (however the block is left).

    ``stop_hook``: if given, a callable that stops the node early is appended to it (the state directory
    stays until the block exits, so its snapshot files can still be read).
    """
    state = Path(tempfile.mkdtemp(prefix="aenv-bench-", dir="/var/tmp"))
    port = free_port()
    log_path = state / "node.log"
    env = {
        **os.environ,
        "AENV_STATE_DIR": str(state),
        "AENV_IMAGES_CACHE_DIR": image_cache,
        "AENV_NET_EGRESS": "false",
        "AENV_TEMPLATES_CODE_INTERPRETER": "false",  # benches that want it say so in extra_env
        **(extra_env or {}),
    }
    proc: subprocess.Popen[bytes] | None = None
    pool = contextlib.ExitStack()
    try:
        if "AENV_NET_POOL_CIDR" not in (extra_env or {}):
            env["AENV_NET_POOL_CIDR"] = pool.enter_context(claim_pool_cidr())
        with open(log_path, "wb") as log:
            t0 = time.monotonic()
            proc = subprocess.Popen(
                [sys.executable, "-m", "aenv_node.cli.node", "serve", "--listen", f"127.0.0.1:{port}"],
                env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=str(ROOT),
                start_new_session=True,  # ^C reaches the bench only; it stops the node in order
            )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        node = BenchNode(url, "", state, proc, log_path, t0,
                         env={k: v for k, v in env.items() if k.startswith("AENV_")})
        deadline = t0 + 60
        while True:
            node.check_alive()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise NodeStartError(f"node did not answer /health within 60 s:\n{node.log_tail()}")
            time.sleep(0.2)
        node.health_s = time.monotonic() - t0
        node.api_key = (state / "secrets" / "api-key").read_text().strip()
        _wait_template(node, "base", template_timeout_s)
        node.template_ready_s = time.monotonic() - t0
        if stop_hook is not None:
            stop_hook.append(lambda: stop_node(proc))
        yield node
    except Exception:
        # keep the node's log of a failed run: the state directory goes away
        if log_path.exists():
            kept = Path(tempfile.gettempdir()) / f"aenv-bench-node-{os.getpid()}.log"
            if proc is not None:
                stop_node(proc)
            shutil.copyfile(log_path, kept)
            print(f"node log kept at {kept}", file=sys.stderr)
        raise
    finally:
        if proc is not None:
            stop_node(proc)
        stop_dataplane(state)  # with every sandbox it still runs (a stop leaves them running)
        pool.close()  # the node and its slots are gone: the /16 is free again
        if not keep_state:
            shutil.rmtree(state, ignore_errors=True)
