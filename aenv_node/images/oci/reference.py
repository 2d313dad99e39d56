"""Image references: ``[host[:port]/]path[:tag][@sha256:<hex>]``, parsed and resolved to registries.

The grammar is distribution's (``github.com/distribution/reference``), written out here because no maintained
Python package implements it and the node needs only the parse, not the registry client those packages bring:

- The first ``/``-separated component is a registry host only if it looks like one (has a ``.`` or a ``:``, is
  ``localhost``, or has upper-case letters); otherwise the whole name is a path and the reference is *short*.
- A short name is looked up through the registries the caller configures (``images.registries``), in order;
  ``docker.io`` is Docker Hub: its API lives at ``registry-1.docker.io`` and a one-component name there is an
  official image (``python`` is ``library/python``).
- A reference without tag or digest means ``:latest``; with a digest, the digest decides what is pulled and the
  tag is kept only to be shown. Only sha256 digests are accepted: it is what every registry serves and what the
  blob store verifies.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, replace

from .errors import BadReference

__all__ = [
    "DOCKER_HUB",
    "ImageReference",
    "normalize_registry",
    "parse_reference",
]

DOCKER_HUB = "docker.io"
DOCKER_HUB_ENDPOINT = "registry-1.docker.io"
_DOCKER_HUB_ALIASES = frozenset({"docker.io", "index.docker.io", "registry-1.docker.io"})
NAME_MAX = 255

_DOMAIN_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_DOMAIN_RE = re.compile(rf"(?:{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*|\[[0-9A-Fa-f:.]+\])(?::[0-9]{{1,5}})?")
_PATH_COMPONENT_RE = re.compile(r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*")
_TAG_RE = re.compile(r"[\w][\w.-]{0,127}")
DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}")


def normalize_registry(host: str) -> str:
    """A registry as written in config or a reference (``host[:port]``), with Docker Hub's aliases folded."""
    host = host.strip().rstrip("/")
    if not _DOMAIN_RE.fullmatch(host):
        raise BadReference(f"not a registry host[:port]: {host!r}")
    return DOCKER_HUB if host.lower() in _DOCKER_HUB_ALIASES else host


@dataclass(frozen=True)
class ImageReference:
    """A parsed reference. ``registry`` is None for a short name, which :meth:`candidates` resolves."""

    registry: str | None
    repository: str
    tag: str | None
    digest: str | None

    @property
    def endpoint(self) -> str:
        """The ``host[:port]`` the Registry API is reached at (Docker Hub's API host is not ``docker.io``)."""
        if self.registry is None:
            raise BadReference(f"{self} has no registry yet: resolve it with candidates()")
        return DOCKER_HUB_ENDPOINT if self.registry == DOCKER_HUB else self.registry

    @property
    def name(self) -> str:
        """``registry/repository`` (just the repository for a short name)."""
        return self.repository if self.registry is None else f"{self.registry}/{self.repository}"

    @property
    def manifest_ref(self) -> str:
        """What goes after ``/manifests/`` in the API: the digest if there is one, else the tag."""
        return self.digest or self.tag or "latest"

    def on(self, registry: str) -> ImageReference:
        """This short name looked up on ``registry`` (Docker Hub prefixes one-component names with library/)."""
        registry = normalize_registry(registry)
        repository = self.repository
        if registry == DOCKER_HUB and "/" not in repository:
            repository = f"library/{repository}"
        return replace(self, registry=registry, repository=repository)

    def candidates(self, registries: Sequence[str]) -> tuple[ImageReference, ...]:
        """Where to look, in order: this reference itself if it names a registry, else one per registry given."""
        if self.registry is not None:
            return (self,)
        if not registries:
            raise BadReference(f"{self} names no registry and images.registries is empty")
        return tuple(self.on(r) for r in registries)

    def with_digest(self, digest: str) -> ImageReference:
        """The canonical, immutable form: same repository, pinned to ``digest``, no tag."""
        return replace(self, tag=None, digest=digest)

    def __str__(self) -> str:
        text = self.name
        if self.tag is not None:
            text += f":{self.tag}"
        if self.digest is not None:
            text += f"@{self.digest}"
        return text


def parse_reference(text: str) -> ImageReference:
    """Parse ``[host[:port]/]path[:tag][@sha256:<hex>]``; :class:`BadReference` says what is wrong."""
    if not text or text != text.strip() or any(c.isspace() for c in text):
        raise BadReference(f"bad image reference {text!r}: empty or contains whitespace")
    rest, at, digest = text.partition("@")
    if at:
        if not DIGEST_RE.fullmatch(digest):
            raise BadReference(f"bad image reference {text!r}: digest must be sha256: and 64 lower-case hex digits")
    slash = rest.rfind("/")
    colon = rest.rfind(":")
    tag: str | None = None
    if colon > slash:
        rest, tag = rest[:colon], rest[colon + 1 :]
        if not _TAG_RE.fullmatch(tag):
            raise BadReference(f"bad image reference {text!r}: invalid tag {tag!r}")
    registry: str | None = None
    path = rest
    first, sep, remainder = rest.partition("/")
    if sep and (("." in first) or (":" in first) or first == "localhost" or first != first.lower()):
        if not _DOMAIN_RE.fullmatch(first):
            raise BadReference(f"bad image reference {text!r}: invalid registry host {first!r}")
        registry, path = normalize_registry(first), remainder
    if not path:
        raise BadReference(f"bad image reference {text!r}: no repository name")
    for component in path.split("/"):
        if not _PATH_COMPONENT_RE.fullmatch(component):
            raise BadReference(
                f"bad image reference {text!r}: invalid repository component {component!r} "
                "(lower-case letters, digits and single . _ __ - separators)"
            )
    if len(rest) > NAME_MAX:
        raise BadReference(f"bad image reference {text!r}: name longer than {NAME_MAX} characters")
    if registry == DOCKER_HUB and "/" not in path:
        path = f"library/{path}"
    if tag is None and not at:
        tag = "latest"
    return ImageReference(registry=registry, repository=path, tag=tag, digest=digest if at else None)
