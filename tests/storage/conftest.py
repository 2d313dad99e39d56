"""The repository every contract test of tests/storage runs against: posix_fs and s3 (a real moto server over
HTTP, with multipart settings small enough that test-sized layers go up in parts)."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest
from s3server import delete_bucket, make_s3_repository, moto_endpoint  # noqa: F401 - the fixture repo uses

from aenv_node.storage.repository import PosixFsRepository, Repository

MiB = 1024 * 1024


@pytest.fixture(params=["posix_fs", "s3"])
def repo(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Repository]:
    if request.param == "posix_fs":
        r: Repository = PosixFsRepository(tmp_path / "repo")
        yield r
        r.close()
    else:
        r = make_s3_repository(request.getfixturevalue("moto_endpoint"), multipart_threshold=6 * MiB,
                               part_size=5 * MiB, upload_concurrency=2)
        yield r
        delete_bucket(r)
