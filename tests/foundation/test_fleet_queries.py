"""Queries that must not grow with the number of sandboxes (bench/fleet_state.py: 10,000 paused on one node).

Their plans are checked here, since a plan that sorts or scans every row is fast in a test's small database
and only slow at fleet scale: the listing's page reads the order index from its token on, and the collector's
refcount looks up the memory base layer by index. Migration 0007 adds both indexes to an existing database.
"""

from __future__ import annotations

import datetime as dt
import random
import sqlite3
from pathlib import Path

from sqlalchemy.dialects import sqlite as sqlite_dialect

from aenv_node.api.handlers.sandboxes import decode_token, page_query
from aenv_node.snapshot.gc import _REFCOUNT_SQL
from aenv_node.state import Database, Sandbox, SandboxState, utcnow
from aenv_node.state import repository as repo


def _plan(db: Database, sql: str) -> str:
    con = sqlite3.connect(db.path)
    try:
        return " | ".join(r[3] for r in con.execute("EXPLAIN QUERY PLAN " + sql))
    finally:
        con.close()


def _compiled(q: object) -> str:
    """The statement as the node sends it, its parameters written in (as the column types bind them)."""
    return str(q.compile(dialect=sqlite_dialect.dialect(),  # type: ignore[attr-defined]
                         compile_kwargs={"literal_binds": True}))


def test_a_page_reads_the_order_index_from_its_token(db: Database) -> None:
    after = (utcnow(), "sbX")
    for order in ("asc", "desc"):
        for states in (("running", "paused"), ("running",), ("paused",)):
            sql = _compiled(page_query(states, order=order, after=after, limit=101))
            assert "Z', 'sbX')" in sql  # the token's time bound as the column stores it (ISO text, ms, Z)
            plan = _plan(db, sql)
            assert "ix_sandboxes_started_at_id" in plan, plan
            assert "TEMP B-TREE" not in plan, plan  # nothing sorted
            assert "ix_sandboxes_state" not in plan, plan


def test_the_gc_refcount_looks_up_memory_base_layers_by_index(db: Database) -> None:
    plan = _plan(db, _REFCOUNT_SQL)
    assert "ix_snapshots_memory_base_layer" in plan, plan
    assert "SCAN s" not in plan.replace("SCAN sl", ""), plan  # no scan of snapshots per layer


def test_migration_0007_adds_the_indexes_to_a_database_with_rows(tmp_path: Path) -> None:
    d = Database(tmp_path / "aenv.db")
    d.upgrade("0006")
    with d.session() as s:
        repo.insert_sandbox(s, Sandbox(id="sbOld", template_id="base", started_at=utcnow(), end_at=utcnow()))

    def indexes(table: str) -> set[str]:
        con = sqlite3.connect(d.path)
        try:
            return {r[1] for r in con.execute(f"PRAGMA index_list({table})")}
        finally:
            con.close()

    assert "ix_sandboxes_started_at_id" not in indexes("sandboxes")
    d.upgrade()
    assert "ix_sandboxes_started_at_id" in indexes("sandboxes")
    assert "ix_snapshots_memory_base_layer" in indexes("snapshots")
    with d.session() as s:
        assert repo.get_sandbox(s, "sbOld").template_id == "base"
    d.downgrade("0006")
    assert "ix_sandboxes_started_at_id" not in indexes("sandboxes")
    assert "ix_snapshots_memory_base_layer" not in indexes("snapshots")
    d.close()


async def test_pages_list_every_sandbox_once_in_order_with_ties_and_hidden_ones(live_node) -> None:
    """Many sandboxes started in the same millisecond, killed ones among them: walked in pages of 7 both ways
    (the token's row value and its timestamp binding), every listed sandbox comes once, in order."""
    rnd = random.Random(5)
    t0 = utcnow().replace(microsecond=0) - dt.timedelta(hours=1)
    listed: list[tuple[dt.datetime, str]] = []
    with live_node.node.db.session() as s:
        for i in range(60):
            sid = f"sb{rnd.randrange(10**6):06d}{i:02d}"
            started = t0 + dt.timedelta(milliseconds=rnd.choice((0, 0, 1, 2)) + 10 * (i // 9))
            repo.insert_sandbox(s, Sandbox(id=sid, template_id="base", started_at=started,
                                           end_at=started + dt.timedelta(minutes=5), metadata_={"k": str(i % 2)}))
            repo.transition(s, sid, SandboxState.RUNNING, operation="create")
            if i % 5 == 0:
                repo.transition(s, sid, SandboxState.KILLING, operation="kill")
                repo.transition(s, sid, SandboxState.KILLED, operation="kill")
            else:
                listed.append((started, sid))
    listed.sort()

    async def walk(params: dict[str, str]) -> list[str]:
        seen: list[str] = []
        async with live_node.client() as c:
            q = dict(params)
            while True:
                r = await c.get("/v2/sandboxes", params=q)
                assert r.status_code == 200, r.text
                seen += [x["sandboxID"] for x in r.json()]
                token = r.headers.get("x-next-token")
                if token is None:
                    return seen
                assert decode_token(token)[1] == seen[-1]
                q = {**params, "nextToken": token}

    assert await walk({"limit": "7"}) == [sid for _, sid in listed]
    assert await walk({"limit": "7", "order": "desc"}) == [sid for _, sid in reversed(listed)]
    odd = [sid for _, sid in listed if int(sid[-2:]) % 2]
    assert await walk({"limit": "7", "metadata": "k=1"}) == odd


def test_a_start_at_the_head_migrates_nothing(tmp_path: Path) -> None:
    """Every node start upgrades; at the head that is a no-op that must not run the migration step (its
    foreign-key check reads every referencing row: seconds with a fleet's rows)."""
    import pytest

    d = Database(tmp_path / "aenv.db")
    d.upgrade()
    assert d.current_revision() == d.head_revision() is not None

    def no_step(*args: object) -> None:
        raise AssertionError("migrated a database at the head")

    mp = pytest.MonkeyPatch()
    mp.setattr(d, "_migrate", no_step)
    try:
        d.upgrade()
    finally:
        mp.undo()
    d.downgrade("0006")
    d.upgrade()  # not at the head: migrated
    assert d.current_revision() == d.head_revision()
    d.close()
