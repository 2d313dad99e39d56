"""The node's SQLite database: engine set-up, sessions and migrations.

SQLite is the truth (DESIGN.md). Every connection runs in WAL mode with foreign
keys on and a busy timeout, so the node, the CLI and a person running
``sqlite3 aenv.db`` can all read while the node writes. A write that waits out
the busy timeout (another connection holds the write lock: a person's open
``BEGIN IMMEDIATE``, a backup) raises ``DatabaseBusy``, which the API answers
with 503: the transaction rolled back whole, so nothing of it is kept.

Sessions are synchronous SQLAlchemy sessions; async code calls them through
``trio.to_thread.run_sync`` (see ``Database.run``), with one bounded limiter so
SQLite never sees more writers than it can serialise.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Callable, Concatenate, Iterator, ParamSpec, TypeVar

import trio
from alembic import command
from sqlalchemy import Engine, create_engine, event, inspect
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from .errors import DatabaseBusy

__all__ = ["Database", "migrations_dir", "alembic_config", "BUSY_TIMEOUT_MS"]

#: how long a connection waits for another's write lock before ``DatabaseBusy``
BUSY_TIMEOUT_MS = 10_000

T = TypeVar("T")
P = ParamSpec("P")


def migrations_dir() -> Path:
    """Where the Alembic history lives: ``migrations/`` at the project root.

    ``AENV_MIGRATIONS_DIR`` overrides it (for installs that move it elsewhere).
    """
    env = os.environ.get("AENV_MIGRATIONS_DIR")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / "migrations"


def alembic_config(url: str) -> Any:
    from alembic.config import Config as AlembicConfig

    cfg = AlembicConfig()
    cfg.set_main_option("script_location", str(migrations_dir()))
    cfg.set_main_option("sqlalchemy.url", url)
    return cfg


def _on_connect(dbapi_conn: Any, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.close()


class Database:
    """One SQLite file, its engine and its session factory."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.url = f"sqlite:///{self.path}"
        self.engine: Engine = create_engine(self.url, future=True)
        event.listen(self.engine, "connect", _on_connect)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        self._limiter = trio.CapacityLimiter(4)

    # -- migrations -------------------------------------------------------
    def upgrade(self, revision: str = "head") -> None:
        """Migrate up to ``revision``. A database already at the head is left alone: every node start calls this,
        and the migration step ends with ``PRAGMA foreign_key_check``, which reads every referencing row (a
        second or more of a node's start with 10,000 sandboxes and their snapshots, for nothing to migrate)."""
        if revision == "head" and self.path.exists() and self.current_revision() == self.head_revision():
            return
        self._migrate(command.upgrade, revision)

    def head_revision(self) -> str | None:
        """The newest revision of the Alembic history (``migrations/``)."""
        from alembic.script import ScriptDirectory

        return ScriptDirectory.from_config(alembic_config(self.url)).get_current_head()

    def downgrade(self, revision: str = "base") -> None:
        self._migrate(command.downgrade, revision)

    def _migrate(self, step: Callable[[Any, str], None], revision: str) -> None:
        """Run an Alembic step with foreign keys off: SQLite alters a table by copying it into a new one and
        dropping the old, and with foreign keys on that drop would cascade into every referencing row
        (``snapshot_layers`` rows deleted, ``sandboxes.snapshot_id`` set NULL). The pragma only takes effect
        outside a transaction, so it is set before the migration's transaction begins, and the references
        are checked before foreign keys are turned back on."""
        with self.engine.connect() as conn:
            conn.exec_driver_sql("PRAGMA foreign_keys=OFF")
            conn.commit()  # SQLAlchemy began its transaction object; SQLite ran the pragma outside one
            try:
                with conn.begin():
                    cfg = alembic_config(self.url)
                    cfg.attributes["connection"] = conn
                    step(cfg, revision)
                    broken = conn.exec_driver_sql("PRAGMA foreign_key_check").fetchall()
                    if broken:
                        raise RuntimeError(f"migration to {revision} left rows with broken references: {broken[:5]}")
            finally:
                conn.exec_driver_sql("PRAGMA foreign_keys=ON")
                conn.commit()

    def current_revision(self) -> str | None:
        from alembic.runtime.migration import MigrationContext

        with self.engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()

    def table_names(self) -> list[str]:
        return sorted(inspect(self.engine).get_table_names())

    # -- sessions ---------------------------------------------------------
    @contextlib.contextmanager
    def session(self) -> Iterator[Session]:
        """A session whose work commits as ONE transaction when the block exits cleanly."""
        try:
            with self._sessions() as s, s.begin():
                yield s
        except OperationalError as exc:
            if "locked" in str(exc.orig) or "busy" in str(exc.orig):
                raise DatabaseBusy(f"the node's database is busy: another connection held its write lock for "
                                   f"over {BUSY_TIMEOUT_MS // 1000} s; try again") from exc
            raise

    async def run(self, fn: Callable[Concatenate[Session, P], T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Run ``fn(session, *args, **kwargs)`` in one transaction, in a worker thread."""

        def work() -> T:
            with self.session() as s:
                return fn(s, *args, **kwargs)

        return await trio.to_thread.run_sync(work, limiter=self._limiter)

    def close(self) -> None:
        self.engine.dispose()
