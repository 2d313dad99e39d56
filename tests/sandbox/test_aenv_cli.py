"""The ``aenv`` client CLI against a real node, as a person at a terminal uses it: an interactive shell in tmux
(prompt, resize, Ctrl-C, exit status; after ``start`` and after ``cn`` of a paused sandbox), exec with both streams and the exit code, a
directory tree up and back, and the lifecycle, snapshot and fork commands with their JSON output."""

from __future__ import annotations

import json
import os
import select
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

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


class Tmux:
    """``aenv`` in a tmux session of its own, driven as a person at a terminal drives it: keys typed into the
    pane, the screen read back, the window resized. The command's exit status is written where the test reads
    it, and the pane stays open after it ends."""

    def __init__(self, node: NodeProcess, tmp: Path, *args: str, rows: int = 30, cols: int = 100) -> None:
        self.socket = f"aenv-test-{os.getpid()}-{time.monotonic_ns()}"
        self.status = tmp / "exit-status"
        self.env = _env(node)
        command = " ".join(shlex.quote(a) for a in (sys.executable, "-m", "aenv_node.cli.client", *args))
        self.tmux("new-session", "-d", "-s", "t", "-x", str(cols), "-y", str(rows),
                  f"cd {shlex.quote(str(ROOT))}; {command}; echo $? > {shlex.quote(str(self.status))}; sleep 600")

    def tmux(self, *args: str) -> str:
        r = subprocess.run(["tmux", "-L", self.socket, "-f", "/dev/null", *args], capture_output=True, text=True,
                           env=self.env, timeout=30)
        assert r.returncode == 0, r.stderr
        return r.stdout

    def screen(self) -> str:
        return self.tmux("capture-pane", "-p", "-J", "-t", "t", "-S", "-500")

    def expect(self, text: str, timeout: float = 120, after: int = 0) -> str:
        """Wait until ``text`` shows on the screen (its ``after``-th appearance and later count)."""
        deadline = time.monotonic() + timeout
        while True:
            screen = self.screen()
            if screen.count(text) > after:
                return screen
            assert time.monotonic() < deadline, f"{text!r} not on the screen:\n{screen[-3000:]}"
            time.sleep(0.3)

    def type(self, line: str) -> None:
        self.tmux("send-keys", "-t", "t", "-l", line)
        self.tmux("send-keys", "-t", "t", "Enter")

    def keys(self, *keys: str) -> None:
        self.tmux("send-keys", "-t", "t", *keys)

    def resize(self, rows: int, cols: int) -> None:
        self.tmux("resize-window", "-t", "t", "-x", str(cols), "-y", str(rows))

    def exit_status(self, timeout: float = 60) -> int:
        deadline = time.monotonic() + timeout
        while not self.status.exists() or not self.status.read_text().strip():
            assert time.monotonic() < deadline, f"aenv did not end:\n{self.screen()[-3000:]}"
            time.sleep(0.3)
        return int(self.status.read_text())

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True, env=self.env, timeout=30)


def _shell_session(term: Tmux, *, prompt_seen: int = 0) -> None:
    """What a person does in an attached shell: a sum, the window size before and after a resize, Ctrl-C on a
    sleep, and ``exit 3``."""
    term.expect("$ ", after=prompt_seen)  # the prompt: a person types after it (bash drops earlier typeahead)
    term.type("echo $((6*7))-answer")
    term.expect("42-answer")
    term.type("stty size")
    term.expect("30 100")
    term.resize(45, 132)
    time.sleep(1)
    term.type("stty size")
    term.expect("45 132")
    term.type("sleep 100")
    time.sleep(2)
    term.keys("C-c")  # Ctrl-C goes to the guest's foreground job, not to aenv
    term.type("echo still-$((1+1))")
    term.expect("still-2", timeout=30)
    term.type("exit 3")
    assert term.exit_status() == 3


def test_start_in_tmux_gives_a_shell_with_resize_ctrl_c_and_its_exit_status(sdk_env: NodeProcess,
                                                                            tmp_path: Path) -> None:
    term = Tmux(sdk_env, tmp_path, "start", "base")
    sid = None
    try:
        screen = term.expect("; attaching")
        sid = screen.split("; attaching")[0].rsplit("sandbox ", 1)[1].split(" ", 1)[0]
        _shell_session(term)
        # the sandbox outlives its shell
        assert sid in [s["sandboxID"] for s in json.loads(aenv(sdk_env, "ls", "--json").stdout)]
    finally:
        term.close()
        if sid is not None:
            aenv(sdk_env, "rm", sid)


def test_cn_resumes_a_paused_sandbox_and_attaches_its_shell(sdk_env: NodeProcess, tmp_path: Path) -> None:
    r = aenv(sdk_env, "start", "base", "-d")
    assert r.returncode == 0, r.stderr
    sid = r.stdout.strip()
    term = None
    try:
        assert aenv(sdk_env, "exec", sid, "--", "sh", "-c", "echo before-pause > /home/user/mark").returncode == 0
        assert aenv(sdk_env, "pause", sid).returncode == 0
        assert [s["state"] for s in json.loads(aenv(sdk_env, "ls", "--json").stdout) if s["sandboxID"] == sid] == [
            "paused"]
        term = Tmux(sdk_env, tmp_path, "cn", sid)
        term.expect("$ ")
        term.type("cat ~/mark")
        term.expect("before-pause")
        _shell_session(term, prompt_seen=1)
        assert [s["state"] for s in json.loads(aenv(sdk_env, "ls", "--json").stdout) if s["sandboxID"] == sid] == [
            "running"]
        r = aenv(sdk_env, "cn", "sb-nope")
        assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1 and "sb-nope" in r.stderr, r.stderr
    finally:
        if term is not None:
            term.close()
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


class Follower:
    """A long-running ``aenv ... --follow``: its stdout read line by line as it comes."""

    def __init__(self, node: NodeProcess, *args: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "aenv_node.cli.client", *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, cwd=ROOT, env=_env(node))
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self.out, self.err = self.proc.stdout.fileno(), self.proc.stderr
        self.lines: list[str] = []
        self._buf = b""

    def until(self, predicate: Any, what: str, timeout: float = 60) -> list[str]:
        deadline = time.monotonic() + timeout
        while not any(predicate(line) for line in self.lines):
            assert time.monotonic() < deadline, f"no {what} in:\n" + "\n".join(self.lines[-50:])
            ready, _, _ = select.select([self.out], [], [], 0.5)
            if not ready:
                continue
            chunk = os.read(self.out, 65536)
            assert chunk, f"{self.proc.args} ended: {self.err.read().decode(errors='replace')}"
            *done, self._buf = (self._buf + chunk).split(b"\n")
            self.lines += [ln.decode() for ln in done]
        return self.lines

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def _root_console(node: NodeProcess, sid: str, text: str) -> None:
    r = aenv(node, "exec", sid, "--user", "root", "--", "sh", "-c", f"echo {text} > /dev/console")
    assert r.returncode == 0, r.stderr


def test_logs_follow_the_console_across_pause_and_resume_and_events_follow_the_lifecycle(
        sdk_env: NodeProcess) -> None:
    r = aenv(sdk_env, "start", "base", "-d")
    assert r.returncode == 0, r.stderr
    sid = r.stdout.strip()
    logs = Follower(sdk_env, "logs", sid, "--follow")
    events = Follower(sdk_env, "events", "--sandbox", sid, "--follow", "--json")
    try:
        _root_console(sdk_env, sid, "first-marker")
        logs.until(lambda ln: ln.endswith(" console first-marker"), "first marker")
        assert aenv(sdk_env, "pause", sid).returncode == 0
        events.until(lambda ln: json.loads(ln).get("toState") == "paused", "pause event")
        assert aenv(sdk_env, "resume", sid).returncode == 0
        _root_console(sdk_env, sid, "second-marker")
        lines = logs.until(lambda ln: ln.endswith(" console second-marker"), "second marker (after a resume)")
        ops = [(e.get("operation"), e.get("toState")) for e in map(json.loads, events.until(
            lambda ln: json.loads(ln).get("operation") == "resume" and json.loads(ln).get("toState") == "running",
            "resume event"))]
        assert ops[0] == ("create", "creating") and ("pause", "paused") in ops, ops
        # every line once, in order: the markers, and envd's record of the process that wrote each
        printed = [ln.split(None, 3)[3] for ln in lines if ln.split(None, 3)[2] == "console"]
        assert printed.count("first-marker") == 1 and printed.count("second-marker") == 1, lines
        assert len(lines) == len(set(lines)), lines
        started = [ln for ln in lines if "started process" in ln and "marker" in ln]
        assert len(started) == 2 and all(" envd " in ln and " info " in ln for ln in started), lines
        # the same lines through the route, filtered; and a killed sandbox's logs stay readable
        assert aenv(sdk_env, "rm", sid).returncode == 0
        r = aenv(sdk_env, "logs", sid, "--search", "MARKER", "--json")
        found = [json.loads(ln) for ln in r.stdout.splitlines()]
        assert r.returncode == 0 and {e["fields"]["source"] for e in found} == {"console", "envd"}, r
        assert [e["message"] for e in found if e["fields"]["source"] == "console"] == ["first-marker",
                                                                                     "second-marker"]
        assert sdk_env.sql(f"SELECT count(*) FROM sandbox_logs WHERE sandbox_id = '{sid}' "
                           "AND message LIKE '%marker%'") == [(4,)]
        r = aenv(sdk_env, "logs", "sb-nope")
        assert r.returncode == 1 and "404" in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr
    finally:
        logs.stop()
        events.stop()
        aenv(sdk_env, "rm", sid)


def test_start_with_another_size_builds_a_derived_template_once(sdk_env: NodeProcess) -> None:
    sids: list[str] = []
    try:
        for attempt in range(2):
            r = aenv(sdk_env, "start", "base", "-d", "--cpu", "1", "--mem", "768", timeout=900)
            assert r.returncode == 0, r.stderr
            sids.append(r.stdout.strip())
            assert ("building base-1cpu-768mb:" in r.stderr) == (attempt == 0), r.stderr  # the second finds it
        listed = {s["sandboxID"]: s for s in json.loads(aenv(sdk_env, "ls", "--json").stdout)}
        assert [(listed[sid]["cpuCount"], listed[sid]["memoryMB"]) for sid in sids] == [(1, 768)] * 2
        r = aenv(sdk_env, "exec", sids[1], "--", "sh", "-c", "nproc; grep MemTotal /proc/meminfo")
        nproc, meminfo = r.stdout.splitlines()
        assert nproc == "1" and 600_000 < int(meminfo.split()[1]) <= 768 * 1024, r.stdout
        r = aenv(sdk_env, "start", "base", "-d", "--cpu", "2", "--mem", "512")  # base's own size: no build
        assert r.returncode == 0 and "building" not in r.stderr, r.stderr
        sids.append(r.stdout.strip())
        r = aenv(sdk_env, "start", "no-such-template", "-d", "--cpu", "2")
        assert r.returncode == 1 and "404" in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr
    finally:
        if sids:
            aenv(sdk_env, "rm", *sids)
        aenv(sdk_env, "template", "rm", "base-1cpu-768mb")
