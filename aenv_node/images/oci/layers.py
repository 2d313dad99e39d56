"""Pulled layers, and reading one as the uncompressed tar its ``diff_id`` names.

A layer blob is verified against its (compressed) digest when it enters the store; what a consumer applies is
the uncompressed tar, which the image config pins separately (``rootfs.diff_ids``). :func:`open_layer_tar`
decompresses on the fly (gzip with the standard library, zstd with ``zstandard``, across frames, as
``zstd:chunked`` layers have several) and hashes the bytes as the consumer reads them; when the block ends it
reads whatever the consumer left (``tarfile`` stops at the end-of-archive marker, before the zero padding) and
raises :class:`DigestMismatch` if the whole did not hash to the ``diff_id``. A consumer must therefore treat
what it applied as provisional until the ``with`` block has exited cleanly.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Protocol

import zstandard

from .errors import DigestMismatch, UnsupportedMediaType
from .manifest import LAYER_COMPRESSION

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

__all__ = ["OciLayer", "open_layer_tar"]

_BUFFER = 1 << 20


@dataclass(frozen=True)
class OciLayer:
    """One layer of a pulled image, its blob in the local store."""

    digest: str  # of the blob as stored (compressed)
    diff_id: str  # of the uncompressed tar, from the image config
    media_type: str
    size: int  # of the blob
    path: Path  # the blob in the store

    @property
    def compression(self) -> str:
        """``""`` (plain tar), ``"gzip"`` or ``"zstd"``."""
        try:
            return LAYER_COMPRESSION[self.media_type]
        except KeyError:
            raise UnsupportedMediaType(f"layer {self.digest} has unsupported media type {self.media_type!r}") from None


class _Readable(Protocol):
    def read(self, size: int = -1, /) -> bytes: ...


class _HashingReader(io.RawIOBase):
    """Reads ``inner`` and hashes every byte that passes."""

    def __init__(self, inner: _Readable) -> None:
        self._inner = inner
        self.hasher = hashlib.sha256()
        self.eof = False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: WriteableBuffer) -> int:
        view = memoryview(buffer).cast("B")
        data = self._inner.read(len(view))
        n = len(data)
        if n == 0:
            self.eof = True
            return 0
        view[:n] = data
        self.hasher.update(data)
        return n

    def drain(self) -> None:
        buffer = bytearray(_BUFFER)
        while self.readinto(buffer):
            pass


@contextlib.contextmanager
def open_layer_tar(layer: OciLayer) -> Iterator[BinaryIO]:
    """A readable stream of the layer's uncompressed tar; raises :class:`DigestMismatch` at the end of the
    block if the uncompressed bytes do not hash to ``layer.diff_id`` (an exception inside the block is
    propagated as is, without the check)."""
    compression = layer.compression
    with contextlib.ExitStack() as stack:
        blob = stack.enter_context(open(layer.path, "rb"))
        inner: _Readable
        if compression == "gzip":
            inner = stack.enter_context(gzip.GzipFile(fileobj=blob, mode="rb"))
        elif compression == "zstd":
            reader = zstandard.ZstdDecompressor().stream_reader(blob, read_across_frames=True)
            inner = stack.enter_context(reader)
        else:
            inner = blob
        raw = _HashingReader(inner)
        stream = stack.enter_context(io.BufferedReader(raw, buffer_size=_BUFFER))
        yield stream  # an exception in the block propagates from here, unchecked
        try:
            raw.drain()
        except (OSError, EOFError, zstandard.ZstdError) as e:
            raise DigestMismatch(f"layer {layer.digest}: the {compression or 'tar'} stream is corrupt: {e}") from e
        got = "sha256:" + raw.hasher.hexdigest()
        if got != layer.diff_id:
            raise DigestMismatch(f"layer {layer.digest}: uncompressed tar hashes to {got}, diff_id is {layer.diff_id}")
