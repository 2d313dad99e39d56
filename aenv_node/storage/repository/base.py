"""The layer repository interface: where committed layers and snapshot manifests live.

A repository is the persistent store shared by nodes (DESIGN.md "Storage").  It holds two kinds of objects:

* **layers**: immutable files named by the SHA-256 of their bytes (``sha256:<hex>``).  Being content-addressed
  they are never overwritten with different bytes, so a put of a layer that is already present is a no-op and a
  reader may cache any byte range forever (the local cache relies on this);
* **manifests**: small JSON documents (one per snapshot) naming the layers a snapshot stacks.

Atomicity is the contract every backend keeps: a reader never sees a partial layer or a partial manifest, and
``commit_snapshot`` writes a manifest only after every layer it names is present, so a manifest that is visible
is always usable.  Backends differ only in how they get there (rename in a directory; one PUT or a completed
multipart upload in S3).

All methods are blocking and thread-safe: async callers use ``trio.to_thread.run_sync``; the block engine calls
``read_range`` from its own OS threads (through the local cache).
"""

from __future__ import annotations

import abc
import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Mapping

from .errors import DigestMismatch, IncompleteSnapshot, InvalidName

__all__ = [
    "Repository",
    "CommitResult",
    "check_digest",
    "check_manifest_id",
    "layer_key",
    "manifest_key",
    "digest_of_file",
    "encode_manifest",
    "decode_manifest",
]

_DIGEST_RE = re.compile(r"^sha256:([0-9a-f]{64})$")
_MANIFEST_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")

#: How much of a source file is read at a time while hashing/copying it.
READ_CHUNK = 1 << 20


def check_digest(digest: str) -> str:
    """Return the hex part of a ``sha256:<hex>`` digest, or raise ``InvalidName``."""
    m = _DIGEST_RE.match(digest) if isinstance(digest, str) else None
    if m is None:
        raise InvalidName(f"not a layer digest (want 'sha256:' + 64 lowercase hex digits): {digest!r}")
    return m.group(1)


def check_manifest_id(manifest_id: str) -> str:
    if not isinstance(manifest_id, str) or _MANIFEST_ID_RE.match(manifest_id) is None:
        raise InvalidName(
            f"not a manifest id (1-128 chars of A-Z a-z 0-9 . _ -, not starting with . _ -): {manifest_id!r}"
        )
    return manifest_id


def layer_key(digest: str) -> str:
    """The repository-relative key of a layer: ``layers/sha256/ab/<hex>`` (the same in every backend)."""
    hexd = check_digest(digest)
    return f"layers/sha256/{hexd[:2]}/{hexd}"


def manifest_key(manifest_id: str) -> str:
    return f"manifests/{check_manifest_id(manifest_id)}.json"


def iter_file(path: str | os.PathLike[str], chunk: int = READ_CHUNK) -> Iterator[bytes]:
    """Read a file front to back until EOF (works for pipes too: no size is needed up front)."""
    with open(path, "rb", buffering=0) as f:
        while True:
            b = f.read(chunk)
            if not b:
                return
            yield b


def digest_of_file(path: str | os.PathLike[str]) -> str:
    h = hashlib.sha256()
    for b in iter_file(path):
        h.update(b)
    return "sha256:" + h.hexdigest()


def verify_digest(expected: str, h: "hashlib._Hash", source: str) -> None:
    actual = "sha256:" + h.hexdigest()
    if actual != expected:
        raise DigestMismatch(expected, actual, source)


def encode_manifest(manifest: Mapping[str, Any]) -> bytes:
    if not isinstance(manifest, Mapping):
        raise TypeError(f"a manifest is a JSON object (a mapping), not {type(manifest).__name__}")
    return json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()


def decode_manifest(data: bytes) -> dict[str, Any]:
    return json.loads(data)


@dataclass
class CommitResult:
    """What ``commit_snapshot`` did: which layers it uploaded, which were already present."""

    manifest_id: str
    uploaded: list[str] = field(default_factory=list)
    already_present: list[str] = field(default_factory=list)


class Repository(abc.ABC):
    """One interface over every backend (``posix_fs``, ``s3``).  Thread-safe, blocking."""

    kind: str = ""

    # -- layers -------------------------------------------------------------------------------------------
    @abc.abstractmethod
    def put_layer(self, digest: str, path: str | os.PathLike[str]) -> str:
        """Store the file at ``path`` as layer ``digest``; return its location (repository key).

        The bytes are hashed while they are stored; if they do not hash to ``digest`` nothing becomes visible
        and ``DigestMismatch`` is raised.  If the layer is already present this is a no-op (content-addressed).
        ``path`` is read front to back once, so it may be a pipe.
        """

    @abc.abstractmethod
    def read_range(self, digest: str, offset: int, length: int) -> bytes:
        """Up to ``length`` bytes of the layer from ``offset`` (shorter only at the end of the layer)."""

    @abc.abstractmethod
    def layer_size(self, digest: str) -> int:
        """Size in bytes of a stored layer (``LayerNotFound`` if absent)."""

    @abc.abstractmethod
    def has_layer(self, digest: str) -> bool: ...

    @abc.abstractmethod
    def delete_layer(self, digest: str) -> None:
        """Remove a layer (no error if it is absent).  The caller makes sure no manifest still names it."""

    @abc.abstractmethod
    def list_layers(self) -> list[str]:
        """Digests of every complete layer."""

    def layer_location(self, digest: str) -> str:
        return layer_key(digest)

    def local_path(self, digest: str) -> str | None:
        """A path this node can ``pread`` the layer from directly, or None (remote backends).  A node whose
        posix_fs repository is on local disk may read layers through ``FileSource`` and skip the cache."""
        return None

    def read_layer(self, digest: str) -> bytes:
        """A whole (small) layer; tests and tools.  Large layers are read by range through the cache."""
        return self.read_range(digest, 0, self.layer_size(digest))

    # -- manifests ----------------------------------------------------------------------------------------
    def put_manifest(self, manifest_id: str, manifest: Mapping[str, Any]) -> None:
        """Write (or replace) a manifest atomically.  Prefer ``commit_snapshot``, which checks its layers."""
        self._put_manifest_bytes(check_manifest_id(manifest_id), encode_manifest(manifest))

    def get_manifest(self, manifest_id: str) -> dict[str, Any]:
        """The manifest as written (``ManifestNotFound`` if absent)."""
        return decode_manifest(self._get_manifest_bytes(check_manifest_id(manifest_id)))

    @abc.abstractmethod
    def has_manifest(self, manifest_id: str) -> bool: ...

    @abc.abstractmethod
    def list_manifests(self) -> list[str]: ...

    @abc.abstractmethod
    def delete_manifest(self, manifest_id: str) -> None: ...

    # -- housekeeping -------------------------------------------------------------------------------------
    @abc.abstractmethod
    def sweep_incomplete(self, older_than_s: float = 3600.0) -> int:
        """Remove leftovers of writers that crashed mid-put (temp files, pending multipart uploads) older than
        ``older_than_s``; return how many were removed.  Never touches complete objects."""

    def close(self) -> None:
        """Release connections / descriptors."""

    def __enter__(self) -> "Repository":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- snapshot commit ----------------------------------------------------------------------------------
    def commit_snapshot(
        self,
        manifest_id: str,
        manifest: Mapping[str, Any],
        layer_paths: Mapping[str, str | os.PathLike[str]],
        require: Iterable[str] = (),
    ) -> CommitResult:
        """Publish a snapshot atomically: upload the missing layers, then write the manifest LAST.

        ``layer_paths`` maps digest -> local file for the layers this snapshot may need to upload (new layers);
        ``require`` names layers the manifest also references and that must already be in the repository
        (layers of parent snapshots).  If any is absent, ``IncompleteSnapshot`` is raised and no manifest is
        written.  A crash at any point leaves either no manifest (layers uploaded so far are harmless orphans
        for GC) or a complete snapshot.
        """
        check_manifest_id(manifest_id)
        data = encode_manifest(manifest)  # fail on a bad manifest before uploading anything
        result = CommitResult(manifest_id)
        for digest, path in layer_paths.items():
            if self.has_layer(digest):
                result.already_present.append(digest)
            else:
                self.put_layer(digest, path)
                result.uploaded.append(digest)
        missing = [d for d in dict.fromkeys(require) if d not in layer_paths and not self.has_layer(d)]
        if missing:
            raise IncompleteSnapshot(manifest_id, missing)
        self._put_manifest_bytes(manifest_id, data)
        return result

    @abc.abstractmethod
    def _put_manifest_bytes(self, manifest_id: str, data: bytes) -> None:
        """Atomically write one manifest's bytes (a reader sees the old or the new document, never a mix)."""

    @abc.abstractmethod
    def _get_manifest_bytes(self, manifest_id: str) -> bytes: ...
