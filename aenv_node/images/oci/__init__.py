"""OCI images: pulling from registries and applying layers onto filesystem trees.

The pull's public face is :func:`pull` (reference in, :class:`PulledImage` out: pinned by manifest digest, layers
verified in a local content-addressed store), :func:`open_layer_tar` (a layer as its uncompressed tar, checked
against its ``diff_id``), :func:`parse_reference` and the typed errors, all subclasses of
:class:`aenv_node.images.errors.ImageError`. The modules behind it: :mod:`.reference`, :mod:`.manifest`,
:mod:`.auth`, :mod:`.registry`, :mod:`.store`, :mod:`.layers`, :mod:`.pulling`.

The errors and the reference parser are imported eagerly (they need nothing); the rest is imported when first
used (PEP 562), because layers are applied in ``python -m aenv_node.images.oci.<module>`` processes of their own,
which would otherwise pay for importing httpx and Trio (a quarter of a second) before every layer. That is also
why the operation's module is ``pulling``, not ``pull``: a submodule named like the function would, once
imported, replace the lazily bound function as this package's ``pull`` attribute.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import (
    BadReference,
    DigestMismatch,
    ImageNotFound,
    InsecureRegistryRefused,
    ManifestInvalid,
    OciError,
    PlatformNotFound,
    RegistryAuthError,
    RegistryError,
    RegistryUnreachable,
    UnsupportedMediaType,
)
from .reference import ImageReference, parse_reference

if TYPE_CHECKING:
    from .layers import OciLayer, open_layer_tar
    from .manifest import ImageConfig
    from .pulling import PulledImage, pull

__all__ = [
    "BadReference",
    "DigestMismatch",
    "ImageConfig",
    "ImageNotFound",
    "ImageReference",
    "InsecureRegistryRefused",
    "ManifestInvalid",
    "OciError",
    "OciLayer",
    "PlatformNotFound",
    "PulledImage",
    "RegistryAuthError",
    "RegistryError",
    "RegistryUnreachable",
    "UnsupportedMediaType",
    "open_layer_tar",
    "parse_reference",
    "pull",
]

_LAZY = {
    "ImageConfig": ".manifest",
    "OciLayer": ".layers",
    "open_layer_tar": ".layers",
    "PulledImage": ".pulling",
    "pull": ".pulling",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    loaded = importlib.import_module(module, __name__)
    for exported, source in _LAZY.items():  # bind all of the module's names at once
        if source == module:
            globals()[exported] = getattr(loaded, exported)
    return globals()[name]
