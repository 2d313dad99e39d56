"""Errors of the OCI pull, one class per thing a caller (or the person reading a build log) acts on differently.

Every class derives from :class:`aenv_node.images.errors.ImageError` through :class:`OciError`, so the template
builder can catch the whole family at once; messages are one line, name the reference or registry involved
and, where a setting decides the outcome, the config key to change.
"""

from __future__ import annotations

from ..errors import ImageError

__all__ = [
    "BadReference",
    "DigestMismatch",
    "ImageNotFound",
    "InsecureRegistryRefused",
    "ManifestInvalid",
    "OciError",
    "PlatformNotFound",
    "RegistryAuthError",
    "RegistryError",
    "RegistryUnreachable",
    "UnsupportedMediaType",
]


class OciError(ImageError):
    """Base class of every error raised while pulling an OCI image."""


class BadReference(OciError, ValueError):
    """An image reference is malformed (``[host[:port]/]path[:tag][@sha256:<64 hex>]``)."""


class RegistryUnreachable(OciError):
    """A registry (or its token server) could not be reached: connection refused, timeout, TLS failure."""


class RegistryError(OciError):
    """A registry answered with an error the pull has no specific class for (5xx, rate limits, odd replies)."""


class RegistryAuthError(OciError):
    """The registry refused the credentials given for this pull (or wants some and none were given)."""


class ImageNotFound(OciError):
    """No registry has the repository, tag or digest asked for (manifest 404, NAME_UNKNOWN, MANIFEST_UNKNOWN)."""


class PlatformNotFound(OciError):
    """An image index (manifest list) has no manifest for the node's platform; the message lists what it has."""


class UnsupportedMediaType(OciError):
    """A manifest, config or layer has a media type the node cannot use (schema 1, foreign layers, artifacts)."""


class ManifestInvalid(OciError):
    """A manifest, index or image config is not valid JSON of the expected shape."""


class DigestMismatch(OciError):
    """Content did not hash to the digest it was fetched by (a blob, a manifest, or a layer's ``diff_id``)."""


class InsecureRegistryRefused(OciError):
    """A registry (or token realm) speaks plain HTTP but is not listed in ``images.insecure_registries``."""
