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

**Sandbox ownership** (single-writer across nodes).  A sandbox's ``sandbox-<id>`` manifest is both the pointer
to its newest published snapshot and its ownership record: ``owner`` (the node that last claimed or published
it), ``state`` (``paused``: any node may claim it; ``running``: that node runs it) and ``generation`` (bumped by
every write).  It is one document on purpose: "which snapshot is newest" and "who may run it" change together
(a publish sets both), and one object is one compare-and-swap, so no reader ever sees a pointer and an owner
that disagree.  Every change is a compare-and-swap against the version the caller read (``Ownership.token``):
the backend primitives ``_get_versioned`` / ``_put_if`` / ``_delete_if`` are a lock around read-compare-write
(posix_fs) or conditional requests (S3 ``If-None-Match: *`` / ``If-Match: <etag>``).  A backend that cannot do
that raises ``OwnershipUnsupported`` instead of writing without the guarantee.  The record itself (its fields,
its version, how a pointer written before ownership existed reads) is ``Ownership`` in ownership.py, the one
module that parses and encodes it; what the repository reads from a snapshot manifest (the layers it names) is
``LayerManifest`` in manifest.py.
"""

from __future__ import annotations

import abc
import enum
import hashlib
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Optional, TypeVar, Union

from ...faults import crash_point
from .errors import (
    DigestMismatch,
    ManifestCorrupt,
    IncompleteSnapshot,
    OwnershipChanged,
    OwnershipConflict,
    OwnershipUnsupported,
)
from .chunksums import ChunkSums
from .manifest import _MANIFEST_ID_RE, LayerManifest, check_digest, check_manifest_id, decode_manifest, encode_manifest
from .ownership import (
    OWNER_DELETING,
    OWNER_PAUSED,
    OWNER_RUNNING,
    Ownership,
    OwnerState,
    sandbox_record_id,
)

if TYPE_CHECKING:
    import threading

    from .gc import GcReport

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
    "Ownership",
    "OWNER_PAUSED",
    "OWNER_RUNNING",
    "OWNER_DELETING",
    "sandbox_record_id",
    "ObjectInfo",
    "LayerManifest",
]

M = TypeVar("M", bound=LayerManifest)


#: How much of a source file is read at a time while hashing/copying it.
READ_CHUNK = 1 << 20




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


#: How often a claim/publish/delete re-reads and retries after losing a compare-and-swap to a concurrent writer.
CAS_RETRIES = 8


class _Read(enum.Enum):
    READ = "read"


#: "read the record yourself" (the default of ``expect``).
_READ: Final = _Read.READ
#: What a compare-and-swap is against: a record the caller read, None ("absent"), or ``_READ``.
Expect = Union[Ownership, None, _Read]
T = TypeVar("T")


@dataclass(frozen=True)
class ObjectInfo:
    """What garbage collection needs to know about a stored object: when it was last written *or reused*
    (seconds since the epoch; ``Repository.touch_layer`` moves it forward) and its size in bytes."""

    mtime: float
    size: int


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
        and ``DigestMismatch`` is raised.  If the layer is already present nothing is stored (content-addressed)
        but its age is refreshed (``touch_layer``), so a garbage collection does not sweep a layer being reused.
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

    # -- per-chunk checksum records (chunksums.py: what a node checks a range from a peer against) -------------
    def get_chunksums(self, digest: str) -> Optional[ChunkSums]:
        """The layer's per-chunk checksum record, or None if it has none (put before records existed, or a
        backend that keeps none); ``ValueError`` if the stored record is not one this code reads."""
        data = self._get_chunksums_bytes(digest)
        return None if data is None else ChunkSums.decode(data)

    def _get_chunksums_bytes(self, digest: str) -> Optional[bytes]:
        """The stored record's bytes, None if absent (a backend without records: always None)."""
        return None

    def read_layer(self, digest: str) -> bytes:
        """A whole (small) layer; tests and tools.  Large layers are read by range through the cache."""
        return self.read_range(digest, 0, self.layer_size(digest))

    # -- manifests ----------------------------------------------------------------------------------------
    def put_manifest(self, manifest_id: str, manifest: Mapping[str, Any]) -> None:
        """Write (or replace) a manifest atomically.  Prefer ``commit_snapshot``, which checks its layers."""
        self._put_manifest_bytes(check_manifest_id(manifest_id), encode_manifest(manifest))

    def get_manifest(self, manifest_id: str) -> dict[str, Any]:
        """The manifest as written (``ManifestNotFound`` if absent, ``ManifestCorrupt`` if not a JSON object)."""
        data = self._get_manifest_bytes(check_manifest_id(manifest_id))
        try:
            return decode_manifest(data)
        except ValueError as exc:
            raise ManifestCorrupt(manifest_id, str(exc)) from exc

    @abc.abstractmethod
    def has_manifest(self, manifest_id: str) -> bool: ...

    @abc.abstractmethod
    def list_manifests(self) -> list[str]: ...

    @abc.abstractmethod
    def delete_manifest(self, manifest_id: str) -> None: ...

    def read_manifest(self, manifest_id: str, model: type[M]) -> M:
        """A snapshot manifest parsed as ``model`` (``LayerManifest`` or a subclass): ``ManifestNotFound`` if
        absent, ``ManifestCorrupt`` (a ``ValueError``) if it is not one."""
        data = self._get_manifest_bytes(check_manifest_id(manifest_id))
        try:
            return model.decode(data)
        except ValueError as exc:
            raise ManifestCorrupt(manifest_id, str(exc).splitlines()[0]) from exc

    # -- sandbox ownership (single-writer across nodes) ----------------------------------------------------
    def get_ownership(self, sandbox_id: str) -> Optional[Ownership]:
        """The sandbox's record, or None if it has none (never published, or killed); ``ValueError`` if the
        record is not one this code can read (ownership.py)."""
        record_id = sandbox_record_id(sandbox_id)
        if _MANIFEST_ID_RE.match(record_id) is None:
            return None  # no record can have this name: an id no node gave a sandbox (a client's typo)
        got = self._get_versioned(record_id)
        return None if got is None else Ownership.parse(sandbox_id, *got)

    def claim_sandbox(self, sandbox_id: str, owner: str, *, expect: Expect = _READ,
                      take_over_from: Optional[str] = None) -> Ownership:
        """Claim a sandbox to run it: (absent | ``paused`` | held by ``owner``) -> ``running``, owned by ``owner``.

        ``OwnershipConflict`` if another node holds it, unless it is ``take_over_from`` running it: the caller
        has learnt that node is dead (the cluster's scheduler missed its heartbeats) and resumes the sandbox from
        the last snapshot it published.  With ``expect`` (a record the caller read and decided on, or None for
        "absent"), the swap is against exactly that version and ``OwnershipChanged`` is raised if it moved on;
        without it the record is read here and the swap retried on a lost race.
        """
        def attempt(cur: Optional[Ownership]) -> Ownership:
            taken = (cur is not None and take_over_from is not None and cur.owner == take_over_from
                     and cur.state == OWNER_RUNNING)
            if cur is not None and cur.held_by_other(owner) and not taken:
                raise OwnershipConflict(sandbox_id, cur.owner, cur.state, "resume")
            return self._swap(cur, sandbox_id, owner=owner, state=OWNER_RUNNING,
                              snapshot_id=cur.snapshot_id if cur is not None else None)

        return self._cas(sandbox_id, expect, attempt)

    def checkpoint_sandbox(self, sandbox_id: str, owner: str, snapshot_id: str, *,
                           expect: Expect = _READ) -> Ownership:
        """Publish a running sandbox's periodic snapshot: (absent | owned by ``owner``) -> ``running`` at
        ``snapshot_id``, owner ``owner``: what another node resumes it from if this node dies.

        ``OwnershipConflict`` if another node owns the record (it took the sandbox over: this node's copy must
        stop).  ``expect`` as in ``claim_sandbox``.
        """
        def attempt(cur: Optional[Ownership]) -> Ownership:
            if cur is not None and cur.owner not in ("", owner):
                raise OwnershipConflict(sandbox_id, cur.owner, cur.state, "checkpoint")
            return self._swap(cur, sandbox_id, owner=owner, state=OWNER_RUNNING, snapshot_id=snapshot_id,
                              publish=True)

        return self._cas(sandbox_id, expect, attempt)

    def release_sandbox(self, sandbox_id: str, owner: str, snapshot_id: Optional[str], *,
                        expect: Expect = _READ) -> Ownership:
        """Publish a pause: (absent | owned by ``owner`` | legacy) -> ``paused`` at ``snapshot_id``, owner ``owner``.

        ``OwnershipConflict`` if another node owns the record (it claimed the sandbox meanwhile: this node's
        copy is not the newest any more).  ``expect`` as in ``claim_sandbox``.
        """
        def attempt(cur: Optional[Ownership]) -> Ownership:
            if cur is not None and cur.owner not in ("", owner):
                raise OwnershipConflict(sandbox_id, cur.owner, cur.state, "publish")
            return self._swap(cur, sandbox_id, owner=owner, state=OWNER_PAUSED, snapshot_id=snapshot_id,
                              publish=True)

        return self._cas(sandbox_id, expect, attempt)

    def drop_ownership(self, sandbox_id: str, owner: str, *, expect: Expect = _READ) -> bool:
        """Delete the record if ``owner`` owns it (or it is a legacy pointer); False if there is none.

        ``OwnershipConflict`` if another node owns it (it is not this node's to delete)."""
        def attempt(cur: Optional[Ownership]) -> bool:
            if cur is None:
                return False
            if cur.owner not in ("", owner):
                raise OwnershipConflict(sandbox_id, cur.owner, cur.state, "delete")
            self._delete_if(sandbox_record_id(sandbox_id), cur.token)
            return True

        return self._cas(sandbox_id, expect, attempt)

    def _swap(self, cur: Optional[Ownership], sandbox_id: str, *, owner: str, state: OwnerState,
              snapshot_id: Optional[str], publish: bool = False) -> Ownership:
        """Replace ``cur`` by its successor if it is still the stored version (``OwnershipChanged`` if not)."""
        new = Ownership.successor(sandbox_id, cur, owner=owner, state=state, snapshot_id=snapshot_id,
                                  publish=publish)
        token = self._put_if(sandbox_record_id(sandbox_id), new.encode(), cur.token if cur is not None else None)
        return new.with_token(token)

    def _cas(self, sandbox_id: str, expect: Expect, attempt: Callable[[Optional[Ownership]], T]) -> T:
        """Run ``attempt`` on the record (``expect``, or as read now); on a lost race read again and retry,
        unless the caller gave the version to swap against."""
        for _ in range(CAS_RETRIES):
            cur = self.get_ownership(sandbox_id) if isinstance(expect, _Read) else expect
            try:
                return attempt(cur)
            except OwnershipChanged:
                if not isinstance(expect, _Read):
                    raise
        raise OwnershipChanged(sandbox_id, f"lost {CAS_RETRIES} compare-and-swaps in a row to other writers")

    def _get_versioned(self, manifest_id: str) -> Optional[tuple[bytes, str]]:
        """A manifest's bytes and a version token (changes whenever the bytes do), or None if absent."""
        from .errors import ManifestNotFound

        try:
            data = self._get_manifest_bytes(check_manifest_id(manifest_id))
        except ManifestNotFound:
            return None
        return data, hashlib.sha256(data).hexdigest()[:32]

    def _put_if(self, manifest_id: str, data: bytes, expect_token: Optional[str]) -> str:
        """Write the manifest only if its current version is ``expect_token`` (None: only if it is absent);
        return the new version.  ``OwnershipChanged`` if the precondition fails."""
        raise OwnershipUnsupported(f"the {self.kind or type(self).__name__} repository cannot compare-and-swap: "
                                   "sandbox ownership cannot be enforced on it")

    def _delete_if(self, manifest_id: str, expect_token: str) -> None:
        """Delete the manifest only if its current version is ``expect_token`` (``OwnershipChanged`` if not)."""
        raise OwnershipUnsupported(f"the {self.kind or type(self).__name__} repository cannot compare-and-swap: "
                                   "sandbox ownership cannot be enforced on it")

    # -- housekeeping -------------------------------------------------------------------------------------
    @abc.abstractmethod
    def sweep_incomplete(self, older_than_s: float = 3600.0) -> int:
        """Remove leftovers of writers that crashed mid-put (temp files, pending multipart uploads) older than
        ``older_than_s``; return how many were removed.  Never touches complete objects."""

    # -- object ages (garbage collection, see gc.py) ----------------------------------------------------
    @abc.abstractmethod
    def touch_layer(self, digest: str) -> bool:
        """Record that a publish is reusing layer ``digest`` right now (its ``ObjectInfo.mtime`` becomes
        "now"), so a concurrent garbage collection does not sweep it; False if the layer is absent."""

    @abc.abstractmethod
    def layer_infos(self) -> dict[str, ObjectInfo]:
        """Every complete layer with its age and size, in as few requests as the backend allows."""

    @abc.abstractmethod
    def layer_info(self, digest: str) -> Optional[ObjectInfo]:
        """One layer's age and size, read now (None if absent): the re-check right before a delete."""

    @abc.abstractmethod
    def manifest_infos(self) -> dict[str, ObjectInfo]:
        """Every manifest (snapshot manifests and ``sandbox-<id>`` records) with its age and size."""

    @abc.abstractmethod
    def manifest_info(self, manifest_id: str) -> Optional[ObjectInfo]:
        """One manifest's age and size, read now (None if absent)."""

    def sweep_reuse_marks(self, older_than: float, *, dry_run: bool = False) -> int:
        """Remove the backend's records of layer reuse written before ``older_than`` (epoch seconds); return
        how many.  Backends that refresh the layer object itself (posix_fs) keep none."""
        return 0

    def collect_garbage(self, grace_s: float, *, dry_run: bool = False,
                        stop: Optional["threading.Event"] = None) -> "GcReport":
        """Remove snapshot manifests and layers no ``sandbox-<id>`` record reaches, older than ``grace_s``.

        See gc.py for the rules and the assumptions that make it safe next to publishers on other nodes
        (chiefly: a publish completes within ``grace_s``).  ``dry_run`` computes the same report and removes
        nothing; ``stop`` (set from another thread) ends the sweep early, between two deletions.
        """
        from .gc import collect_garbage

        return collect_garbage(self, grace_s, dry_run=dry_run, stop=stop)

    def close(self) -> None:  # noqa: B027 - a default that does nothing, not an abstract method: optional to override
        """Release connections / descriptors."""

    def __enter__(self) -> "Repository":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- snapshot commit ----------------------------------------------------------------------------------
    def commit_snapshot(
        self,
        manifest_id: str,
        manifest: LayerManifest | Mapping[str, Any],
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
        # fail on a bad manifest before uploading anything
        data = manifest.encode() if isinstance(manifest, LayerManifest) else encode_manifest(manifest)
        result = CommitResult(manifest_id)
        # Reused layers (already present, or required from parent snapshots) are *touched*, not just checked:
        # that moves their age forward so a garbage collection running meanwhile on any node leaves them
        # alone until this manifest is written and reaches them (gc.py).
        for digest, path in layer_paths.items():
            if self.touch_layer(digest):
                result.already_present.append(digest)
            else:
                self.put_layer(digest, path)
                result.uploaded.append(digest)
                crash_point("publish.layers_uploaded")
        missing = [d for d in dict.fromkeys(require) if d not in layer_paths and not self.touch_layer(d)]
        if missing:
            raise IncompleteSnapshot(manifest_id, missing)
        self._put_manifest_bytes(manifest_id, data)
        return result

    @abc.abstractmethod
    def _put_manifest_bytes(self, manifest_id: str, data: bytes) -> None:
        """Atomically write one manifest's bytes (a reader sees the old or the new document, never a mix)."""

    @abc.abstractmethod
    def _get_manifest_bytes(self, manifest_id: str) -> bytes: ...
