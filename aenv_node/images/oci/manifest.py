"""Manifests, indexes and image configs: the JSON documents of a pull, parsed into typed values (no I/O here).

Both families are accepted: OCI (image index, image manifest, ``tar``/``tar+gzip``/``tar+zstd`` layers) and
Docker's (manifest list, v2 schema 2 manifest, ``rootfs.diff.tar.gzip`` layers). Docker v2 schema 1 (signed,
deprecated since 2017), foreign or non-distributable layers (Windows base layers, fetched from elsewhere) and
OCI artifacts that are not container images are refused with :class:`UnsupportedMediaType` before anything is
downloaded. Parsing is hand-written on ``json``: the shapes are small, and a missing or mistyped field must
become a one-line :class:`ManifestInvalid`, not a validation report.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .errors import ManifestInvalid, PlatformNotFound, UnsupportedMediaType
from .reference import DIGEST_RE

__all__ = [
    "ACCEPT_MANIFESTS",
    "CONFIG_TYPES",
    "INDEX_TYPES",
    "LAYER_COMPRESSION",
    "MANIFEST_TYPES",
    "Descriptor",
    "ImageConfig",
    "ImageManifest",
    "Platform",
    "choose_platform",
    "parse_config",
    "parse_image_manifest",
    "parse_index",
]

OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_SCHEMA1 = ("application/vnd.docker.distribution.manifest.v1+json",
                  "application/vnd.docker.distribution.manifest.v1+prettyjws")

INDEX_TYPES = frozenset({OCI_INDEX, DOCKER_LIST})
MANIFEST_TYPES = frozenset({OCI_MANIFEST, DOCKER_MANIFEST})
ACCEPT_MANIFESTS = ", ".join((OCI_INDEX, OCI_MANIFEST, DOCKER_LIST, DOCKER_MANIFEST))
CONFIG_TYPES = frozenset({"application/vnd.oci.image.config.v1+json",
                          "application/vnd.docker.container.image.v1+json"})

# layer media type -> compression ("" for a plain tar); anything else is refused
LAYER_COMPRESSION: Mapping[str, str] = {
    "application/vnd.oci.image.layer.v1.tar": "",
    "application/vnd.oci.image.layer.v1.tar+gzip": "gzip",
    "application/vnd.oci.image.layer.v1.tar+zstd": "zstd",
    "application/vnd.docker.image.rootfs.diff.tar": "",
    "application/vnd.docker.image.rootfs.diff.tar.gzip": "gzip",
}


@dataclass(frozen=True)
class Descriptor:
    """A pointer to content: media type, digest, size (and, in an index, the platform it is for)."""

    media_type: str
    digest: str
    size: int
    platform: Platform | None = None


@dataclass(frozen=True)
class Platform:
    os: str
    architecture: str
    variant: str = ""

    @classmethod
    def parse(cls, text: str) -> Platform:
        """``os/arch[/variant]``, e.g. ``linux/amd64`` or ``linux/arm64/v8``."""
        parts = text.split("/")
        if len(parts) not in (2, 3) or not all(parts):
            raise ValueError(f"platform must be os/arch[/variant], not {text!r}")
        return cls(parts[0], parts[1], parts[2] if len(parts) == 3 else "")

    def matches(self, other: Platform) -> bool:
        """Same os and architecture; variants must agree only when both name one (arm64's v8 is the default)."""
        if (self.os, self.architecture) != (other.os, other.architecture):
            return False
        mine, theirs = _norm_variant(self), _norm_variant(other)
        return not mine or not theirs or mine == theirs

    def __str__(self) -> str:
        return "/".join(p for p in (self.os, self.architecture, self.variant) if p)


def _norm_variant(p: Platform) -> str:
    return "" if (p.architecture, p.variant) == ("arm64", "v8") else p.variant


@dataclass(frozen=True)
class ImageManifest:
    config: Descriptor
    layers: tuple[Descriptor, ...]


@dataclass(frozen=True)
class ImageConfig:
    """What the image says about how to run it (the OCI config's ``config`` object), as the node uses it."""

    env: tuple[str, ...] = ()  # "KEY=VALUE", in the image's order
    working_dir: str = ""
    user: str = ""
    cmd: tuple[str, ...] = ()
    entrypoint: tuple[str, ...] = ()


def _load(data: bytes, what: str) -> dict[str, Any]:
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ManifestInvalid(f"{what} is not valid JSON: {e}") from None
    if not isinstance(doc, dict):
        raise ManifestInvalid(f"{what} is not a JSON object")
    return doc


def _descriptor(obj: object, what: str) -> Descriptor:
    if not isinstance(obj, dict):
        raise ManifestInvalid(f"{what}: descriptor is not an object")
    media_type, digest, size = obj.get("mediaType"), obj.get("digest"), obj.get("size")
    if not isinstance(media_type, str) or not isinstance(digest, str) or not isinstance(size, int) or size < 0:
        raise ManifestInvalid(f"{what}: descriptor needs mediaType, digest and size")
    if not DIGEST_RE.fullmatch(digest):
        raise UnsupportedMediaType(f"{what}: digest {digest!r} is not sha256 (the only algorithm supported)")
    platform = None
    p = obj.get("platform")
    if isinstance(p, dict) and isinstance(p.get("os"), str) and isinstance(p.get("architecture"), str):
        variant = p.get("variant")
        platform = Platform(p["os"], p["architecture"], variant if isinstance(variant, str) else "")
    return Descriptor(media_type, digest, size, platform)


def media_type_of(data: bytes, header_type: str, what: str) -> str:
    """The media type of a fetched manifest: its own ``mediaType`` field, else the Content-Type it came with."""
    doc = _load(data, what)
    declared = doc.get("mediaType")
    media_type = declared if isinstance(declared, str) else header_type.split(";")[0].strip()
    if media_type in DOCKER_SCHEMA1 or doc.get("schemaVersion") == 1:
        raise UnsupportedMediaType(f"{what} is a Docker v2 schema 1 manifest (deprecated); re-push the image")
    if not media_type:  # an OCI manifest may omit mediaType; its shape tells
        media_type = OCI_INDEX if "manifests" in doc else OCI_MANIFEST
    if media_type not in INDEX_TYPES | MANIFEST_TYPES:
        raise UnsupportedMediaType(f"{what} has media type {media_type!r}, not an image manifest or index")
    return media_type


def parse_index(data: bytes, what: str) -> tuple[Descriptor, ...]:
    doc = _load(data, what)
    manifests = doc.get("manifests")
    if not isinstance(manifests, list):
        raise ManifestInvalid(f"{what}: index has no manifests list")
    return tuple(_descriptor(m, what) for m in manifests)


def choose_platform(entries: Sequence[Descriptor], platform: Platform, what: str) -> Descriptor:
    """The index entry for ``platform``; entries without a platform (attestations, ``unknown/unknown``) never
    match. Several matches (variants the caller did not name) take the first, as registries' clients do."""
    for entry in entries:
        if entry.platform is not None and entry.platform.matches(platform):
            return entry
    have = sorted({str(e.platform) for e in entries if e.platform is not None and e.platform.os != "unknown"})
    raise PlatformNotFound(f"{what} has no image for {platform}; it has: {', '.join(have) or 'no platforms'}")


def parse_image_manifest(data: bytes, what: str) -> ImageManifest:
    doc = _load(data, what)
    config = _descriptor(doc.get("config"), f"{what} config")
    raw_layers = doc.get("layers")
    if not isinstance(raw_layers, list):
        raise ManifestInvalid(f"{what}: manifest has no layers list")
    layers = tuple(_descriptor(layer, f"{what} layer {i}") for i, layer in enumerate(raw_layers))
    if config.media_type not in CONFIG_TYPES:
        raise UnsupportedMediaType(
            f"{what} is not a container image: config media type {config.media_type!r} "
            f"(expected one of {', '.join(sorted(CONFIG_TYPES))})"
        )
    for i, layer in enumerate(layers):
        if layer.media_type not in LAYER_COMPRESSION:
            raise UnsupportedMediaType(
                f"{what} layer {i} ({layer.digest[:19]}) has media type {layer.media_type!r}; supported: "
                "OCI tar, tar+gzip, tar+zstd and Docker tar.gzip (foreign/non-distributable layers are not)"
            )
    return ImageManifest(config, layers)


def _strings(value: object, what: str, key: str, *, one_string_ok: bool = False) -> tuple[str, ...]:
    if value is None:
        return ()
    if one_string_ok and isinstance(value, str):  # Docker reads a lone string as a one-item Cmd/Entrypoint
        return (value,)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ManifestInvalid(f"{what}: {key} is not a list of strings")
    return tuple(value)


def parse_config(data: bytes, what: str) -> tuple[ImageConfig, tuple[str, ...]]:
    """The run settings and ``rootfs.diff_ids`` (digests of the uncompressed layers, base first)."""
    doc = _load(data, what)
    rootfs = doc.get("rootfs")
    if not isinstance(rootfs, dict) or rootfs.get("type") != "layers":
        raise ManifestInvalid(f"{what}: config has no rootfs of type 'layers'")
    diff_ids = _strings(rootfs.get("diff_ids"), what, "rootfs.diff_ids")
    for d in diff_ids:
        if not DIGEST_RE.fullmatch(d):
            raise UnsupportedMediaType(f"{what}: diff_id {d!r} is not a sha256 digest")
    run = doc.get("config") or {}
    if not isinstance(run, dict):
        raise ManifestInvalid(f"{what}: config.config is not an object")

    def text(key: str) -> str:
        value = run.get(key)
        if value is None:
            return ""
        if not isinstance(value, str):
            raise ManifestInvalid(f"{what}: {key} is not a string")
        return value

    config = ImageConfig(
        env=_strings(run.get("Env"), what, "Env"),
        working_dir=text("WorkingDir"),
        user=text("User"),
        cmd=_strings(run.get("Cmd"), what, "Cmd", one_string_ok=True),
        entrypoint=_strings(run.get("Entrypoint"), what, "Entrypoint", one_string_ok=True),
    )
    return config, diff_ids
