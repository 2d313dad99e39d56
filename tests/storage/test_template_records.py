"""Shared template records (``storage/repository/template_record.py``) on posix_fs and s3 (a real moto server):
found by id and by alias, an alias that names another template is not followed, deletion removes exactly this
template's records, and the repository's collector keeps what a template record reaches (and only while the
record exists)."""

from __future__ import annotations

import time
from pathlib import Path

from test_repository import age_everything, pattern, write_layer

from aenv_node.storage.repository import Repository
from aenv_node.storage.repository.template_record import (
    TemplateRecord,
    drop_template,
    get_template,
    put_template,
)


def _record(template_id: str, snapshot_id: str, alias: str | None = None) -> TemplateRecord:
    return TemplateRecord(template_id=template_id, alias=alias, kind="template", cpu_count=2, memory_mb=512,
                          disk_size_mb=2048, envd_version="0.2", snapshot_id=snapshot_id, publisher="n1/abcd",
                          published_at=time.time())


def _snapshot(repo: Repository, tmp: Path, snapshot_id: str, seed: int) -> str:
    """A committed snapshot manifest naming one layer of its own; the layer's digest."""
    d, p = write_layer(tmp, pattern(4096 + seed, seed), f"layer-{seed}")
    repo.commit_snapshot(snapshot_id, {"version": 1, "snapshot_id": snapshot_id, "memory_layers": [d]}, {d: p})
    return d


def test_found_by_id_and_alias_and_dropped_exactly(repo: Repository) -> None:
    put_template(repo, _record("tpl-1", "snap-1", alias="app"))
    put_template(repo, _record("tpl-2", "snap-2"))
    assert get_template(repo, "tpl-1") == get_template(repo, "app")
    found = get_template(repo, "app")
    assert found is not None and (found.template_id, found.snapshot_id) == ("tpl-1", "snap-1")
    assert get_template(repo, "tpl-2") is not None and get_template(repo, "nope") is None
    for bad in ("", "../x", "a/b", "x" * 200):  # names no record can have
        assert get_template(repo, bad) is None
    # a rebuild under the same alias by another template moves the alias; the old template keeps its id
    put_template(repo, _record("tpl-3", "snap-3", alias="app"))
    moved = get_template(repo, "app")
    assert moved is not None and moved.template_id == "tpl-3"
    drop_template(repo, "tpl-1", "app")  # the alias is tpl-3's now: only tpl-1's record goes
    assert get_template(repo, "tpl-1") is None
    assert get_template(repo, "app") is not None
    drop_template(repo, "tpl-3", "app")
    assert get_template(repo, "app") is None and get_template(repo, "tpl-3") is None
    drop_template(repo, "tpl-3", "app")  # again: nothing left, no error
    assert [m for m in repo.list_manifests() if m.startswith("template")] == ["template-tpl-2"]


def test_an_alias_record_naming_a_template_without_that_alias_is_not_followed(repo: Repository) -> None:
    put_template(repo, _record("tpl-1", "snap-1", alias="app"))
    put_template(repo, _record("tpl-1", "snap-9"))  # rebuilt without the alias: the alias record is stale
    assert get_template(repo, "app") is None
    assert get_template(repo, "tpl-1") is not None


def test_the_collector_keeps_what_a_template_record_reaches_while_it_exists(repo: Repository,
                                                                           tmp_path: Path) -> None:
    kept = _snapshot(repo, tmp_path, "snap-shared", 1)
    gone = _snapshot(repo, tmp_path, "snap-superseded", 2)
    put_template(repo, _record("tpl-1", "snap-shared", alias="app"))
    grace = age_everything(repo)
    report = repo.collect_garbage(grace)
    assert report.manifests_removed == ["snap-superseded"] and report.layers_removed == [gone]
    assert set(repo.list_manifests()) == {"snap-shared", "template-tpl-1", "templatealias-app"}
    assert repo.list_layers() == [kept]
    drop_template(repo, "tpl-1", "app")  # deleted: nothing reaches its snapshot any more
    grace = age_everything(repo)
    report = repo.collect_garbage(grace)
    assert report.manifests_removed == ["snap-shared"] and report.layers_removed == [kept]
    assert repo.list_manifests() == [] and repo.list_layers() == []
