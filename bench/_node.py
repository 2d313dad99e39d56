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
import re
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

from aenv_node.config import load_config

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


def process_cpu_s(pid: int, *, children: bool = False) -> float:
    """User + system CPU seconds of process ``pid`` (its threads), or with ``children`` those of the children
    it has waited for (the programs it ran and saw end)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    first = 13 if children else 11  # cutime, cstime after utime, stime
    return (int(fields[first]) + int(fields[first + 1])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def profiled(pid: int, raw_out: Path, rate: int = 100) -> Iterator[dict[str, Any]]:
    """py-spy samples process ``pid`` (all threads, idle ones left out) while the block runs; the collapsed
    stacks go to ``raw_out``, and the dict yielded is filled on exit with where the samples fell: ``top_self``
    (the functions the process was in) and ``top_node`` (the node's own functions, by the samples that had each
    on the stack)."""
    found: dict[str, Any] = {}
    spy_bin = Path(sys.executable).with_name("py-spy")  # (the bench extra's; a binary, not a module)
    with open(raw_out.with_suffix(".log"), "wb") as spy_log:
        spy = subprocess.Popen([str(spy_bin), "record", "--pid", str(pid), "--rate", str(rate), "--format", "raw",
                                "--output", str(raw_out), "--nonblocking"], stdout=spy_log, stderr=spy_log)
    try:
        yield found
    finally:
        spy.send_signal(signal.SIGINT)
        try:
            spy.wait(timeout=30)
        except subprocess.TimeoutExpired:
            spy.kill()
            spy.wait()
    found.update(summarize_stacks(raw_out))


_LINE = re.compile(r":\d+\)$")


def summarize_stacks(raw: Path, top: int = 15) -> dict[str, Any]:
    """Where collapsed py-spy stacks (``frame;frame;... count`` lines) spent their samples."""
    own: dict[str, int] = {}
    node: dict[str, int] = {}
    total = 0
    try:
        lines = raw.read_text().splitlines()
    except OSError:
        return {"samples": 0}
    for line in lines:
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = [_LINE.sub(")", f) for f in stack.split(";")]  # a function, not each of its lines
        own[frames[-1]] = own.get(frames[-1], 0) + n
        for f in set(frames):
            if "aenv_node/" in f:
                node[f] = node.get(f, 0) + n

    def share(d: dict[str, int]) -> list[tuple[str, float]]:
        return [(k, round(v / total, 3)) for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:top]]

    return {"samples": total, "top_self": share(own), "top_node": share(node)} if total else {"samples": 0}


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

    def cpu_s(self) -> dict[str, float]:
        """CPU seconds (user + system) the node's control plane and its data plane have used so far; their
        difference over a phase, divided by its operations, is the node's CPU per operation (the VMMs and the
        guests are not in it). With the data plane on, ``control_plane_commands`` is what the programs the
        control plane ran (``ip``, ``nft``, ``nsenter``...) used: its only children then, as the data plane
        starts the VMMs (without it, the VMMs are the control plane's children too, so it is left out)."""
        out = {"control_plane": process_cpu_s(self.proc.pid)}
        run_dir = load_config(environ={}, overrides={"node": {"state_dir": str(self.state_dir)}}).run_dir
        with contextlib.suppress(OSError, ValueError):
            out["data_plane"] = process_cpu_s(int((run_dir / "dataplane.pid").read_text()))
            out["control_plane_commands"] = process_cpu_s(self.proc.pid, children=True)
        return out

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

    # A shell without job control starts background jobs with SIGINT ignored: the re-raised signal would do
    # nothing and the bench would sleep on through a SIGTERM. Python's own handler goes back in for the while.
    old_int = signal.getsignal(signal.SIGINT)
    if old_int is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)
        if old_int is signal.SIG_IGN:
            signal.signal(signal.SIGINT, signal.SIG_IGN)


@contextlib.contextmanager
def run_node(
    *,
    template_timeout_s: float = 900,
    image_cache: str = IMAGE_CACHE,
    extra_env: dict[str, str] | None = None,
    keep_state: bool = False,
    stop_hook: list[Any] | None = None,
    port: int | None = None,
    api_key: str | None = None,
    state_dir: Path | None = None,
    template: str | None = "base",
) -> Iterator[BenchNode]:
    """Start a node, wait until it serves and the ``base`` template is ready; stop it and remove its state
    on exit (however the block is left).

    ``state_dir``: start on this existing state directory (a state made beforehand, a restart) instead of a
    fresh one; it is kept on exit. ``template``: the template to wait for (None: only ``/health``; set
    ``AENV_TEMPLATES_BUILD_DEFAULT=false`` in ``extra_env`` too, and no VM boots).

    ``stop_hook``: if given, a callable that stops the node early is appended to it (the state directory
    stays until the block exits, so its snapshot files can still be read).
    ``port``: listen there (a cluster node advertises its URL before it starts); a free port by default.
    ``api_key``: the node's key (a cluster's nodes share one), written to its key file before it starts;
    by default the node generates its own.
    """
    if state_dir is not None:
        state, keep_state = state_dir, True
    else:
        state = Path(tempfile.mkdtemp(prefix="aenv-bench-", dir="/var/tmp"))
    port = port or free_port()
    if api_key is not None:
        (state / "secrets").mkdir(mode=0o700)
        key_file = state / "secrets" / "api-key"
        key_file.write_text(api_key + "\n")
        key_file.chmod(0o600)
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
            time.sleep(0.05)
        node.health_s = time.monotonic() - t0
        node.api_key = (state / "secrets" / "api-key").read_text().strip()
        if template is not None:
            _wait_template(node, template, template_timeout_s)
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
