"""Every SQL query docs/operations.md gives a person runs against the schema as migrated (a renamed or moved
column would otherwise leave the operations guide quietly wrong)."""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path

from aenv_node.state import Database

DOC = Path(__file__).resolve().parents[2] / "docs" / "operations.md"


def _statements() -> list[str]:
    out = []
    for block in re.findall(r"```sql\n(.*?)```", DOC.read_text(), re.S):
        text = block.replace(":sandbox_id", "'isb'").replace("'<id>'", "'isb'")
        out += [st.strip() for st in text.split(";") if re.search(r"\bSELECT\b", st)]
    return out


def test_every_query_of_the_operations_guide_runs(tmp_path: Path) -> None:
    db = Database(tmp_path / "aenv.db")
    db.upgrade()
    statements = _statements()
    assert len(statements) >= 15, statements  # the guide's queries were found
    con = sqlite3.connect(db.path)
    try:
        for st in statements:
            con.execute(st).fetchall()  # raises on an unknown table or column
    finally:
        con.close()
