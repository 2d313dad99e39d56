"""Manifest documents as the repository stores them, and what the repository itself reads from a snapshot's.

Every manifest is one JSON object, encoded one way (``encode_manifest``: sorted keys, no spaces), so equal
documents are equal bytes.  The repository never interprets a snapshot manifest beyond the layers it names:
``LayerManifest`` is that part, typed (its ``disk_layers`` and ``memory_layers``).  Garbage collection marks
from it (gc.py).  It keeps every other field as it came (``extra="allow"``), so the snapshot layer owns the
full document as a subclass (``SnapshotManifest(LayerManifest)``) and a collection never needs to know those
fields.

Also here: the name of a layer (``check_digest``), which the models validate and every backend checks.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Annotated, Any, Self

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator

from .errors import InvalidName

__all__ = [
    "DIGEST_PATTERN",
    "Digest",
    "DiskLayerRef",
    "LayerManifest",
    "check_digest",
    "check_manifest_id",
    "decode_manifest",
    "encode_manifest",
]

#: what a manifest id may be (also the name of its file or key)
_MANIFEST_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def check_manifest_id(manifest_id: str) -> str:
    if not isinstance(manifest_id, str) or _MANIFEST_ID_RE.match(manifest_id) is None:
        raise InvalidName(
            f"not a manifest id (1-128 chars of A-Z a-z 0-9 . _ -, not starting with . _ -): {manifest_id!r}"
        )
    return manifest_id


#: A layer's name: ``sha256:`` + the 64 lowercase hex digits of the SHA-256 of its bytes.
DIGEST_PATTERN = r"^sha256:([0-9a-f]{64})$"
_DIGEST_RE = re.compile(DIGEST_PATTERN)

#: A layer digest inside a model (a malformed one fails validation: a ``ValueError``).
Digest = Annotated[str, StringConstraints(pattern=DIGEST_PATTERN)]


def check_digest(digest: str) -> str:
    """Return the hex part of a ``sha256:<hex>`` digest, or raise ``InvalidName``."""
    m = _DIGEST_RE.match(digest) if isinstance(digest, str) else None
    if m is None:
        raise InvalidName(f"not a layer digest (want 'sha256:' + 64 lowercase hex digits): {digest!r}")
    return m.group(1)


def encode_manifest(manifest: Mapping[str, Any]) -> bytes:
    """The bytes of a manifest: compact JSON with sorted keys (equal documents are equal bytes)."""
    if not isinstance(manifest, Mapping):
        raise TypeError(f"a manifest is a JSON object (a mapping), not {type(manifest).__name__}")
    return json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()


def decode_manifest(data: bytes) -> dict[str, Any]:
    """A manifest's document (``ValueError`` if the bytes are not one JSON object)."""
    doc = json.loads(data)
    if not isinstance(doc, dict):
        raise ValueError(f"a manifest is a JSON object, not {type(doc).__name__}")
    return doc


class DiskLayerRef(BaseModel):
    """One disk layer a snapshot stacks (bottom first): its digest, its size in bytes, the size of the disk it
    describes.  Other fields a writer adds are kept."""

    model_config = ConfigDict(extra="allow")

    digest: Digest
    size: int
    virtual_size: int = 0


class LayerManifest(BaseModel):
    """The part of a snapshot manifest the repository reads: the layers it names.

    ``version`` is the format of the document (1 today).  A manifest written without one of the two lists
    names no layer of that kind.  Fields this model does not declare stay in the document: ``decode`` then
    ``encode`` gives back the same bytes for a document in ``encode_manifest`` form."""

    model_config = ConfigDict(extra="allow")

    version: int = 1
    disk_layers: list[DiskLayerRef] = Field(default_factory=list)
    memory_layers: list[Digest] = Field(default_factory=list)

    @field_validator("disk_layers", "memory_layers", mode="before")
    @classmethod
    def _null_is_empty(cls, v: Any) -> Any:
        return [] if v is None else v

    def layer_digests(self) -> list[str]:
        """Every layer the snapshot needs: its disk layers, then its memory layers, each bottom first."""
        return [d.digest for d in self.disk_layers] + list(self.memory_layers)

    @classmethod
    def decode(cls, data: bytes) -> Self:
        """Parse a stored manifest (``ValueError``, e.g. pydantic's ``ValidationError``, if it is not one)."""
        return cls.model_validate(decode_manifest(data))

    def encode(self) -> bytes:
        """The bytes to store (``encode_manifest`` of the whole document, undeclared fields included)."""
        return encode_manifest(self.model_dump(mode="json"))
