"""Typed errors of the storage package.

Every error says what is wrong and where, so an operator (or the node's reconciler) can act: a corrupt layer is
re-fetched from the repository or the snapshot is marked broken; it never turns into wrong data.
"""

from __future__ import annotations

__all__ = [
    "StorageError",
    "OutOfRange",
    "ReadOnlyDevice",
    "LayerCorrupt",
    "LayerFormatError",
    "UpperCorrupt",
    "UpperFull",
    "ImageError",
    "CacheError",
    "CacheFilesystemUnsupported",
]


class StorageError(Exception):
    """Base class of every storage error."""


class OutOfRange(StorageError, ValueError):
    """A request addresses bytes outside the device."""


class ReadOnlyDevice(StorageError):
    """A write was sent to a read-only device."""


class LayerCorrupt(StorageError):
    """A layer file is corrupt or truncated: a checksum or structural check failed.

    ``what`` names the part (header, index, trailer, group, ...), ``where`` the byte offset in the layer file,
    ``path`` the layer (path or digest) when known.
    """

    def __init__(self, what: str, where: int | None = None, detail: str = "", path: str | None = None) -> None:
        self.what = what
        self.where = where
        self.detail = detail
        self.path = path
        loc = f" at offset {where}" if where is not None else ""
        src = f"{path}: " if path else ""
        super().__init__(f"{src}corrupt layer {what}{loc}" + (f": {detail}" if detail else ""))


class LayerFormatError(StorageError, ValueError):
    """Bad input to the layer writer (unaligned or overlapping extents, wrong sizes)."""


class UpperCorrupt(StorageError):
    """The writable upper's files are inconsistent in a way a torn log tail does not explain."""


class UpperFull(StorageError):
    """The writable upper's data file reached its addressable limit (8 TiB of allocations): seal it."""


class ImageError(StorageError):
    """Layers that cannot be stacked (size mismatch, wrong order) or an operation on a closed image."""


class CacheError(StorageError):
    """The local cache cannot do its job (its directory is unusable, a repository read came back short)."""


class CacheFilesystemUnsupported(CacheError):
    """The cache directory's filesystem cannot punch holes, so eviction could not free space."""
