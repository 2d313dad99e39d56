"""One ``LayerReader`` per layer per process, shared by every image that stacks it.

Thousands of sandboxes started from one template stack the same base layer.  Each reader holds the layer's
parsed index (8 bytes of checksum per 4 KiB block: 20 MiB for a 10 GiB layer), so opening it once per image
would cost memory per sandbox for nothing; the page cache is shared either way.

The pool holds readers *weakly*: a reader lives as long as some image (or caller) holds it, and its file closes
when the last holder drops it (CPython reference counting, deterministic here: readers hold no reference
cycles).  That is also why no reader is ever closed under an in-flight read.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Callable

from .layer import LAYER_SUFFIX, LayerReader
from .source import FileSource, RandomAccessSource

__all__ = ["LayerPool"]


class LayerPool:
    """Shared readers keyed by digest.

    ``opener(digest)`` returns the ``RandomAccessSource`` of a layer (e.g. the on-demand cache of a
    repository); the default opens ``<layers_dir>/<digest>.layer``.
    """

    def __init__(self, layers_dir: str | os.PathLike[str] | None = None, *,
                 opener: Callable[[str], RandomAccessSource] | None = None, verify_reads: bool = True) -> None:
        if opener is None:
            if layers_dir is None:
                raise ValueError("give layers_dir or opener")
            d = os.fspath(layers_dir)

            def opener(digest: str) -> RandomAccessSource:
                return FileSource(os.path.join(d, digest + LAYER_SUFFIX))

        self._opener = opener
        self._verify = verify_reads
        self._readers: weakref.WeakValueDictionary[str, LayerReader] = weakref.WeakValueDictionary()
        self._lock = threading.Lock()

    def get(self, digest: str) -> LayerReader:
        """The shared reader of ``digest``, opened on first use."""
        with self._lock:
            r = self._readers.get(digest)
            if r is None:
                src = self._opener(digest)
                try:
                    r = LayerReader(src, name=digest, digest=digest, verify_reads=self._verify)
                except BaseException:
                    close = getattr(src, "close", None)
                    if close:
                        close()
                    raise
                self._readers[digest] = r
            return r

    def add(self, reader: LayerReader) -> LayerReader:
        """Register a reader opened elsewhere (e.g. by a seal); returns the pooled one for its digest."""
        if reader.digest is None:
            raise ValueError("only readers with a known digest can be pooled")
        with self._lock:
            r = self._readers.get(reader.digest)
            if r is None:
                self._readers[reader.digest] = reader
                return reader
            return r

    def __len__(self) -> int:
        return len(self._readers)

    def __contains__(self, digest: str) -> bool:
        return digest in self._readers
