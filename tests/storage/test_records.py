"""The records storage persists, each a typed, versioned model owned by one module: the ``sandbox-<id>``
ownership record (repository/ownership.py), the layers a snapshot manifest names (repository/manifest.py,
read by the repository's garbage collection) and an upper's layer stack (upper.py).  What older code wrote
must still read the same."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Optional

import pytest

from aenv_node.storage.errors import UpperCorrupt
from aenv_node.storage.repository import (
    OWNER_PAUSED,
    OWNER_RUNNING,
    DiskLayerRef,
    LayerManifest,
    PosixFsRepository,
    sandbox_record_id,
)
from aenv_node.storage.repository import base as repo_base
from aenv_node.storage.repository.manifest import encode_manifest
from aenv_node.storage.repository.ownership import OWNER_DELETING, Ownership
from aenv_node.storage.upper import Upper, UpperStack


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


D1, D2, D3 = (_digest(bytes([i]) * 100) for i in (1, 2, 3))


# -- the ownership record --------------------------------------------------------------------------------------


def test_ownership_is_still_importable_from_base() -> None:
    assert repo_base.Ownership is Ownership
    assert repo_base.OWNER_PAUSED == OWNER_PAUSED == "paused"


@pytest.mark.parametrize("doc", [
    # what publish wrote before ownership existed
    {"sandbox_id": "iold", "snapshot_id": "snap-old", "published_at": 1.5},
    # ... and a document with every ownership field present but null
    {"sandbox_id": "iold", "snapshot_id": "snap-old", "published_at": 1.5, "owner": None, "state": None,
     "generation": None, "updated_at": None, "version": None},
])
def test_a_pointer_written_before_ownership_parses_as_today(doc: dict[str, object]) -> None:
    rec = Ownership.parse("iold", json.dumps(doc).encode(), "tok")
    assert (rec.version, rec.owner, rec.state, rec.generation) == (1, "", OWNER_PAUSED, 0)
    assert (rec.snapshot_id, rec.updated_at, rec.published_at, rec.token) == ("snap-old", 1.5, 1.5, "tok")
    assert not rec.held_by_other("node-a")  # nobody owns it: anyone may claim it


def test_the_record_id_not_the_document_says_whose_it_is() -> None:
    rec = Ownership.parse("ia", b'{"sandbox_id": "ib", "snapshot_id": null}', "")
    assert rec.sandbox_id == "ia" and rec.snapshot_id is None and rec.updated_at == 0.0


def test_ownership_round_trip_and_equality_ignores_the_token() -> None:
    first = Ownership.successor("ia", None, owner="node-a", state=OWNER_RUNNING, snapshot_id=None)
    assert (first.generation, first.published_at) == (1, None)
    data = first.encode()
    assert "published_at" not in json.loads(data) and "token" not in json.loads(data)
    assert data == encode_manifest(json.loads(data))  # sorted keys, compact: the manifest convention
    back = Ownership.parse("ia", data, "etag-1")
    assert back == first and hash(back) == hash(first) and back.token == "etag-1"
    published = Ownership.successor("ia", back, owner="node-a", state=OWNER_PAUSED, snapshot_id="snap-1",
                                    publish=True)
    assert (published.generation, published.published_at) == (2, published.updated_at)
    assert json.loads(published.encode())["published_at"] == published.updated_at
    # a claim keeps when it was last published
    claimed = Ownership.successor("ia", published, owner="node-b", state=OWNER_RUNNING,
                                  snapshot_id=published.snapshot_id)
    assert claimed.published_at == published.published_at and claimed.snapshot_id == "snap-1"
    assert claimed != published
    fence = claimed.fenced()
    assert fence.state == OWNER_DELETING and fence.generation == claimed.generation
    assert fence.held_by_other("node-a") and not fence.held_by_other("node-b")


@pytest.mark.parametrize("doc", [
    {"version": 2, "snapshot_id": "s"},  # a format this code does not know
    {"state": "flying"},
    {"snapshot_id": 5},
    {"generation": "many"},
])
def test_a_record_this_code_cannot_read_is_refused(doc: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        Ownership.parse("ix", json.dumps(doc).encode(), "")


def test_claim_release_drop_over_a_legacy_pointer(tmp_path: Path) -> None:
    repo = PosixFsRepository(tmp_path / "repo")
    repo.put_manifest(sandbox_record_id("iold"), {"sandbox_id": "iold", "snapshot_id": "snap-old",
                                                  "published_at": 1.0})
    claimed = repo.claim_sandbox("iold", "node-a")
    assert (claimed.owner, claimed.state, claimed.generation, claimed.snapshot_id) == ("node-a", OWNER_RUNNING, 1,
                                                                                       "snap-old")
    stored = repo.get_manifest(sandbox_record_id("iold"))
    assert stored["version"] == 1 and stored["published_at"] == 1.0 and stored["owner"] == "node-a"
    released = repo.release_sandbox("iold", "node-a", "snap-new")
    assert released.published_at == released.updated_at and released.generation == 2
    assert repo.get_ownership("iold") == released
    assert repo.drop_ownership("iold", "node-a") and repo.get_ownership("iold") is None


# -- the layers a snapshot manifest names ----------------------------------------------------------------------


def _snapshot_doc() -> dict[str, object]:
    """A manifest shaped like the snapshot layer's, with fields the repository does not declare."""
    return {
        "version": 1, "snapshot_id": "snap-1", "parent_id": None, "vmstate_b64": "AAEC",
        "sandbox": {"id": "ia", "metadata": {"k": "v"}, "env_vars": {}}, "memory_mb": 512,
        "disk_layers": [{"digest": D1, "size": 100, "virtual_size": 4096},
                        {"digest": D2, "size": 200, "virtual_size": 4096, "compressed": True}],
        "memory_layers": [D3],
    }


def test_a_manifest_with_extra_fields_round_trips() -> None:
    doc = _snapshot_doc()
    data = encode_manifest(doc)
    m = LayerManifest.decode(data)
    assert m.layer_digests() == [D1, D2, D3]  # disk, then memory, each bottom first
    assert m.disk_layers[1] == DiskLayerRef(digest=D2, size=200, virtual_size=4096, compressed=True)
    assert m.encode() == data  # every field kept, in the same bytes


def test_a_subclass_reads_its_own_fields() -> None:
    class Snap(LayerManifest):
        snapshot_id: str
        parent_id: Optional[str] = None

    m = Snap.decode(encode_manifest(_snapshot_doc()))
    assert isinstance(m, Snap) and m.snapshot_id == "snap-1" and m.layer_digests() == [D1, D2, D3]
    assert m.encode() == encode_manifest(_snapshot_doc())


@pytest.mark.parametrize("doc,digests", [
    ({}, []),  # names no layer
    ({"disk_layers": None, "memory_layers": None}, []),
    ({"memory_layers": [D1]}, [D1]),
])
def test_missing_layer_lists_name_nothing(doc: dict[str, object], digests: list[str]) -> None:
    m = LayerManifest.decode(encode_manifest(doc))
    assert m.version == 1 and m.layer_digests() == digests


@pytest.mark.parametrize("data", [
    encode_manifest({"disk_layers": [{"size": 1}]}),  # no digest
    encode_manifest({"disk_layers": [{"digest": "sha256:abc", "size": 1}]}),  # not a digest
    encode_manifest({"memory_layers": [D1.upper()]}),
    encode_manifest({"memory_layers": "sha256:" + "0" * 64}),  # not a list
    b"[1, 2]",  # not an object
    b"{",
])
def test_a_manifest_not_shaped_like_one_is_a_value_error(data: bytes) -> None:
    with pytest.raises(ValueError):
        LayerManifest.decode(data)


def _layer(tmp: Path, name: str, data: bytes) -> tuple[str, Path]:
    p = tmp / name
    p.write_bytes(data)
    return _digest(data), p


def _age(repo: PosixFsRepository) -> None:
    old = time.time() - 7200
    for p in repo.root.rglob("*"):
        if p.is_file():
            os.utime(p, (old, old))


def test_gc_reads_the_digests_through_layer_manifest(tmp_path: Path) -> None:
    repo = PosixFsRepository(tmp_path / "repo")
    src = tmp_path / "src"
    src.mkdir()
    disk, disk_p = _layer(src, "disk", b"d" * 5000)
    mem, mem_p = _layer(src, "mem", b"m" * 3000)
    gone, gone_p = _layer(src, "gone", b"g" * 1000)
    manifest = LayerManifest.model_validate({
        "disk_layers": [{"digest": disk, "size": 5000, "virtual_size": 8192, "note": "kept"}],
        "memory_layers": [mem], "snapshot_id": "snap-1", "vmstate_b64": "",
    })
    repo.commit_snapshot("snap-1", manifest, {disk: disk_p, mem: mem_p})
    repo.put_layer(gone, gone_p)  # stored without any manifest naming it
    repo.release_sandbox("ia", "node-a", "snap-1")
    assert repo.read_manifest("snap-1", LayerManifest) == manifest
    assert repo.get_manifest("snap-1")["disk_layers"][0]["note"] == "kept"
    _age(repo)
    report = repo.collect_garbage(3600)
    assert report.layers_removed == [gone] and report.manifests_removed == [] and not report.unreadable_manifests
    assert set(repo.list_layers()) == {disk, mem}


def test_gc_keeps_everything_around_a_record_it_cannot_read(tmp_path: Path) -> None:
    """A record of a newer version (or otherwise unreadable) might name any snapshot: nothing is removed."""
    repo = PosixFsRepository(tmp_path / "repo")
    src = tmp_path / "src"
    src.mkdir()
    d, p = _layer(src, "l", b"x" * 4096)
    repo.commit_snapshot("snap-a", {"disk_layers": [{"digest": d, "size": 4096}]}, {d: p})
    repo.put_manifest(sandbox_record_id("inew"), {"version": 2, "snapshot_id": "snap-a", "owner": "n"})
    _age(repo)
    report = repo.collect_garbage(0)
    assert report.unreadable_manifests == [sandbox_record_id("inew")]
    assert report.manifests_removed == [] and report.layers_removed == []
    with pytest.raises(ValueError):
        repo.get_ownership("inew")


# -- an upper's layer stack ------------------------------------------------------------------------------------

SIZE = 64 * 4096


def _upper_with_stack(tmp_path: Path, content: bytes) -> Path:
    d = tmp_path / "up"
    Upper(d, SIZE, stack=["aa", "bb"]).close()
    (stacks,) = [p for p in d.iterdir() if p.name.startswith("stack.")]
    stacks.write_bytes(content)
    return d


@pytest.mark.parametrize("content,layers", [
    (json.dumps({"version": 1, "layers": ["h1", "h2"]}).encode(), ["h1", "h2"]),  # as json.dump wrote it
    (b'{"layers":[]}', []),  # no version: version 1
])
def test_an_existing_stack_file_still_reads(tmp_path: Path, content: bytes, layers: list[str]) -> None:
    d = _upper_with_stack(tmp_path, content)
    assert Upper.peek(d) == (SIZE, layers)
    up = Upper(d, SIZE)
    try:
        assert up.stack == layers
    finally:
        up.close()


@pytest.mark.parametrize("content", [
    b'{"version": 2, "layers": ["h1"]}',  # a newer format
    b'{"version": 1, "layers": ["h1", 2]}',
    b'{"version": 1}',
    b"[]",
    b"\xff",
])
def test_a_stack_file_this_code_cannot_read_is_corrupt(tmp_path: Path, content: bytes) -> None:
    d = _upper_with_stack(tmp_path, content)
    with pytest.raises(UpperCorrupt, match="not a layer stack"):
        Upper(d, SIZE)


def test_set_stack_writes_an_upper_stack(tmp_path: Path) -> None:
    up = Upper(tmp_path / "up", SIZE)
    try:
        assert up.stack is None
        up.set_stack(["c1", "c2"])
        (f,) = [p for p in (tmp_path / "up").iterdir() if p.name.startswith("stack.")]
        assert UpperStack.decode(f.read_bytes()) == UpperStack(layers=["c1", "c2"])
        assert json.loads(f.read_bytes()) == {"version": 1, "layers": ["c1", "c2"]}
    finally:
        up.close()
