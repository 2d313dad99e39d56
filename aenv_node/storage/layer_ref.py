"""Where a layer is: a local file, or only in the repository (read on demand through the cache).

Snapshots stack layers that live in two places: layer files this node wrote or
imported (``layers/<hex>.layer``) and layers another node published that this
node reads range by range through its ``LayerCache``. ``LayerRef`` names both
with one type, so no caller splits strings to find out which it holds, and
``open_image`` is the one entry point that turns a stack of references into an
``Image`` with a fresh (or reopened) writable upper.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Sequence

from .image import Image
from .layer import LAYER_SUFFIX, LayerReader
from .source import RandomAccessSource
from .upper import Upper

__all__ = ["LayerRef", "LayerSourceProvider", "open_reader", "open_image"]


class LayerSourceProvider(Protocol):
    """What reads a repository layer by range (``storage.cache.LayerCache``)."""

    def source(self, digest: str, size: int | None = None) -> RandomAccessSource: ...


@dataclass(frozen=True)
class LayerRef:
    """One layer of a stack: its digest (``sha256:<hex>``) and, when this node has it, its local file."""

    digest: str
    path: Path | None = None

    @classmethod
    def local(cls, path: str | os.PathLike[str], digest: str | None = None) -> "LayerRef":
        """A local layer file; the digest defaults to the one its ``<hex>.layer`` name carries."""
        p = Path(path)
        if digest is None:
            if not p.name.endswith(LAYER_SUFFIX):
                raise ValueError(f"{p} is not named <hex>{LAYER_SUFFIX}: give its digest")
            digest = "sha256:" + p.name[: -len(LAYER_SUFFIX)]
        return cls(digest, p)

    @classmethod
    def remote(cls, digest: str) -> "LayerRef":
        """A layer only the repository holds."""
        return cls(digest, None)

    @property
    def is_local(self) -> bool:
        return self.path is not None

    @property
    def hex(self) -> str:
        return self.digest.split(":", 1)[1]


def open_reader(ref: LayerRef, cache: LayerSourceProvider | None) -> LayerReader:
    """A reader over the local file, or over the cache for a repository layer."""
    if ref.path is not None:
        return LayerReader.open(ref.path)
    if cache is None:
        raise ValueError(f"layer {ref.digest} is only in the repository, and no layer cache is open")
    return LayerReader(cache.source(ref.digest), digest=ref.hex)


def open_image(refs: Sequence[LayerRef], upper_dir: str | os.PathLike[str],
               cache: LayerSourceProvider | None = None) -> Image:
    """An image over ``refs`` (bottom first) with the writable upper in ``upper_dir`` (blocking)."""
    if all(r.path is not None for r in refs):
        return Image.open([r.path for r in refs if r.path is not None], upper_dir)
    readers: list[LayerReader] = []
    try:
        for ref in refs:
            readers.append(open_reader(ref, cache))
        size = readers[-1].virtual_size
        return Image(readers, Upper(upper_dir, size), size=size, own_layers=True)
    except BaseException:
        for r in readers:
            r.close()
        raise
