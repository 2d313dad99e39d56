"""The database: migrations up/down, no drift from the models, WAL and foreign keys,
and every sandbox state change written with its event in one transaction."""

from __future__ import annotations

from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import select, text

from aenv_node.state import Base, Database, Event, IllegalTransition, NotFound, Sandbox, SandboxState
from aenv_node.state import repository as repo

TABLES = {
    "templates", "template_builds", "sandboxes", "snapshots", "snapshot_layers", "layers",
    "cache_entries", "network_slots", "nodes", "events",
}



def test_upgrade_creates_tables_and_downgrade_drops_them(tmp_path: Path) -> None:
    d = Database(tmp_path / "aenv.db")
    assert d.current_revision() is None
    d.upgrade()
    assert TABLES <= set(d.table_names())
    assert d.current_revision() is not None
    d.downgrade("base")
    assert set(d.table_names()) <= {"alembic_version"}
    d.upgrade()
    assert TABLES <= set(d.table_names())


def test_models_and_migrations_do_not_drift(db: Database) -> None:
    with db.engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"compare_type": True})
        diff = compare_metadata(ctx, Base.metadata)
    assert diff == []


def test_wal_and_foreign_keys_are_on(db: Database) -> None:
    with db.engine.connect() as conn:
        assert conn.execute(text("PRAGMA journal_mode")).scalar() == "wal"
        assert conn.execute(text("PRAGMA foreign_keys")).scalar() == 1


def _new(db: Database, sid: str = "sb1") -> None:
    with db.session() as s:
        repo.insert_sandbox(s, Sandbox(id=sid, template_id="base"))


def _events(db: Database, sid: str) -> list[tuple[str, str | None, str | None]]:
    with db.session() as s:
        rows = s.scalars(select(Event).where(Event.sandbox_id == sid).order_by(Event.id))
        return [(e.operation, e.from_state, e.to_state) for e in rows]


def test_transition_writes_state_and_event_together(db: Database) -> None:
    _new(db)
    with db.session() as s:
        repo.transition(s, "sb1", SandboxState.RUNNING, operation="create", duration_ms=12.5,
                        vmm_pid=1234)
    with db.session() as s:
        sb = s.get(Sandbox, "sb1")
        assert sb.state == "running" and sb.vmm_pid == 1234
    assert _events(db, "sb1") == [("create", None, "creating"), ("create", "creating", "running")]


def test_illegal_transition_changes_nothing(db: Database) -> None:
    _new(db)
    with pytest.raises(IllegalTransition, match="cannot resume sandbox sb1: it is creating"):
        with db.session() as s:
            repo.transition(s, "sb1", SandboxState.RESUMING, operation="resume")
    with db.session() as s:
        assert s.get(Sandbox, "sb1").state == "creating"
    assert len(_events(db, "sb1")) == 1


def test_failure_after_transition_rolls_back_state_and_event(db: Database) -> None:
    _new(db)
    with pytest.raises(RuntimeError):
        with db.session() as s:
            repo.transition(s, "sb1", SandboxState.RUNNING, operation="create")
            raise RuntimeError("VMM died before the transaction committed")
    with db.session() as s:
        assert s.get(Sandbox, "sb1").state == "creating"
    assert _events(db, "sb1") == [("create", None, "creating")]


def test_killed_sandbox_is_not_found_and_cannot_come_back(db: Database) -> None:
    _new(db)
    with db.session() as s:
        repo.transition(s, "sb1", SandboxState.KILLED, operation="kill")
    with db.session() as s:
        with pytest.raises(NotFound):
            repo.get_sandbox(s, "sb1")
        with pytest.raises(IllegalTransition):
            repo.transition(s, "sb1", SandboxState.RUNNING, operation="resume")


def test_expect_narrows_transitions(db: Database) -> None:
    _new(db)
    with db.session() as s:
        repo.transition(s, "sb1", SandboxState.RUNNING, operation="create")
    with pytest.raises(IllegalTransition):
        with db.session() as s:
            repo.transition(s, "sb1", SandboxState.KILLING, operation="kill",
                            expect=[SandboxState.PAUSED])


def test_timestamps_are_iso8601_utc_text(db: Database) -> None:
    _new(db)
    with db.engine.connect() as conn:
        started = conn.execute(text("SELECT started_at FROM sandboxes")).scalar()
        age = conn.execute(text("SELECT julianday('now') - julianday(started_at) FROM sandboxes")).scalar()
    assert started.endswith("Z") and "T" in started and len(started) == 24
    assert 0 <= age < 0.01
