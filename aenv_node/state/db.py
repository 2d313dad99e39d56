"""The node's SQLite database: engine set-up, sessions and migrations.

SQLite is the truth (DESIGN.md). Every connection runs in WAL mode with foreign
keys on and a busy timeout, so the node, the CLI and a person running
``sqlite3 aenv.db`` can all read while the node writes.

Sessions are synchronous SQLAlchemy sessions; async code calls them through
``trio.to_thread.run_sync`` (see ``Database.run``), with one bounded limiter so
SQLite never sees more writers than it can serialise.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

import trio
from sqlalchemy import Engine, create_engine, event, inspect
from sqlalchemy.orm import Session, sessionmaker

__all__ = ["Database", "migrations_dir", "alembic_config"]

T = TypeVar("T")


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
    cur.execute("PRAGMA busy_timeout=10000")
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
        from alembic import command

        with self.engine.begin() as conn:
            cfg = alembic_config(self.url)
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, revision)

    def downgrade(self, revision: str = "base") -> None:
        from alembic import command

        with self.engine.begin() as conn:
            cfg = alembic_config(self.url)
            cfg.attributes["connection"] = conn
            command.downgrade(cfg, revision)

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
        with self._sessions() as s, s.begin():
            yield s

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(session, *args)`` in one transaction, in a worker thread."""

        def work() -> T:
            with self.session() as s:
                return fn(s, *args)

        return await trio.to_thread.run_sync(work, limiter=self._limiter)

    def close(self) -> None:
        self.engine.dispose()
