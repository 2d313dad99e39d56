"""The in-sandbox code-interpreter server (``aenv_node/templates/code_interpreter``), without a VM.

The server runs as it will in a guest: its package folder copied under another name (``aenv_code_interpreter``) and
run with ``python -m`` by an interpreter that has only the pinned wheels, installed offline from the wheel directory
``wheels.download_wheels`` made (which proves the wheel set is complete).  It is driven by the unmodified
``e2b_code_interpreter`` SDK (a ``Sandbox`` whose sandbox URL is the server) and by raw HTTP.  A fake envd answers
``GET /envs``.

The wheels and the venv are cached by the requirements file's hash under ``$AENV_TEST_CACHE`` (default
``/var/tmp/aenv-ci-cache``), so only the first run downloads (~14 MB from PyPI) and installs.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from aenv_node.templates.code_interpreter import wheels

from ..conftest import free_port

PACKAGE = Path(wheels.__file__).resolve().parent
CACHE = Path(os.environ.get("AENV_TEST_CACHE", "/var/tmp/aenv-ci-cache")) / "code-interpreter"
GUEST_NAME = "aenv_code_interpreter"
ACCESS_TOKEN = "envd-token-1"
SANDBOX_ENVS = {"SANDBOX_VAR": "from-envd", "SHARED_VAR": "global"}

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="finds the kernels through /proc")


# ---- the guest-like interpreter ------------------------------------------------------------------------------------


def _offline_pip_env() -> dict[str, str]:
    """No pip config (this host's adds find-links and indexes): the install sees only the wheel directory."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


@pytest.fixture(scope="session")
def guest_python() -> Path:
    """A venv with exactly the pinned wheels, installed with ``--no-index`` (cached by requirements hash)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        wheel_dir = wheels.download_wheels(CACHE)
        venv = CACHE / f"venv-{wheels.requirements_hash()}"
        python = venv / "bin" / "python"
        if not (venv / ".complete").is_file():
            shutil.rmtree(venv, ignore_errors=True)
            subprocess.run([shutil.which("python3.11") or "python3", "-m", "venv", str(venv)], check=True)
            proc = subprocess.run(
                [str(python), "-m", "pip", "install", "-q", "--no-index", "--find-links", str(wheel_dir),
                 "-r", str(wheels.REQUIREMENTS)],
                capture_output=True, text=True, env=_offline_pip_env(), check=False,
            )  # fmt: skip
            assert proc.returncode == 0, f"offline install of the wheel set failed:\n{proc.stderr[-3000:]}"
            (venv / ".complete").write_text(wheel_dir.name + "\n")
    return python


@pytest.fixture(scope="session")
def unpacked_site() -> Path:
    """The wheels unpacked into one directory (``wheels.unpack_wheels``), for a python3 without pip."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        site = CACHE / f"site-{wheels.requirements_hash()}"
        if not (site / ".complete").is_file():
            shutil.rmtree(site, ignore_errors=True)
            wheels.unpack_wheels(wheels.download_wheels(CACHE), site)
            (site / ".complete").write_text("")
    return site


# ---- a fake envd ---------------------------------------------------------------------------------------------------


@dataclass
class FakeEnvd:
    url: str
    tokens: list[str | None] = field(default_factory=list)


@pytest.fixture(scope="module")
def envd() -> Iterator[FakeEnvd]:
    seen: list[str | None] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            seen.append(self.headers.get("X-Access-Token"))
            body = json.dumps(SANDBOX_ENVS).encode() if self.path == "/envs" else b"{}"
            self.send_response(200 if self.path == "/envs" else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield FakeEnvd(f"http://127.0.0.1:{server.server_address[1]}", seen)
    finally:
        server.shutdown()
        server.server_close()


# ---- the server ----------------------------------------------------------------------------------------------------


def _children(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (from /proc)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(text.rsplit(")", 1)[1].split()[1])
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parents.items() if pp == p]
        out += kids
        todo += kids
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _is_kernel(pid: int) -> bool:
    try:
        return b"ipykernel_launcher" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


@dataclass
class Server:
    url: str
    proc: subprocess.Popen[bytes]
    home: Path
    log: Path
    kernels_seen: set[int] = field(default_factory=set)

    def note_kernels(self) -> set[int]:
        pids = {p for p in _children(self.proc.pid) if _is_kernel(p)}
        self.kernels_seen |= pids
        return pids

    def stop(self, sig: signal.Signals = signal.SIGTERM, timeout: float = 20) -> None:
        """Stop the server by its PID, then kill by PID every kernel it was seen to have that is still there."""
        self.note_kernels()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        for pid in self.kernels_seen:
            if _alive(pid) and _is_kernel(pid):
                os.kill(pid, signal.SIGKILL)


def start_server(python: Path, tmp: Path, envd_url: str = "", site: Path | None = None) -> Server:
    pkg_root = tmp / "opt"
    shutil.copytree(PACKAGE, pkg_root / GUEST_NAME, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    home = tmp / "home-user"
    home.mkdir()
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "JUPYTER", "IPYTHON", "VIRTUAL_ENV"))}
    env.update(PYTHONPATH=os.pathsep.join(str(p) for p in (site, pkg_root) if p), HOME=str(home),
               IPYTHONDIR=str(tmp / "ipython"),
               JUPYTER_RUNTIME_DIR=str(tmp / "jupyter-runtime"), JUPYTER_DATA_DIR=str(tmp / "jupyter-data"),
               PYTHONDONTWRITEBYTECODE="1")  # fmt: skip
    log = tmp / "server.log"
    cmd = [str(python), "-m", GUEST_NAME, "--host", "127.0.0.1", "--port", str(port), "--cwd", str(home),
           "--envd-url", envd_url]  # fmt: skip
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=tmp, env=env, stdout=out, stderr=subprocess.STDOUT)
    server = Server(f"http://127.0.0.1:{port}", proc, home, log)
    deadline = time.monotonic() + 90
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"the server exited ({proc.returncode}):\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            server.stop()
            raise AssertionError(f"the server did not answer /health in 90 s:\n{log.read_text()[-4000:]}")
        time.sleep(0.2)
    server.note_kernels()
    return server


@pytest.fixture(scope="module")
def server(guest_python: Path, envd: FakeEnvd, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(guest_python, tmp_path_factory.mktemp("code-interpreter"), envd.url)
    try:
        yield srv
    finally:
        srv.stop()
        assert not [p for p in srv.kernels_seen if _alive(p)], "kernels left behind"


@pytest.fixture
def sandbox(server: Server):
    """The SDK's own ``Sandbox``, pointed at the server (the SDK uses a given sandbox URL for every port)."""
    ci = pytest.importorskip("e2b_code_interpreter", reason="the e2b-code-interpreter SDK is not installed")
    from e2b import ConnectionConfig
    from packaging.version import Version

    config = ConnectionConfig(api_key="e2b_test", sandbox_url=server.url, request_timeout=60)
    return ci.Sandbox(sandbox_id="local", sandbox_domain=None, envd_version=Version("0.5.7"),
                      envd_access_token=ACCESS_TOKEN, traffic_access_token=None, connection_config=config)  # fmt: skip


# ---- the SDK against the server ------------------------------------------------------------------------------------


def test_main_result(sandbox) -> None:
    execution = sandbox.run_code("x = 21 * 2\nx")
    assert execution.text == "42"
    assert execution.error is None
    [result] = execution.results
    assert result.is_main_result and result.text == "42"
    assert isinstance(execution.execution_count, int) and execution.execution_count >= 1
    # a str result reads without its quotes, as on E2B
    assert sandbox.run_code("'hello'").text == "hello"


def test_stdout_and_stderr(sandbox) -> None:
    out: list = []
    err: list = []
    execution = sandbox.run_code(
        "import sys\nprint('to stdout')\nprint('to stderr', file=sys.stderr)",
        on_stdout=out.append, on_stderr=err.append,
    )  # fmt: skip
    assert execution.logs.stdout == ["to stdout\n"]
    assert execution.logs.stderr == ["to stderr\n"]
    assert [m.line for m in out] == ["to stdout\n"] and not out[0].error
    assert [m.line for m in err] == ["to stderr\n"] and err[0].error
    assert execution.results == [] and execution.error is None


def test_error(sandbox) -> None:
    errors: list = []
    execution = sandbox.run_code("print('before')\ndef f():\n    return 1 / 0\nf()", on_error=errors.append)
    assert execution.logs.stdout == ["before\n"]
    err = execution.error
    assert err is not None and errors == [err]
    assert (err.name, err.value) == ("ZeroDivisionError", "division by zero")
    plain = re.sub(r"\x1b\[[0-9;]*m", "", err.traceback)  # IPython colours it, as on E2B
    assert "return 1 / 0" in plain and "f()" in plain
    assert plain.rstrip().endswith("ZeroDivisionError: division by zero")
    assert "\nZeroDivisionError" in plain  # blocks on lines of their own, not run together
    syntax = sandbox.run_code("def (:")
    assert syntax.error is not None and syntax.error.name == "SyntaxError"


def test_state_persists_and_contexts_are_isolated(sandbox, server: Server) -> None:
    sandbox.run_code("counter = 1")
    assert sandbox.run_code("counter += 1\ncounter").text == "2"

    ctx = sandbox.create_code_context()
    assert (ctx.language, ctx.cwd) == ("python", str(server.home))
    missing = sandbox.run_code("counter", context=ctx)
    assert missing.error is not None and missing.error.name == "NameError"
    sandbox.run_code("only_here = 'ctx'", context=ctx)
    assert sandbox.run_code("only_here", context=ctx).text == "ctx"
    assert sandbox.run_code("'only_here' in globals()").text == "False"
    assert ctx.id in {c.id for c in sandbox.list_code_contexts()}

    other_dir = server.home / "elsewhere"
    other_dir.mkdir()
    ctx2 = sandbox.create_code_context(cwd=str(other_dir), language="python")
    assert ctx2.cwd == str(other_dir)
    assert sandbox.run_code("import os; os.getcwd()", context=ctx2).text == str(other_dir)
    assert sandbox.run_code("import os; os.getcwd()").text == str(server.home)
    # language="python" is the default context
    assert sandbox.run_code("counter", language="python").text == "2"
    sandbox.remove_code_context(ctx)
    sandbox.remove_code_context(ctx2)


def test_restart_clears_state(sandbox, server: Server) -> None:
    ctx = sandbox.create_code_context()
    sandbox.run_code("kept = 1", context=ctx)
    before = server.note_kernels()
    sandbox.restart_code_context(ctx)
    after = server.note_kernels()
    assert before != after  # a new kernel process
    execution = sandbox.run_code("kept", context=ctx)
    assert execution.error is not None and execution.error.name == "NameError"
    assert execution.execution_count == 1
    assert sandbox.run_code("kept = 2\nkept", context=ctx).text == "2"
    sandbox.remove_code_context(ctx.id)


def test_removed_context_is_not_found(sandbox, server: Server) -> None:
    from e2b import NotFoundException

    ctx = sandbox.create_code_context()
    kernels = server.note_kernels()
    sandbox.remove_code_context(ctx)
    assert ctx.id not in {c.id for c in sandbox.list_code_contexts()}
    with pytest.raises(NotFoundException, match=ctx.id):
        sandbox.run_code("1", context=ctx)
    with pytest.raises(NotFoundException):
        sandbox.remove_code_context(ctx)
    with pytest.raises(NotFoundException):
        sandbox.restart_code_context(ctx)
    gone = kernels - server.note_kernels()
    assert len(gone) == 1 and not any(_alive(p) for p in gone)  # its kernel is stopped


def test_rich_display(sandbox) -> None:
    code = (
        "from IPython.display import display, Markdown, JSON\n"
        "class Table:\n"
        "    def _repr_html_(self):\n"
        "        return '<table><tr><td>1</td></tr></table>'\n"
        "display(Table())\n"
        "display(Markdown('**bold**'))\n"
        "display(JSON({'a': 1}))\n"
        "Table()\n"
    )
    execution = sandbox.run_code(code)
    html, md, js, main = execution.results
    assert html.html == "<table><tr><td>1</td></tr></table>" and not html.is_main_result
    assert md.markdown == "**bold**"
    assert js.json == {"a": 1}
    assert main.is_main_result and main.html == html.html and "Table at 0x" in (main.text or "")
    assert "html" in main.formats()


def test_env_vars(sandbox, envd: FakeEnvd) -> None:
    value = "it's \"quoted\" \\ $HOME\nline two"
    code = (
        "import json, os, subprocess\n"
        "child = subprocess.check_output(['sh', '-c', 'printf %s \"$MY_VAR\"']).decode()\n"
        "print(json.dumps([os.environ.get('MY_VAR'), child]))"
    )
    [line] = sandbox.run_code(code, envs={"MY_VAR": value}).logs.stdout
    assert json.loads(line) == [value, value]  # in the kernel and in a child process
    assert sandbox.run_code("import os; os.environ.get('MY_VAR')", envs={"MY_VAR": "v1"}).text == "v1"
    # only for that execution
    assert sandbox.run_code("import os; repr(os.environ.get('MY_VAR'))").text == "None"
    # the sandbox's env vars (envd's GET /envs, read with the access token the SDK sends to /execute)
    assert sandbox.run_code("import os; os.environ['SANDBOX_VAR']").text == "from-envd"
    assert ACCESS_TOKEN in envd.tokens
    # an execution's value wins for that execution, and the sandbox's comes back after it
    assert sandbox.run_code("import os; os.environ['SHARED_VAR']", envs={"SHARED_VAR": "mine"}).text == "mine"
    assert sandbox.run_code("import os; os.environ['SHARED_VAR']").text == "global"
    # and helper executions leave no trace in the user's namespace or history
    assert sandbox.run_code("sorted(k for k in globals() if 'aenv' in k)").text == "[]"


def test_timeout_interrupts_the_kernel(sandbox) -> None:
    from e2b import TimeoutException

    ctx = sandbox.create_code_context()
    sandbox.run_code("survivor = 'still here'", context=ctx)
    t0 = time.monotonic()
    with pytest.raises(TimeoutException):
        sandbox.run_code("import time\nprint('start', flush=True)\ntime.sleep(60)", context=ctx, timeout=2)
    after = sandbox.run_code("survivor", context=ctx)  # interrupted, not restarted: the state is kept
    assert after.text == "still here"
    assert time.monotonic() - t0 < 20
    sandbox.remove_code_context(ctx)


def test_kernel_death(sandbox, server: Server) -> None:
    ctx = sandbox.create_code_context()
    sandbox.run_code("doomed = 1", context=ctx)
    died = sandbox.run_code("import os\nos._exit(3)", context=ctx)
    assert died.error is not None and died.error.name == "KernelDied"
    after = sandbox.run_code("'doomed' in globals()", context=ctx)
    assert after.text == "False" and after.error is None
    server.note_kernels()
    sandbox.remove_code_context(ctx)


# ---- raw HTTP ------------------------------------------------------------------------------------------------------


def test_execute_stream_wire_format(server: Server) -> None:
    """NDJSON, a line per event as it happens, ``end_of_execution`` last; and the SDK's own parser accepts it."""
    code = "import time\nprint('first', flush=True)\ntime.sleep(1.5)\nprint('second')\n7 * 6"
    arrivals: list[tuple[float, dict]] = []
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", f"{server.url}/execute", json={"code": code, "context_id": None,
                                                                   "language": None, "env_vars": None}) as resp:
            assert resp.status_code == 200
            assert resp.headers["content-type"].startswith("application/x-ndjson")
            for line in resp.iter_lines():
                if line:
                    arrivals.append((time.monotonic(), json.loads(line)))
    kinds = [m["type"] for _, m in arrivals]
    assert kinds[0] == "number_of_executions" and kinds[-1] == "end_of_execution"
    assert kinds.count("end_of_execution") == 1
    first = next(t for t, m in arrivals if m.get("text") == "first\n")
    second = next(t for t, m in arrivals if m.get("text") == "second\n")
    assert second - first > 1.0  # streamed, not buffered to the end
    stdout = [m for _, m in arrivals if m["type"] == "stdout"]
    assert all(isinstance(m["timestamp"], str) and m["timestamp"] for m in stdout)
    [result] = [m for _, m in arrivals if m["type"] == "result"]
    assert result == {"type": "result", "text": "42", "is_main_result": True}

    models = pytest.importorskip("e2b_code_interpreter.models")
    execution = models.Execution()
    for _, msg in arrivals:
        models.parse_output(execution, json.dumps(msg))
    assert execution.text == "42" and execution.logs.stdout == ["first\n", "second\n"]
    assert execution.execution_count == arrivals[0][1]["execution_count"]


def test_one_execution_at_a_time_per_context(server: Server) -> None:
    """Two requests on one context: the second runs after the first, and each stream carries only its own output."""
    with httpx.Client(base_url=server.url, timeout=60) as c:
        ctx = c.post("/contexts", json={}).json()
        outputs: dict[str, list[dict]] = {}

        def run(name: str, code: str) -> None:
            with c.stream("POST", "/execute", json={"code": code, "context_id": ctx["id"]}) as resp:
                outputs[name] = [json.loads(line) for line in resp.iter_lines() if line]

        slow = "import time\nprint('a1', flush=True)\ntime.sleep(1)\nprint('a2')"
        first = threading.Thread(target=run, args=("a", slow))
        first.start()
        time.sleep(0.3)
        run("b", "print('b')")
        first.join()
        c.delete(f"/contexts/{ctx['id']}")
    texts = {k: [m["text"] for m in v if m["type"] == "stdout"] for k, v in outputs.items()}
    assert texts == {"a": ["a1\n", "a2\n"], "b": ["b\n"]}
    count = {k: [m["execution_count"] for m in v if m["type"] == "number_of_executions"] for k, v in outputs.items()}
    assert count == {"a": [1], "b": [2]}


def test_bad_requests(server: Server) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as c:
        r = c.post("/execute", json={"code": "1", "language": "r"})
        assert r.status_code == 400 and "not supported" in r.text
        r = c.post("/execute", json={"code": "1", "language": "python", "context_id": "x"})
        assert r.status_code == 400 and "Only one of" in r.text
        assert c.post("/execute", json={"language": "python"}).status_code == 400
        assert c.post("/execute", json={"code": "1", "env_vars": {"A": 1}}).status_code == 400
        assert c.post("/execute", content=b"not json").status_code == 400
        r = c.post("/execute", json={"code": "1", "context_id": "no-such-context"})
        assert r.status_code == 404 and r.text == "Context no-such-context not found"
        r = c.post("/contexts", json={"language": "javascript"})
        assert r.status_code == 400 and "javascript" in r.text
        assert c.post("/contexts", json={"cwd": "/no/such/dir"}).status_code == 400
        assert c.delete("/contexts/no-such-context").status_code == 404
        assert c.post("/contexts/no-such-context/restart").status_code == 404
        health = c.get("/health")
        assert health.status_code == 200 and health.json() == "OK"
        assert c.options("/execute").status_code == 204  # CORS preflight (the JS SDK in a browser)


def test_default_context_comes_back(server: Server) -> None:
    """Deleting the default context is allowed (as on E2B); the next execution without a context gets a new one."""
    with httpx.Client(base_url=server.url, timeout=60) as c:
        c.post("/execute", json={"code": "marker = 1"}).raise_for_status()
        default_id = c.get("/contexts").json()[0]["id"]
        assert c.delete(f"/contexts/{default_id}").status_code == 204
        lines = [json.loads(x) for x in c.post("/execute", json={"code": "'marker' in globals()"}).text.splitlines()]
        assert {"type": "result", "text": "False", "is_main_result": True} in lines
        contexts = c.get("/contexts").json()
        assert default_id not in {x["id"] for x in contexts}
        assert [x["cwd"] for x in contexts] == [str(server.home)]


def test_runs_on_debian_python3_from_unpacked_wheels(unpacked_site: Path, tmp_path: Path) -> None:
    """The guest's way without pip: Debian's own python3 (no venv, nothing installed), the wheels on PYTHONPATH."""
    debian = Path("/usr/bin/python3")
    probe = subprocess.run([str(debian), "-c", "import sys; print(sys.version_info[:2] == (3, 11))"],
                           capture_output=True, text=True, check=False) if debian.exists() else None  # fmt: skip
    if probe is None or probe.stdout.strip() != "True":
        pytest.skip("no Debian python3 3.11 at /usr/bin/python3")
    srv = start_server(debian, tmp_path, site=unpacked_site)
    try:
        code = "import sys, zmq, ipykernel\nprint(sys.executable, ipykernel.__file__)\n6 * 7"
        resp = httpx.post(f"{srv.url}/execute", json={"code": code}, timeout=60)
        lines = [json.loads(x) for x in resp.text.splitlines() if x]
        [out] = [m["text"] for m in lines if m["type"] == "stdout"]
        executable, ipykernel_file = out.split()
        assert Path(executable) == debian and Path(ipykernel_file).is_relative_to(unpacked_site)
        assert {"type": "result", "text": "42", "is_main_result": True} in lines
    finally:
        srv.stop()
    assert not [p for p in srv.kernels_seen if _alive(p)]


# ---- process hygiene -----------------------------------------------------------------------------------------------


def test_no_kernel_outlives_the_server(guest_python: Path, tmp_path: Path) -> None:
    """SIGTERM stops every kernel; after a SIGKILL of the server, its kernels notice and exit on their own."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        tmp = tmp_path / sig.name
        tmp.mkdir()
        srv = start_server(guest_python, tmp)
        try:
            httpx.post(f"{srv.url}/contexts", json={}, timeout=60).raise_for_status()
            kernels = srv.note_kernels()
            assert len(kernels) == 2
            srv.proc.send_signal(sig)
            srv.proc.wait(20)
            deadline = time.monotonic() + 15
            while any(_alive(p) for p in kernels) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert not [p for p in kernels if _alive(p)], f"kernels alive after {sig.name} of the server"
        finally:
            srv.stop()

