"""Typed errors of the layer repository.

They derive from ``StorageError`` so callers that only care "storage failed" catch one class, while the node's
reconciler and the snapshot code can tell a missing layer (re-commit it, or mark the snapshot broken) from a
repository that is unreachable (retry later) or a digest that does not match its bytes (never store it).
"""

from __future__ import annotations

from ..errors import StorageError

__all__ = [
    "RepositoryError",
    "RepositoryUnavailable",
    "LayerNotFound",
    "ManifestNotFound",
    "ManifestCorrupt",
    "DigestMismatch",
    "InvalidName",
    "IncompleteSnapshot",
    "OwnershipError",
    "OwnershipConflict",
    "OwnershipChanged",
    "OwnershipUnsupported",
    "OwnershipLost",
]


class RepositoryError(StorageError):
    """Base class of every repository error."""


class RepositoryUnavailable(RepositoryError):
    """The repository cannot be reached or refused the request (after the configured retries)."""


class LayerNotFound(RepositoryError, KeyError):
    """No layer with this digest is in the repository."""

    def __init__(self, digest: str, where: str = "") -> None:
        self.digest = digest
        super().__init__(f"layer {digest} is not in the repository" + (f" ({where})" if where else ""))

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


class ManifestNotFound(RepositoryError, KeyError):
    """No manifest with this id is in the repository."""

    def __init__(self, manifest_id: str, where: str = "") -> None:
        self.manifest_id = manifest_id
        super().__init__(f"manifest {manifest_id!r} is not in the repository" + (f" ({where})" if where else ""))

    def __str__(self) -> str:
        return str(self.args[0])


class ManifestCorrupt(RepositoryError, ValueError):
    """A manifest's bytes are not the document they must be (not JSON, or not the expected model)."""

    def __init__(self, manifest_id: str, why: str) -> None:
        self.manifest_id = manifest_id
        super().__init__(f"manifest {manifest_id!r} in the repository is corrupt: {why}")


class DigestMismatch(RepositoryError, ValueError):
    """The bytes given for a layer do not hash to the digest they were given under; nothing was stored."""

    def __init__(self, expected: str, actual: str, source: str = "") -> None:
        self.expected = expected
        self.actual = actual
        super().__init__(
            f"layer {source or 'data'} hashes to {actual}, not {expected}: refusing to store it under that digest"
        )


class InvalidName(RepositoryError, ValueError):
    """A digest or manifest id that is not well formed (digests are ``sha256:<64 hex>``)."""


class IncompleteSnapshot(RepositoryError):
    """A snapshot manifest would name layers that are not in the repository; the manifest was not written."""

    def __init__(self, manifest_id: str, missing: list[str]) -> None:
        self.manifest_id = manifest_id
        self.missing = missing
        super().__init__(
            f"snapshot {manifest_id!r} names {len(missing)} layer(s) missing from the repository "
            f"and not given to upload: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}"
        )


class OwnershipError(RepositoryError):
    """Base of the errors of a sandbox's ownership record (single-writer across nodes)."""


class OwnershipConflict(OwnershipError):
    """Another node owns the sandbox: it runs it there (or, for a publish or a delete, it moved there).

    ``owner`` is that node's owner id (``<node id>/<state-dir tag>``), ``state`` what the record says
    (``running`` or ``paused``)."""

    def __init__(self, sandbox_id: str, owner: str, state: str, action: str = "") -> None:
        self.sandbox_id = sandbox_id
        self.owner = owner
        self.state = state
        self.action = action
        if state == "running":
            msg = f"sandbox {sandbox_id} is running on node {owner}"
        else:
            msg = f"sandbox {sandbox_id} is owned by node {owner} (it is {state} there)"
        super().__init__(msg + (f": cannot {action} it here" if action else ""))


class OwnershipChanged(OwnershipError):
    """A compare-and-swap lost: the record changed (or appeared, or vanished) since it was read.

    Callers re-read the record and decide again; it is never a reason to overwrite."""

    def __init__(self, sandbox_id: str, detail: str = "") -> None:
        self.sandbox_id = sandbox_id
        super().__init__(f"the ownership record of sandbox {sandbox_id} changed meanwhile"
                         + (f" ({detail})" if detail else ""))


class OwnershipUnsupported(OwnershipError):
    """The backend cannot compare-and-swap (an S3 server that ignores If-None-Match / If-Match), so
    ownership cannot be enforced; the operation is refused rather than done without the guarantee."""


class OwnershipLost(OwnershipError):
    """This node's copy of a sandbox was published, but the sandbox's record is gone from the repository: it
    was killed on the node that owned it last.  The copy here is stale and is not run."""

    def __init__(self, sandbox_id: str) -> None:
        self.sandbox_id = sandbox_id
        super().__init__(
            f"sandbox {sandbox_id} was killed on another node (its record is gone from the repository): "
            "this node's paused copy is stale and will not run; kill it here to drop it")
