"""Media types the node refuses, found before anything is downloaded: foreign (non-distributable) layers and
OCI artifacts that are not container images, pushed to docker-registry through its API; schema 1 by parsing."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from aenv_node.images.oci import ManifestInvalid, UnsupportedMediaType, pull
from aenv_node.images.oci.manifest import Platform, choose_platform, media_type_of, parse_config, parse_index

from .images import push_blob, push_manifest
from .servers import Registry, sha256_digest

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_CONFIG = "application/vnd.docker.container.image.v1+json"


def _config(diff_ids: list[str]) -> bytes:
    return json.dumps({"architecture": "amd64", "os": "linux", "config": {},
                       "rootfs": {"type": "layers", "diff_ids": diff_ids}}).encode()


async def _pull(registry: Registry, ref: str, store_dir: Path) -> None:
    await pull(f"{registry.host}/{ref}", store_dir=store_dir, registries=(), insecure_registries=(registry.host,),
               concurrency=4)


async def test_foreign_layer_is_refused(registry: Registry, store_dir: Path) -> None:
    foreign = os.urandom(64)
    config = _config([sha256_digest(foreign)])
    config_digest = push_blob(registry.host, "foreign", config)
    # a Windows-style base layer: the registry does not hold it, clients would fetch it from its URL
    push_manifest(registry.host, "foreign", "v1", {
        "schemaVersion": 2,
        "mediaType": DOCKER_MANIFEST,
        "config": {"mediaType": DOCKER_CONFIG, "digest": config_digest, "size": len(config)},
        "layers": [{"mediaType": "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip",
                    "digest": sha256_digest(foreign), "size": len(foreign),
                    "urls": ["https://example.invalid/never-fetched"]}],
    }, DOCKER_MANIFEST)
    with pytest.raises(UnsupportedMediaType, match="foreign") as caught:
        await _pull(registry, "foreign:v1", store_dir)
    assert "foreign:v1" in str(caught.value)
    assert not list(store_dir.rglob("*"))


async def test_artifact_that_is_not_an_image_is_refused(registry: Registry, store_dir: Path) -> None:
    config = b'{"name": "chart", "version": "1.0.0"}'
    chart = os.urandom(100)
    config_digest = push_blob(registry.host, "chart", config)
    chart_digest = push_blob(registry.host, "chart", chart)
    push_manifest(registry.host, "chart", "1.0.0", {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "config": {"mediaType": "application/vnd.cncf.helm.config.v1+json", "digest": config_digest,
                   "size": len(config)},
        "layers": [{"mediaType": "application/vnd.cncf.helm.chart.content.v1.tar+gzip", "digest": chart_digest,
                    "size": len(chart)}],
    }, OCI_MANIFEST)
    with pytest.raises(UnsupportedMediaType, match="not a container image"):
        await _pull(registry, "chart:1.0.0", store_dir)
    assert not list(store_dir.rglob("*"))


async def test_layer_count_must_match_diff_ids(registry: Registry, store_dir: Path) -> None:
    layer = os.urandom(32)
    config = _config([])
    config_digest = push_blob(registry.host, "mismatch", config)
    layer_digest = push_blob(registry.host, "mismatch", layer)
    push_manifest(registry.host, "mismatch", "v1", {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "config": {"mediaType": OCI_CONFIG, "digest": config_digest, "size": len(config)},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": layer_digest,
                    "size": len(layer)}],
    }, OCI_MANIFEST)
    with pytest.raises(ManifestInvalid, match="1 layers, config lists 0 diff_ids"):
        await _pull(registry, "mismatch:v1", store_dir)


def test_schema1_and_unknown_manifests_are_refused() -> None:
    schema1 = json.dumps({"schemaVersion": 1, "name": "x", "tag": "v1", "fsLayers": []}).encode()
    with pytest.raises(UnsupportedMediaType, match="schema 1"):
        media_type_of(schema1, "application/vnd.docker.distribution.manifest.v1+prettyjws", "x:v1")
    with pytest.raises(UnsupportedMediaType, match="not an image manifest"):
        media_type_of(b'{"schemaVersion": 2}', "application/json", "x:v1")
    with pytest.raises(ManifestInvalid, match="not valid JSON"):
        media_type_of(b"<html>", "text/html", "x:v1")
    # an OCI manifest or index may omit mediaType: its shape tells
    assert media_type_of(b'{"schemaVersion": 2, "manifests": []}', "", "x") == "application/vnd.oci.image.index.v1+json"


def test_platform_matching() -> None:
    index = json.dumps({"manifests": [
        {"mediaType": OCI_MANIFEST, "digest": "sha256:" + "1" * 64, "size": 1,
         "platform": {"os": "linux", "architecture": "arm", "variant": "v6"}},
        {"mediaType": OCI_MANIFEST, "digest": "sha256:" + "2" * 64, "size": 1,
         "platform": {"os": "linux", "architecture": "arm", "variant": "v7"}},
        {"mediaType": OCI_MANIFEST, "digest": "sha256:" + "3" * 64, "size": 1,
         "platform": {"os": "linux", "architecture": "arm64"}},
        {"mediaType": OCI_MANIFEST, "digest": "sha256:" + "4" * 64, "size": 1},
    ]}).encode()
    entries = parse_index(index, "x")
    assert choose_platform(entries, Platform.parse("linux/arm/v7"), "x").digest.endswith("2" * 64)
    assert choose_platform(entries, Platform.parse("linux/arm64/v8"), "x").digest.endswith("3" * 64)
    assert choose_platform(entries, Platform.parse("linux/arm"), "x").digest.endswith("1" * 64)
    with pytest.raises(ValueError):
        Platform.parse("linux")


def test_config_fields() -> None:
    config, diff_ids = parse_config(json.dumps({
        "rootfs": {"type": "layers", "diff_ids": ["sha256:" + "a" * 64]},
        "config": {"Env": None, "Cmd": ["python3"], "Entrypoint": None, "WorkingDir": "", "User": "app"},
    }).encode(), "x")
    assert diff_ids == ("sha256:" + "a" * 64,)
    assert (config.env, config.cmd, config.entrypoint, config.working_dir, config.user) == (
        (), ("python3",), (), "", "app")
    # an image with no config object at all (scratch images built by some tools)
    bare, _ = parse_config(b'{"rootfs": {"type": "layers", "diff_ids": []}}', "x")
    assert bare.env == () and bare.cmd == ()
    with pytest.raises(ManifestInvalid, match="Env"):
        parse_config(b'{"rootfs": {"type": "layers", "diff_ids": []}, "config": {"Env": "A=1"}}', "x")
