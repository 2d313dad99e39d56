"""The layer repository: persistent, shared store of immutable layers and snapshot manifests.

One interface (``Repository``), two backends: ``posix_fs`` (a directory, the default) and ``s3``.
``Repository.collect_garbage`` (gc.py) removes what no sandbox record reaches any more.  The two documents the
repository itself reads are typed: the ``sandbox-<id>`` ownership record (``Ownership``, ownership.py) and the
layers a snapshot manifest names (``LayerManifest``, manifest.py).
``open_repository(kind, **options)`` builds one from the node's ``[storage]`` configuration.
"""

from __future__ import annotations

from typing import Any

from ...config import Config

from .base import (
    OWNER_PAUSED,
    OWNER_RUNNING,
    CommitResult,
    ObjectInfo,
    Ownership,
    Repository,
    digest_of_file,
    layer_key,
    manifest_key,
    sandbox_record_id,
)
from .errors import (
    DigestMismatch,
    IncompleteSnapshot,
    InvalidName,
    LayerNotFound,
    ManifestCorrupt,
    ManifestNotFound,
    OwnershipChanged,
    OwnershipConflict,
    OwnershipError,
    OwnershipLost,
    OwnershipUnsupported,
    RepositoryError,
    RepositoryUnavailable,
)
from .gc import GcReport
from .manifest import DiskLayerRef, LayerManifest
from .posix_fs import PosixFsRepository

__all__ = [
    "Repository",
    "CommitResult",
    "GcReport",
    "ObjectInfo",
    "LayerManifest",
    "DiskLayerRef",
    "PosixFsRepository",
    "S3Repository",
    "open_repository",
    "repository_from_config",
    "digest_of_file",
    "layer_key",
    "manifest_key",
    "RepositoryError",
    "RepositoryUnavailable",
    "LayerNotFound",
    "ManifestNotFound",
    "ManifestCorrupt",
    "DigestMismatch",
    "InvalidName",
    "IncompleteSnapshot",
    "Ownership",
    "OWNER_PAUSED",
    "OWNER_RUNNING",
    "sandbox_record_id",
    "OwnershipError",
    "OwnershipConflict",
    "OwnershipChanged",
    "OwnershipUnsupported",
    "OwnershipLost",
]

KINDS = ("posix_fs", "s3")


def open_repository(kind: str, **options: Any) -> Repository:
    """Build a repository of ``kind`` from explicit options.

    * ``posix_fs``: ``path`` (root directory), optional ``create``, ``durable``;
    * ``s3``: ``bucket``, ``region``, optional ``endpoint_url``, ``prefix``, credentials, multipart and retry
      settings (see ``S3Repository``).

    The node maps its config keys (``repository_path``, ``s3_endpoint``, ``s3_bucket``, ``s3_region``,
    ``s3_prefix``, ``s3_max_attempts``) onto these.
    """
    if kind == "posix_fs":
        path = options.pop("path", None) or options.pop("root", None)
        if not path:
            raise ValueError("posix_fs repository needs a path")
        return PosixFsRepository(path, **options)
    if kind == "s3":
        from .s3 import S3Repository

        return S3Repository(**options)
    raise ValueError(f"unknown repository kind {kind!r} (want one of {', '.join(KINDS)})")


def __getattr__(name: str) -> Any:  # boto3 is imported only when the s3 backend is used
    if name == "S3Repository":
        from .s3 import S3Repository

        return S3Repository
    raise AttributeError(name)


def repository_from_config(cfg: Config) -> Repository:
    """The repository the node's ``[storage]`` section names (every process of a node opens it this way)."""
    st = cfg.storage
    if st.repository == "s3":
        conditional = {"auto": None, "true": True, "false": False}[st.s3_conditional_writes]
        return open_repository("s3", endpoint_url=st.s3_endpoint or None, bucket=st.s3_bucket, region=st.s3_region,
                               prefix=st.s3_prefix, conditional_writes=conditional,
                               max_attempts=st.s3_max_attempts)
    return open_repository("posix_fs", path=str(cfg.repository_path))
