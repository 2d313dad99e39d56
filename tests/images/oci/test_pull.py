"""pull() against real registries (docker-registry on loopback) with images made by umoci and skopeo."""

from __future__ import annotations

import dataclasses
import tarfile
from pathlib import Path

import pytest

from aenv_node.images.oci import (
    DigestMismatch,
    ImageNotFound,
    InsecureRegistryRefused,
    OciLayer,
    PlatformNotFound,
    PulledImage,
    open_layer_tar,
    pull,
)

from .images import GREETING, Images, manifest_of
from .servers import Registry

DOCKER_GZIP = "application/vnd.docker.image.rootfs.diff.tar.gzip"
OCI_ZSTD = "application/vnd.oci.image.layer.v1.tar+zstd"


def layer_files(layer: OciLayer) -> dict[str, bytes | str]:
    """name -> file content (regular files) or link target (symlinks), read through open_layer_tar."""
    files: dict[str, bytes | str] = {}
    with open_layer_tar(layer) as stream, tarfile.open(fileobj=stream, mode="r|") as tar:
        for member in tar:
            name = member.name.removeprefix("./")
            if member.isfile():
                extracted = tar.extractfile(member)
                assert extracted is not None
                files[name] = extracted.read()
            elif member.issym():
                files[name] = member.linkname
    return files


async def pull_from(registry: Registry, ref: str, store_dir: Path, **kwargs: object) -> PulledImage:
    options: dict[str, object] = {"registries": (), "insecure_registries": (registry.host,), "concurrency": 4}
    options.update(kwargs)
    return await pull(f"{registry.host}/{ref}", store_dir=store_dir, **options)  # type: ignore[arg-type]


async def test_anonymous_docker_gzip_image(registry: Registry, images: Images, store_dir: Path) -> None:
    lines: list[str] = []
    image = await pull_from(registry, "app:v1", store_dir, progress=lines.append)

    _, _, digest = manifest_of(registry.host, "app", "v1")
    assert image.reference == f"{registry.host}/app:v1"
    assert image.digest == digest
    assert image.canonical == f"{registry.host}/app@{digest}"
    assert image.index_digest is None
    assert image.config.env == ("FOO=bar", "PATH=/bin:/usr/bin")
    assert image.config.working_dir == "/app"
    assert image.config.user == "1000:1000"
    assert image.config.entrypoint == ("/bin/busybox", "sh")
    assert image.config.cmd == ("-c", "echo hi")
    assert [layer.media_type for layer in image.layers] == [DOCKER_GZIP] * 4
    for layer in image.layers:
        assert layer.path == store_dir / "blobs" / "sha256" / layer.digest.removeprefix("sha256:")
        assert layer.path.stat().st_size == layer.size

    base, etc, app, conf = (layer_files(layer) for layer in image.layers)  # each checks its diff_id
    assert base["bin/busybox"] == Path("/bin/busybox").read_bytes()
    assert base["bin/sh"] == "busybox"
    assert etc["etc/greeting"] == GREETING
    assert app["app/data.bin"] == images.data
    assert conf["app/conf/config.json"] == b'{"answer": 42}\n'

    assert any(line.startswith("pulling sha256:") and "MiB" in line for line in lines), lines
    assert sum(line.startswith("pulled sha256:") for line in lines) == 4, lines
    assert lines[-1].startswith(f"pulled {image.canonical} in ")
    assert not list(store_dir.rglob("*.partial"))


async def test_anonymous_oci_zstd_image(registry: Registry, images: Images, store_dir: Path) -> None:
    gzip_image = await pull_from(registry, "app:v1", store_dir)
    image = await pull_from(registry, "appz:v1", store_dir)

    assert [layer.media_type for layer in image.layers] == [OCI_ZSTD] * 4
    # same trees, other compression: other blobs, same uncompressed tars
    assert [layer.diff_id for layer in image.layers] == [layer.diff_id for layer in gzip_image.layers]
    assert {layer.digest for layer in image.layers}.isdisjoint(layer.digest for layer in gzip_image.layers)
    assert image.config == gzip_image.config
    files = [layer_files(layer) for layer in image.layers]
    assert files[0]["bin/busybox"] == Path("/bin/busybox").read_bytes()
    assert files[2]["app/data.bin"] == images.data


async def test_layer_tar_checks_diff_id(registry: Registry, store_dir: Path) -> None:
    image = await pull_from(registry, "app:v1", store_dir)
    layer = image.layers[1]
    wrong = dataclasses.replace(layer, diff_id="sha256:" + "0" * 64)
    with pytest.raises(DigestMismatch, match="diff_id"):
        with open_layer_tar(wrong) as stream, tarfile.open(fileobj=stream, mode="r|") as tar:
            assert [m.name for m in tar]  # tarfile stops at the end marker; the rest is read at exit
    # an error inside the block is the caller's, raised as is (no check on a half-read stream)
    with pytest.raises(KeyError):
        with open_layer_tar(wrong):
            raise KeyError("consumer failed")


async def test_index_picks_the_node_platform(registry: Registry, store_dir: Path) -> None:
    index, _, index_digest = manifest_of(registry.host, "multi", "v1")
    _, _, amd64_digest = manifest_of(registry.host, "multi", "amd64")
    _, _, arm64_digest = manifest_of(registry.host, "multi", "arm64")

    image = await pull_from(registry, "multi:v1", store_dir)
    assert image.digest == amd64_digest
    assert image.index_digest == index_digest
    assert image.canonical == f"{registry.host}/multi@{amd64_digest}"
    assert layer_files(image.layers[0])["etc/arch"] == b"amd64"

    arm = await pull_from(registry, "multi:v1", store_dir, platform="linux/arm64")
    assert arm.digest == arm64_digest
    assert layer_files(arm.layers[0])["etc/arch"] == b"arm64"


async def test_index_without_the_platform_is_a_clear_error(registry: Registry, store_dir: Path) -> None:
    with pytest.raises(PlatformNotFound) as caught:
        await pull_from(registry, "armonly:v1", store_dir)
    message = str(caught.value)
    assert "linux/amd64" in message and "armonly:v1" in message
    assert "linux/arm64/v8" in message and "linux/arm/v7" in message
    assert "unknown" not in message.split("it has:")[1]
    assert "\n" not in message
    assert not list(store_dir.rglob("*"))  # nothing downloaded


async def test_pull_by_digest(registry: Registry, store_dir: Path) -> None:
    _, _, digest = manifest_of(registry.host, "app", "v1")
    by_digest = await pull_from(registry, f"app@{digest}", store_dir)
    assert by_digest.digest == digest
    assert by_digest.canonical == f"{registry.host}/app@{digest}"
    tagged = await pull_from(registry, f"app:v1@{digest}", store_dir)
    assert tagged.digest == digest and tagged.layers == by_digest.layers
    # an index by digest resolves to the platform's manifest
    _, _, index_digest = manifest_of(registry.host, "multi", "v1")
    _, _, amd64_digest = manifest_of(registry.host, "multi", "amd64")
    from_index = await pull_from(registry, f"multi@{index_digest}", store_dir)
    assert (from_index.digest, from_index.index_digest) == (amd64_digest, index_digest)


async def test_a_moved_tag_does_not_change_what_was_pulled(
    registry: Registry, images: Images, store_dir: Path
) -> None:
    images.skopeo_copy("v1", f"{registry.host}/moving:v1")
    first = await pull_from(registry, "moving:v1", store_dir)
    snapshot = dataclasses.asdict(first)

    images.skopeo_copy("v2", f"{registry.host}/moving:v1")  # the tag now names another image
    second = await pull_from(registry, "moving:v1", store_dir)
    assert second.digest != first.digest
    assert len(second.layers) == 5 and len(first.layers) == 4
    assert dataclasses.asdict(first) == snapshot

    again = await pull(first.canonical, store_dir=store_dir, registries=(), insecure_registries=(registry.host,),
                       concurrency=4)
    assert again.digest == first.digest
    assert again.layers == first.layers


async def test_unknown_image_or_tag(registry: Registry, store_dir: Path) -> None:
    with pytest.raises(ImageNotFound, match=r"nothere:v1"):
        await pull_from(registry, "nothere:v1", store_dir)
    with pytest.raises(ImageNotFound, match=r"app:v404") as caught:
        await pull_from(registry, "app:v404", store_dir)
    assert "manifest unknown" in str(caught.value)
    with pytest.raises(ImageNotFound):
        await pull_from(registry, "app@sha256:" + "ab" * 32, store_dir)


async def test_short_name_resolves_through_registries_in_order(
    registry: Registry, empty_registry: Registry, store_dir: Path
) -> None:
    hosts = (empty_registry.host, registry.host)
    image = await pull("app:v1", store_dir=store_dir, registries=hosts, insecure_registries=hosts, concurrency=4)
    _, _, digest = manifest_of(registry.host, "app", "v1")
    assert image.reference == "app:v1"
    assert image.canonical == f"{registry.host}/app@{digest}"

    with pytest.raises(ImageNotFound) as caught:
        await pull("nothere", store_dir=store_dir, registries=hosts, insecure_registries=hosts, concurrency=4)
    assert empty_registry.host in str(caught.value) and registry.host in str(caught.value)


async def test_plain_http_registry_must_be_listed(registry: Registry, store_dir: Path) -> None:
    with pytest.raises(InsecureRegistryRefused, match="images.insecure_registries") as caught:
        await pull_from(registry, "app:v1", store_dir, insecure_registries=())
    assert registry.host in str(caught.value)
    before = registry.log_mark()
    with pytest.raises(InsecureRegistryRefused):
        await pull_from(registry, "app:v1", store_dir, insecure_registries=("127.0.0.1:1",))
    assert registry.accesses(before) == []  # the refusal sent no plain-HTTP request


@pytest.mark.parametrize("concurrency", [1, 2, 4])
async def test_layers_download_in_parallel_up_to_the_limit(
    registry: Registry, store_dir: Path, concurrency: int
) -> None:
    lines: list[str] = []
    image = await pull_from(registry, "app:v1", store_dir, concurrency=concurrency, progress=lines.append)
    assert len(image.layers) == 4
    in_flight = peak = 0
    for line in lines:
        if line.startswith("pulling sha256:"):
            in_flight += 1
            peak = max(peak, in_flight)
        elif line.startswith("pulled sha256:"):
            in_flight -= 1
    assert peak == concurrency, lines


async def test_blobs_in_the_store_are_not_downloaded_again(registry: Registry, store_dir: Path) -> None:
    await pull_from(registry, "app:v1", store_dir)
    mark = registry.log_mark()
    lines: list[str] = []
    image = await pull_from(registry, "app:v1", store_dir, progress=lines.append)
    requests = registry.accesses(mark)
    assert [a.uri for a in requests if "/blobs/" in a.uri] == []
    assert [a.uri for a in requests] == ["/v2/app/manifests/v1"]
    assert sum("already present" in line for line in lines) == len(image.layers)
