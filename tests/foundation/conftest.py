"""Fixtures of the foundation tests: a migrated database on real SQLite."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from aenv_node.state import Database


@pytest.fixture
def db(tmp_path: Path) -> Iterator[Database]:
    """A fresh database, migrated to head."""
    d = Database(tmp_path / "aenv.db")
    d.upgrade()
    yield d
    d.close()
