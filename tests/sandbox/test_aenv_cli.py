"""The ``aenv`` client CLI against a real node, as a person at a terminal uses it: an interactive shell in a
real pseudo-terminal (prompt, resize, Ctrl-C, exit status), exec with both streams and the exit code, a
directory tree up and back, and the lifecycle, snapshot and fork commands with their JSON output."""

from __future__ import annotations

import fcntl
import json
import os
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from .conftest import NodeProcess

pytestmark = pytest.mark.vm

ROOT = Path(__file__).resolve().parents[2]


def _env(node: NodeProcess) -> dict[str, str]:
    sdk = node.sdk_env()
    return {**os.environ, "AENV_URL": sdk["E2B_API_URL"], "AENV_API_KEY": sdk["E2B_API_KEY"],
            "XDG_CONFIG_HOME": "/nonexistent-aenv-test"}


def aenv(node: NodeProcess, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "aenv_node.cli.client", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=_env(node))


def _set_size(fd: int, rows: int, cols: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


class Terminal:
    """``aenv`` in a pseudo-terminal of its own (its controlling terminal, as in a real shell session)."""

    def __init__(self, node: NodeProcess, *args: str, rows: int = 30, cols: int = 100) -> None:
        self.master, slave = os.openpty()
        _set_size(slave, rows, cols)

        def make_controlling() -> None:
            os.setsid()
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)

        self.proc = subprocess.Popen([sys.executable, "-m", "aenv_node.cli.client", *args], stdin=slave,
                                     stdout=slave, stderr=slave, cwd=ROOT, env=_env(node),
                                     preexec_fn=make_controlling, close_fds=True)
        os.close(slave)
        self.seen = b""

    def send(self, data: str) -> None:
        os.write(self.master, data.encode())

    def expect(self, text: str, timeout: float = 120) -> str:
        deadline = time.monotonic() + timeout
        while text.encode() not in self.seen:
            left = deadline - time.monotonic()
            assert left > 0, f"{text!r} not seen; the terminal shows:\n{self.seen[-2000:].decode(errors='replace')}"
            ready, _, _ = select.select([self.master], [], [], min(left, 1))
            if ready:
                try:
                    chunk = os.read(self.master, 65536)
                except OSError:  # the other side closed
                    chunk = b""
                if not chunk and self.proc.poll() is not None:
                    raise AssertionError(f"aenv exited ({self.proc.returncode}) before {text!r}:\n"
                                         f"{self.seen[-2000:].decode(errors='replace')}")
                self.seen += chunk
        out = self.seen.decode(errors="replace")
        self.seen = self.seen[self.seen.index(text.encode()) + len(text):]
        return out

    def resize(self, rows: int, cols: int) -> None:
        _set_size(self.master, rows, cols)  # the kernel signals SIGWINCH to the terminal's foreground group

    def wait(self, timeout: float = 60) -> int:
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None:
            assert time.monotonic() < deadline, self.seen[-2000:]
            ready, _, _ = select.select([self.master], [], [], 0.5)
            if ready:
                try:
                    self.seen += os.read(self.master, 65536)
                except OSError:
                    pass
        os.close(self.master)
        return self.proc.returncode


def test_start_attaches_a_shell_with_resize_ctrl_c_and_its_exit_status(sdk_env: NodeProcess) -> None:
    term = Terminal(sdk_env, "start", "base")
    sid = None
    try:
        sid = term.expect("; attaching").rsplit("sandbox ", 1)[1].split(" ", 1)[0]
        term.expect("$ ")  # the prompt: a person types after it (bash drops what came before its line editor)
        term.send("echo $((6*7))-answer\r")
        term.expect("42-answer")
        term.send("stty size\r")
        term.expect("30 100")
        term.resize(45, 132)
        time.sleep(1)
        term.send("stty size\r")
        term.expect("45 132")
        term.send("sleep 100\r")
        time.sleep(2)
        term.send("\x03")  # Ctrl-C goes to the guest's foreground job, not to aenv
        term.send("echo still-$((1+1))\r")
        term.expect("still-2", timeout=30)
        term.send("exit 3\r")
        assert term.wait() == 3
    finally:
        if term.proc.poll() is None:
            term.proc.kill()
        if sid is not None:  # start without -d leaves the sandbox running (until its timeout)
            aenv(sdk_env, "rm", sid)


def test_exec_streams_both_outputs_and_exits_with_the_commands_code(sdk_env: NodeProcess) -> None:
    r = aenv(sdk_env, "start", "base", "-d")
    assert r.returncode == 0, r.stderr
    sid = r.stdout.strip()
    try:
        r = aenv(sdk_env, "exec", sid, "--", "sh", "-c", "echo out; echo err >&2; exit 7")
        assert (r.returncode, r.stdout, r.stderr) == (7, "out\n", "err\n")
        r = aenv(sdk_env, "exec", sid, "--env", "GREETING=hi", "--cwd", "/tmp", "--", "sh", "-c", "echo $GREETING; pwd")
        assert (r.returncode, r.stdout) == (0, "hi\n/tmp\n"), r.stderr
        r = aenv(sdk_env, "exec", "sb-nope", "--", "true")
        assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    finally:
        aenv(sdk_env, "rm", sid)


def test_a_directory_tree_uploaded_and_downloaded_is_identical(sdk_env: NodeProcess, tmp_path: Path) -> None:
    src = tmp_path / "tree"
    (src / "a" / "b").mkdir(parents=True)
    (src / "top.txt").write_text("top\n")
    (src / "a" / "mid.bin").write_bytes(os.urandom(3 << 20))
    (src / "a" / "b" / "deep name.txt").write_text("deep\n")
    (src / "link").symlink_to("top.txt")
    r = aenv(sdk_env, "start", "base", "-d")
    assert r.returncode == 0, r.stderr
    sid = r.stdout.strip()
    try:
        r = aenv(sdk_env, "upload", sid, str(src), "/home/user/tree")
        assert r.returncode == 0, r.stderr
        back = tmp_path / "back"
        r = aenv(sdk_env, "download", sid, "/home/user/tree", str(back))
        assert r.returncode == 0, r.stderr
        d = subprocess.run(["diff", "-r", "--no-dereference", str(src), str(back)], capture_output=True, text=True)
        assert d.returncode == 0, d.stdout + d.stderr
        one = tmp_path / "one.txt"
        r = aenv(sdk_env, "download", sid, "/home/user/tree/top.txt", str(one))
        assert r.returncode == 0 and one.read_text() == "top\n", r.stderr
    finally:
        aenv(sdk_env, "rm", sid)


def test_lifecycle_snapshot_and_fork_commands(sdk_env: NodeProcess) -> None:
    r = aenv(sdk_env, "start", "base", "-d", "--metadata", "who=cli-test", "--timeout", "600")
    assert r.returncode == 0, r.stderr
    sid = r.stdout.strip()
    try:
        listed = json.loads(aenv(sdk_env, "ls", "--metadata", "who=cli-test", "--json").stdout)
        assert [s.get("sandboxID") for s in listed] == [sid]
        assert sid in aenv(sdk_env, "ls").stdout  # the table
        assert aenv(sdk_env, "exec", sid, "--", "sh", "-c", "echo kept > /home/user/k").returncode == 0
        assert aenv(sdk_env, "pause", sid).returncode == 0
        paused = json.loads(aenv(sdk_env, "ls", "--state", "paused", "--json").stdout)
        assert sid in [s.get("sandboxID") for s in paused]
        assert aenv(sdk_env, "resume", sid, "--timeout", "600").returncode == 0
        assert aenv(sdk_env, "timeout", sid, "900").returncode == 0
        r = aenv(sdk_env, "snapshot", "create", sid, "--name", "cli-snap", "--json")
        assert r.returncode == 0, r.stderr
        snap = json.loads(r.stdout)
        snap_id = snap.get("snapshotID") or snap.get("snapshot_id")
        assert snap_id in aenv(sdk_env, "snapshot", "ls", "--sandbox-id", sid).stdout
        r = aenv(sdk_env, "fork", sid, "--count", "2")
        assert r.returncode == 0, r.stderr
        children = r.stdout.split()
        assert len(children) == 2
        for child in children:
            c = aenv(sdk_env, "exec", child, "--", "cat", "/home/user/k")
            assert c.stdout == "kept\n", c.stderr
        r = aenv(sdk_env, "rm", children[0], "sb-nope", children[1])  # every id is tried; one failed: exit 1
        assert (r.returncode, r.stdout.split()) == (1, children), r
        assert r.stderr.startswith("sb-nope: ") and len(r.stderr.splitlines()) == 1, r.stderr
        assert aenv(sdk_env, "snapshot", "rm", snap_id).returncode == 0
        events = aenv(sdk_env, "events", "--sandbox", sid, "--json")
        ops = {json.loads(line).get("operation") for line in events.stdout.splitlines()}  # one event per line
        assert {"create", "pause", "resume", "snapshot", "fork"} <= ops, ops
        r = aenv(sdk_env, "pause", "sb-nope")
        assert r.returncode == 1 and r.stderr.startswith("Error: ") and len(r.stderr.splitlines()) == 1
        assert "404" in r.stderr and "sb-nope" in r.stderr, r.stderr
    finally:
        aenv(sdk_env, "rm", sid)
