"""Pulling an image onto the host: reference -> manifest for the node's platform -> config and layers in the store.

The node pulls images itself, never inside a VM, so that a template can be built from any image without giving
a build VM network access or registry credentials. :func:`pull` is the whole operation; what it returns
(:class:`PulledImage`) pins the image by manifest digest and points at verified blobs in the local store, which
is all the layer applier needs. ``progress`` receives one human line per step; they become the template's
build log.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from .errors import ImageNotFound, ManifestInvalid
from .layers import OciLayer
from .manifest import ImageConfig, Platform, parse_config
from .reference import ImageReference, parse_reference
from .registry import RegistryClient, ResolvedManifest
from .store import BlobStore, fetch_blobs, human_size, short_digest

__all__ = ["PulledImage", "pull"]


@dataclass(frozen=True)
class PulledImage:
    """An image as pulled: pinned by digest, its layers (base first) verified in the local store."""

    reference: str  # as given to pull()
    canonical: str  # registry/repository@sha256:... (pulling it again gives exactly this image)
    digest: str  # of the image manifest (for an index: of the manifest chosen for the platform)
    config: ImageConfig
    layers: tuple[OciLayer, ...]
    index_digest: str | None = None  # of the index (manifest list) the manifest was chosen from, if any


def _silent(_: str) -> None:
    pass


async def _resolve(
    client: RegistryClient,
    reference: str,
    parsed: ImageReference,
    registries: Sequence[str],
    platform: Platform,
) -> ResolvedManifest:
    """The first registry that has the image, in the order configured. Only "not found" moves on to the next
    registry: an auth failure or an unreachable registry stops the pull, since a later registry's image of the
    same name may not be the one meant."""
    candidates = parsed.candidates(registries)
    missing: list[str] = []
    for candidate in candidates:
        try:
            return await client.resolve(candidate, platform)
        except ImageNotFound as e:
            if len(candidates) == 1:
                raise
            missing.append(str(e))
    raise ImageNotFound(
        f"{reference}: not found in any of the registries {', '.join(registries)} ({'; '.join(missing)})"
    )


async def pull(
    ref: str,
    *,
    store_dir: Path,
    registries: Sequence[str],
    insecure_registries: Sequence[str],
    concurrency: int,
    credentials: tuple[str, str] | None = None,
    platform: str = "linux/amd64",
    progress: Callable[[str], None] | None = None,
    ca_bundle: Path | None = None,
) -> PulledImage:
    """Pull ``ref`` into the blob store at ``store_dir`` (the node's ``<images cache dir>/oci``).

    ``registries`` resolve short names, in order (``images.registries``); ``insecure_registries`` are spoken to
    over plain HTTP (``images.insecure_registries``); ``concurrency`` blobs download at once
    (``images.pull_concurrency``). ``credentials`` (username, password) are offered to registries that ask,
    for this pull only. ``ca_bundle`` adds trusted CAs (a registry with a private certificate). Raises the
    package's :class:`~.errors.OciError` subclasses; a ``ValueError`` for a malformed ``platform``.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency (images.pull_concurrency) must be at least 1, not {concurrency}")
    say = progress or _silent
    parsed = parse_reference(ref)
    target = Platform.parse(platform)
    store = BlobStore(store_dir)
    started = time.monotonic()
    async with RegistryClient(
        insecure_registries=insecure_registries, credentials=credentials, ca_bundle=ca_bundle
    ) as client:
        resolved = await _resolve(client, ref, parsed, registries, target)
        image_ref = resolved.reference
        canonical = str(image_ref.with_digest(resolved.digest))
        via = f" ({target} from index {short_digest(resolved.index_digest)})" if resolved.index_digest else ""
        say(f"resolved {ref} to {canonical}{via}")
        manifest = resolved.manifest
        config_path = await store.fetch(client, image_ref, manifest.config)
        config, diff_ids = parse_config(config_path.read_bytes(), f"config of {canonical}")
        if len(diff_ids) != len(manifest.layers):
            raise ManifestInvalid(
                f"{canonical}: manifest has {len(manifest.layers)} layers, config lists {len(diff_ids)} diff_ids"
            )
        total = sum(layer.size for layer in manifest.layers)
        say(f"{len(manifest.layers)} layers, {human_size(total)}")
        paths = await fetch_blobs(
            store, client, image_ref, manifest.layers, concurrency=concurrency, progress=say
        )
    layers = tuple(
        OciLayer(digest=d.digest, diff_id=diff_id, media_type=d.media_type, size=d.size, path=paths[d.digest])
        for d, diff_id in zip(manifest.layers, diff_ids, strict=True)
    )
    say(f"pulled {canonical} in {time.monotonic() - started:.1f}s")
    return PulledImage(
        reference=ref,
        canonical=canonical,
        digest=resolved.digest,
        config=config,
        layers=layers,
        index_digest=resolved.index_digest,
    )
