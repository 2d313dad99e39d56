"""The blob store under pull(): verification, resuming partials, redirects to storage, concurrent pulls."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import trio

from aenv_node.images.oci import DigestMismatch, PulledImage, pull
from aenv_node.images.oci.store import BlobStore, human_size

from .conftest import PASSWORD, USER
from .images import Images, manifest_of
from .servers import RedirectingFront, Registry


def layer_digests(registry: Registry, repo: str, tag: str) -> list[tuple[str, int]]:
    data, _, _ = manifest_of(registry.host, repo, tag)
    return [(layer["digest"], layer["size"]) for layer in json.loads(data)["layers"]]


async def pull_from(registry: Registry, ref: str, store_dir: Path, **kwargs: object) -> PulledImage:
    options: dict[str, object] = {"registries": (), "insecure_registries": (registry.host,), "concurrency": 4}
    options.update(kwargs)
    return await pull(f"{registry.host}/{ref}", store_dir=store_dir, **options)  # type: ignore[arg-type]


def blob_gets(registry: Registry, mark: int, digest: str) -> list[tuple[int, int]]:
    """(status, bytes sent) of every GET of ``digest`` since ``mark``, from the registry's access log."""
    return [(a.status, a.bytes) for a in registry.accesses(mark) if a.method == "GET" and a.uri.endswith(digest)]


async def test_corrupt_blob_raises_and_leaves_nothing(own_registry: Registry, images: Images, store_dir: Path) -> None:
    images.skopeo_copy("single", f"{own_registry.host}/single:v1")
    [(digest, size)] = layer_digests(own_registry, "single", "v1")
    data_file = own_registry.blob_data(digest)
    assert data_file.stat().st_size == size
    data_file.write_bytes(os.urandom(size))  # same length, other bytes: only the digest can tell

    with pytest.raises(DigestMismatch) as caught:
        await pull_from(own_registry, "single:v1", store_dir)
    assert digest in str(caught.value) and "\n" not in str(caught.value)
    store = BlobStore(store_dir)
    assert not store.has(digest)
    assert not store.partial_path(digest).exists()
    assert not list(store_dir.rglob("*.partial"))


async def test_resume_downloads_only_the_rest(registry: Registry, store_dir: Path) -> None:
    [(digest, size)] = layer_digests(registry, "single", "v1")
    blob = registry.blob_data(digest).read_bytes()
    have = size // 3
    store = BlobStore(store_dir)
    store.partial_path(digest).parent.mkdir(parents=True)
    store.partial_path(digest).write_bytes(blob[:have])

    mark = registry.log_mark()
    lines: list[str] = []
    image = await pull_from(registry, "single:v1", store_dir, progress=lines.append)
    assert blob_gets(registry, mark, digest) == [(206, size - have)]
    assert image.layers[0].path.read_bytes() == blob
    assert not store.partial_path(digest).exists()
    assert any(line.startswith("resuming sha256:") for line in lines), lines
    assert any(line.startswith("pulled sha256:") and f", {human_size(size - have)} fetched)" in line
               for line in lines), lines


async def test_resume_of_a_bad_partial_downloads_again(registry: Registry, images: Images, store_dir: Path) -> None:
    [(digest, size)] = layer_digests(registry, "single", "v1")
    store = BlobStore(store_dir)
    store.partial_path(digest).parent.mkdir(parents=True)
    store.partial_path(digest).write_bytes(os.urandom(size // 2))

    mark = registry.log_mark()
    lines: list[str] = []
    image = await pull_from(registry, "single:v1", store_dir, progress=lines.append)
    assert blob_gets(registry, mark, digest) == [(206, size - size // 2), (200, size)]
    assert any("did not verify" in line for line in lines), lines
    assert image.layers[0].path.read_bytes() == registry.blob_data(digest).read_bytes()


@pytest.mark.parametrize("partial", ["complete", "too long"])
async def test_partial_of_full_size_or_more(registry: Registry, store_dir: Path, partial: str) -> None:
    [(digest, size)] = layer_digests(registry, "single", "v1")
    blob = registry.blob_data(digest).read_bytes()
    store = BlobStore(store_dir)
    store.partial_path(digest).parent.mkdir(parents=True)
    store.partial_path(digest).write_bytes(blob if partial == "complete" else blob + b"junk")

    mark = registry.log_mark()
    image = await pull_from(registry, "single:v1", store_dir)
    # a complete partial is verified in place; one longer than the blob is thrown away
    assert blob_gets(registry, mark, digest) == ([] if partial == "complete" else [(200, size)])
    assert image.layers[0].path.read_bytes() == blob


async def test_redirected_blobs_get_no_authorization_and_a_range_ignored_restarts(
    redirecting_front: RedirectingFront, registry: Registry, store_dir: Path
) -> None:
    [(digest, size)] = layer_digests(registry, "single", "v1")
    blob = registry.blob_data(digest).read_bytes()
    store = BlobStore(store_dir)
    store.partial_path(digest).parent.mkdir(parents=True)
    store.partial_path(digest).write_bytes(blob[: size // 2])

    lines: list[str] = []
    image = await pull(f"{redirecting_front.host}/single:v1", store_dir=store_dir, registries=(),
                       insecure_registries=(redirecting_front.host,), concurrency=4, credentials=(USER, PASSWORD),
                       progress=lines.append)
    assert image.layers[0].path.read_bytes() == blob
    seen = redirecting_front.storage_headers
    assert len(seen) == 2  # the config and the layer, both from storage on another host
    assert all(headers["host"].startswith("localhost:") for headers in seen)
    assert not any("authorization" in headers for headers in seen)
    assert [headers.get("range") for headers in seen].count(f"bytes={size // 2}-") == 1
    assert any("ignored the range request" in line for line in lines), lines


async def test_concurrent_pulls_share_the_store_and_download_once(registry: Registry, store_dir: Path) -> None:
    digests = layer_digests(registry, "app", "v1")
    mark = registry.log_mark()
    results: list[PulledImage] = []

    async def one() -> None:
        results.append(await pull_from(registry, "app:v1", store_dir))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(one)
        nursery.start_soon(one)
    assert results[0] == results[1]
    for digest, size in digests:
        assert blob_gets(registry, mark, digest) == [(200, size)]
    assert not list(store_dir.rglob("*.partial"))
