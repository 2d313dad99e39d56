"""A sandbox's logs without a VM: the console reader on a real file, the store on real SQLite (bound, cursor,
level and search filters, expiry), and the routes on the real app (E2B's shapes, read back with the E2B SDK's
own generated models)."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest
import trio
from e2b.api.client.models.sandbox_logs import SandboxLogs as SdkLogs
from e2b.api.client.models.sandbox_logs_v2_response import SandboxLogsV2Response as SdkLogsV2
from sqlalchemy import select
from sqlalchemy.orm import Session

from aenv_node.config import LogsSection
from aenv_node.runtime.console_log import ConsoleLog, classify
from aenv_node.state import ConsoleOffset, Database, Sandbox, SandboxLog, SandboxState, utcnow
from aenv_node.state import repository as repo
from aenv_node.state.sandbox_logs import LogLine, append_lines, expire_ended, read_lines, store_console

from ..conftest import LiveNode

T0 = dt.datetime(2026, 12, 2, 12, 0, 0, tzinfo=dt.timezone.utc)


@pytest.fixture
def db(db: Database) -> Database:
    """The migrated database with two sandboxes."""
    with db.session() as s:
        for sid in ("sb1", "sb2"):
            repo.insert_sandbox(s, Sandbox(id=sid, template_id="base"))
    return db


def _messages(rows: list[SandboxLog]) -> list[str]:
    return [r.message for r in rows]


def test_classify_sorts_console_lines_into_e2b_levels() -> None:
    envd = classify("2026-12-02 16:50:01,123 WARNING envd.server: rejected GET /files: bad token", T0)
    assert (envd.source, envd.level, envd.logger, envd.message) == (
        "envd", "warn", "envd.server", "rejected GET /files: bad token")
    err = classify("2026-12-02 16:50:01,123 ERROR envd.connect: unary handler failed", T0)
    tb = classify("Traceback (most recent call last):", T0, err)
    frame = classify('  File "/opt/aenv/x.py", line 3, in f', T0, tb)
    assert (tb.source, tb.level, frame.level, frame.logger) == ("envd", "error", "error", "envd.connect")
    assert classify("[    3.141592] Out of memory: Killed process 42", T0).__dict__ | {} == {
        "ts": T0, "level": "warn", "source": "kernel", "message": "Out of memory: Killed process 42", "logger": None}
    assert (classify("aenv: envd ready", T0).source, classify("aenv: envd ready", T0).level) == ("init", "info")
    assert classify("aenv: envd exited with status 1; restarting (1)", T0).level == "error"
    plain = classify("hello from a root process", T0)
    assert (plain.source, plain.level) == ("console", "info")
    # a plain line after an envd error is not taken for its traceback
    assert classify("hello", T0, err).source == "console"


def test_the_store_keeps_the_newest_lines_and_reads_by_cursor_level_and_search(db: Database) -> None:
    lines = [LogLine(T0 + dt.timedelta(milliseconds=i), ("info", "warn", "error", "debug")[i % 4], "console",
                     f"line {i} {'Needle_%' if i % 5 == 0 else ''}".strip()) for i in range(30)]
    with db.session() as s:
        assert append_lines(s, "sb1", lines[:20], keep=25) == 0
        assert append_lines(s, "sb1", lines[20:], keep=25) == 5  # the five oldest go
        append_lines(s, "sb2", [LogLine(T0, "info", "console", "other sandbox")], keep=25)
    with db.session() as s:
        everything = read_lines(s, "sb1", cursor=None, forward=True, limit=1000)
        assert _messages(everything) == [ln.message for ln in lines[5:]]
        at = T0 + dt.timedelta(milliseconds=27)
        assert _messages(read_lines(s, "sb1", cursor=at, forward=True, limit=1000)) == [
            "line 27", "line 28", "line 29"]
        assert _messages(read_lines(s, "sb1", cursor=at, forward=False, limit=2)) == ["line 27", "line 26"]
        assert {r.level for r in read_lines(s, "sb1", cursor=None, forward=True, limit=1000,
                                            min_level="warn")} == {"warn", "error"}
        # search: any case, and % and _ are plain characters
        assert _messages(read_lines(s, "sb1", cursor=None, forward=True, limit=1000, search="needle_%")) == [
            "line 5 Needle_%", "line 10 Needle_%", "line 15 Needle_%", "line 20 Needle_%", "line 25 Needle_%"]
        assert read_lines(s, "sb1", cursor=None, forward=True, limit=1000, search="needle_x") == []
        assert _messages(read_lines(s, "sb2", cursor=None, forward=True, limit=1000)) == ["other sandbox"]


def test_logs_of_ended_sandboxes_expire_and_go_with_their_sandbox(db: Database) -> None:
    with db.session() as s:
        for sid in ("sb1", "sb2"):
            append_lines(s, sid, [LogLine(T0, "info", "console", f"{sid} line")], keep=10)
        repo.transition(s, "sb1", SandboxState.RUNNING, operation="create")
        repo.transition(s, "sb1", SandboxState.KILLING, operation="kill")
        repo.transition(s, "sb1", SandboxState.KILLED, operation="kill")
    with db.session() as s:
        assert expire_ended(s, utcnow() - dt.timedelta(hours=1)) == 0  # ended just now: kept
        assert expire_ended(s, utcnow() + dt.timedelta(seconds=1)) == 1  # sb1's only: sb2 has not ended
    with db.session() as s:
        assert [(r.sandbox_id, r.message) for r in s.scalars(select(SandboxLog))] == [("sb2", "sb2 line")]
        s.delete(s.get(Sandbox, "sb2"))  # a sandbox row that goes takes its lines along (ON DELETE CASCADE)
    with db.session() as s:
        assert list(s.scalars(select(SandboxLog))) == []


def test_the_console_reader_stores_whole_lines_and_reads_to_the_end_when_stopped(db: Database,
                                                                                tmp_path: Path) -> None:
    console = tmp_path / "console.log"
    limits = LogsSection(max_lines_per_sandbox=100, max_line_chars=80, poll_interval_s=0.05)
    reader = ConsoleLog(db, "sb1", console, limits, vmm_pid=41)

    async def main() -> None:
        async with trio.open_nursery() as n:
            n.start_soon(reader.run)
            await trio.sleep(0.2)  # no file yet: nothing, no error
            with open(console, "ab") as f:
                f.write(b"\x1b[0;32mgreen\x1b[0m and \r\n2026-12-02 16:50:01,123 INFO envd.process: started process")
            await trio.sleep(0.3)
            with open(console, "ab") as f:
                f.write(b" 7: sleep\n" + b"x" * 200 + b"\n\n" + "ünïcode ".encode() + b"\xff\n"
                        + b"the last line, without its newline")
            n.cancel_scope.cancel()  # the sandbox stops at once: the reader still reads what was written

    trio.run(main)
    with db.session() as s:
        rows = read_lines(s, "sb1", cursor=None, forward=True, limit=1000)
    assert [(r.source, r.level, r.message) for r in rows] == [
        ("console", "info", "green and"),
        ("envd", "info", "started process 7: sleep"),
        ("console", "info", "x" * 79 + "…"),
        ("console", "info", "ünïcode \ufffd"),
        ("console", "info", "the last line, without its newline"),
    ]
    assert reader.lines_written == 5


def test_a_run_taken_over_reads_on_from_the_last_stored_line(db: Database, tmp_path: Path) -> None:
    """A node killed mid-run left a reader that stored some lines; the next node's reader of the same VMM's
    console (a take-over) stores the rest once, and a new run of the sandbox (another VMM writing a new file at
    the same path) reads its console from the start."""
    (tmp_path / "run").mkdir()
    console = tmp_path / "run" / "console.log"
    limits = LogsSection(max_lines_per_sandbox=100, max_line_chars=80, poll_interval_s=0.05)
    console.write_bytes(b"one\ntwo\npart")
    killed = ConsoleLog(db, "sb1", console, limits, vmm_pid=41)
    trio.run(killed.read_new)  # then the node dies: no final read
    # the offset was committed with the lines it covers (the partial line not), and nothing beside the console
    with db.session() as s:
        row = s.get(ConsoleOffset, "sb1")
        assert row is not None and (row.run, row.bytes_read) == (f"{console}@41", len(b"one\ntwo\n"))
    assert [p.name for p in console.parent.iterdir()] == ["console.log"]
    with open(console, "ab") as f:
        f.write(b"ial\nthree\n")
    trio.run(ConsoleLog(db, "sb1", console, limits, vmm_pid=41, taken_over=True).read_new)
    console.write_bytes(b"new run\n")  # a resume: a new console file, the old offset meaningless
    trio.run(ConsoleLog(db, "sb1", console, limits, vmm_pid=42, taken_over=True).read_new)
    with db.session() as s:
        assert [r.message for r in read_lines(s, "sb1", cursor=None, forward=True, limit=100)] == [
            "one", "two", "partial", "three", "new run"]
        row = s.get(ConsoleOffset, "sb1")
        assert row is not None and (row.run, row.bytes_read) == (f"{console}@42", len(b"new run\n"))


def test_lines_and_their_offset_commit_together(db: Database, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A round whose transaction fails stores neither its lines nor its offset: the next reader stores them."""
    console = tmp_path / "console.log"
    limits = LogsSection(max_lines_per_sandbox=100, max_line_chars=80, poll_interval_s=0.05)
    console.write_bytes(b"one\n")
    trio.run(ConsoleLog(db, "sb1", console, limits, vmm_pid=7).read_new)
    console.write_bytes(b"one\ntwo\n")

    def boom(s: Session, *a: object, **kw: object) -> int:
        store_console(s, *a, **kw)  # type: ignore[arg-type]
        s.flush()
        raise RuntimeError("the transaction fails after the lines and the offset were written")

    reader = ConsoleLog(db, "sb1", console, limits, vmm_pid=7, taken_over=True)
    monkeypatch.setattr("aenv_node.runtime.console_log.store_console", boom)
    with pytest.raises(RuntimeError):
        trio.run(reader.read_new)
    monkeypatch.undo()
    with db.session() as s:
        assert [r.message for r in read_lines(s, "sb1", cursor=None, forward=True, limit=100)] == ["one"]
        row = s.get(ConsoleOffset, "sb1")
        assert row is not None and row.bytes_read == len(b"one\n")
    trio.run(ConsoleLog(db, "sb1", console, limits, vmm_pid=7, taken_over=True).read_new)
    with db.session() as s:
        assert [r.message for r in read_lines(s, "sb1", cursor=None, forward=True, limit=100)] == ["one", "two"]


async def test_the_routes_answer_in_e2b_shapes_and_refuse_bad_queries(live_node: LiveNode) -> None:
    def seed(s: Session) -> None:
        repo.insert_sandbox(s, Sandbox(id="sb1", template_id="base"))
        append_lines(s, "sb1", [LogLine(T0 + dt.timedelta(seconds=i), lvl, "envd", f"m{i}", logger="envd.x")
                                for i, lvl in enumerate(("info", "error", "warn"))], keep=10)

    await live_node.node.db.run(seed)
    ms = int(T0.timestamp() * 1000)
    async with live_node.client() as c:
        r = await c.get("/v2/sandboxes/sb1/logs", params={"cursor": ms + 1000})
        assert r.status_code == 200, r.text
        v2 = SdkLogsV2.from_dict(r.json())  # the E2B SDK's own model of the answer
        assert [(e.message, e.level.value, e.fields["source"], e.fields["logger"]) for e in v2.logs] == [
            ("m1", "error", "envd", "envd.x"), ("m2", "warn", "envd", "envd.x")]
        assert v2.logs[0].timestamp == T0 + dt.timedelta(seconds=1)
        r = await c.get("/v2/sandboxes/sb1/logs", params={"direction": "backward", "level": "warn", "search": "M"})
        assert [e["message"] for e in r.json()["logs"]] == ["m2", "m1"]
        r = await c.get("/sandboxes/sb1/logs", params={"start": ms, "limit": 2})
        v1 = SdkLogs.from_dict(r.json())
        assert [x.line for x in v1.logs] == ["m0", "m1"] and [e.message for e in v1.log_entries] == ["m0", "m1"]
        for query, word in (({"direction": "sideways"}, "direction"), ({"level": "fatal"}, "level"),
                            ({"limit": 0}, "limit"), ({"cursor": "soon"}, "cursor"),
                            ({"search": "x" * 300}, "search")):
            r = await c.get("/v2/sandboxes/sb1/logs", params=query)
            assert r.status_code == 400 and r.json()["code"] == 400 and word in r.json()["message"], (query, r.text)
        r = await c.get("/v2/sandboxes/sb-nope/logs")
        assert r.status_code == 404 and "sb-nope" in r.json()["message"]
