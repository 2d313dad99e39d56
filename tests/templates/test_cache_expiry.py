"""The build caches' expiry and the tags' hold on snapshots, on a real database and real files (no guests):
converted layers unused for the TTL go (their files with the next collection) unless a kept snapshot stacks
them, a build in progress touched them, or a kept chain stands on them; a tagged build's snapshot stays until
its tag goes."""

from __future__ import annotations

import datetime as dt
import os
import time
from pathlib import Path

import pytest
from sqlalchemy import text

from aenv_node.state import ImageLayer, Template, TemplateBuild, TemplateTag, utcnow
from aenv_node.templates import assign_tags, expire_converted_layers, expired_files, lookup
from tests.sandbox.test_gc import _World

DAY = dt.timedelta(days=1)


@pytest.fixture
def world(tmp_path: Path):
    w = _World(tmp_path)
    yield w
    w.db.close()


def _chain(world: _World, chain: str, parent: str | None, digest: str, last_used: dt.datetime) -> None:
    with world.db.session() as s:
        s.add(ImageLayer(chain_id=chain, parent_chain_id=parent, diff_id=f"sha256:{chain}", layer_digest=digest,
                         first_source="test", created_at=last_used, last_used_at=last_used))


def _chains(world: _World) -> set[str]:
    with world.db.session() as s:
        return {r.chain_id for r in s.query(ImageLayer)}


async def test_unused_chains_expire_and_their_layers_go_with_the_next_collection(world: _World) -> None:
    old, now = utcnow() - 10 * DAY, utcnow()
    la, lb, lc, ld, le, lf = (world.layer(n) for n in ("a", "b", "c", "d", "e", "f"))
    _chain(world, "a", None, la, old)  # under a template's snapshot
    _chain(world, "b", "a", lb, old)
    _chain(world, "c", "b", lc, old)  # old, but a recent chain stands on it
    _chain(world, "e", "c", le, now)
    _chain(world, "d", "b", ld, old)  # old and unused: goes
    _chain(world, "f", None, lf, old)  # old, but a build in progress touched it
    world.snapshot("snp_t", "boot", [la, lb])
    with world.db.session() as s:
        s.add(Template(id="tpl_t", alias="t", status="ready", boot_snapshot_id="snp_t"))

    with world.db.session() as s:
        gone = expire_converted_layers(s, now - DAY, frozenset({lf}))
    assert gone == ["d"]
    assert _chains(world) == {"a", "b", "c", "e", "f"}
    out = await world.gc.collect("test")
    assert out.layers == [ld] and not world.exists(ld)
    assert all(world.exists(x) for x in (la, lb, lc, le, lf))

    # the build is over and a day passes: everything not under the template's snapshot goes
    with world.db.session() as s:
        gone = expire_converted_layers(s, now + DAY, frozenset())
    assert sorted(gone) == ["c", "e", "f"] and _chains(world) == {"a", "b"}
    out = await world.gc.collect("test")
    assert sorted(out.layers) == sorted([lc, le, lf])
    with world.db.session() as s:
        [(detail,)] = s.execute(text("SELECT detail FROM events WHERE operation = 'image_layer_expire' "
                                     "ORDER BY id DESC LIMIT 1")).all()
    assert '"c"' in detail and '"f"' in detail


def test_files_expire_by_modification_time_and_temporaries_never(tmp_path: Path) -> None:
    files, blobs = tmp_path / "template-files", tmp_path / "oci" / "blobs" / "sha256"
    blobs.mkdir(parents=True)
    files.mkdir()
    old_upload, new_upload = files / ("a" * 64 + ".tar"), files / ("b" * 64 + ".tar")
    old_blob, partial, hidden = blobs / ("c" * 64), blobs / ("d" * 64 + ".partial"), files / ".x.part"
    for p in (old_upload, new_upload, old_blob, partial, hidden):
        p.write_bytes(b"x")
    past = time.time() - 3 * 86400
    for p in (old_upload, old_blob, partial, hidden):
        os.utime(p, (past, past))
    assert sorted(expired_files([files, tmp_path / "oci" / "blobs", tmp_path / "missing"], 86400)) == \
        sorted([old_upload, old_blob])


async def test_a_tag_keeps_its_builds_snapshot_until_it_goes(world: _World) -> None:
    l1, l2 = world.layer("one"), world.layer("two")
    world.snapshot("snp_1", "boot", [l1])
    world.snapshot("snp_2", "boot", [l2])
    with world.db.session() as s:
        s.add(Template(id="tpl_app", alias="app", status="ready", boot_snapshot_id="snp_2"))
        s.flush()
        s.add(TemplateBuild(id="b1", template_id="tpl_app", status="ready", snapshot_id="snp_1"))
        s.add(TemplateBuild(id="b2", template_id="tpl_app", status="ready", snapshot_id="snp_2"))
        s.flush()
        assign_tags(s, "tpl_app", "b1", ["v1", "default"])
        assign_tags(s, "tpl_app", "b2", ["v2"])
    with world.db.session() as s:
        assert lookup(s, "app").snapshot.id == "snp_1"  # the default tag, not the latest build
        assert lookup(s, "app:v2").snapshot.id == "snp_2"
        assert lookup(s, "tpl_app:v1").build_id == "b1"
        assert lookup(s, "app:nope").missing_tag and lookup(s, "nope") is None
        moved = assign_tags(s, "tpl_app", "b2", ["default", "v2"])
        assert moved == {"default": "b1"}  # v2 is there already: not moved
    await world.gc.collect("test")
    assert world.status("snp_1") == "committed"  # v1 still names b1
    with world.db.session() as s:
        assert lookup(s, "app").snapshot.id == "snp_2"
        s.delete(s.get(TemplateTag, ("tpl_app", "v1")))
    await world.gc.collect("test")
    assert world.status("snp_1") == "collected" and not world.exists(l1)
    assert world.status("snp_2") == "committed"
