"""The per-chunk checksum record of a layer: what lets a node trust a byte range it got from another node.

Why: a layer's name is the SHA-256 of the whole file, so a 256 KiB range of it cannot be checked against the
name.  A node that fetches a range from a peer (P2P, docs/cluster.md) must not take the peer's word for it: a
bug, a disk error or a bad peer would otherwise put wrong bytes under a sandbox's disk.  So when a layer is
put into the repository, the backend also stores, next to it, the SHA-256 of each ``chunk_size`` piece of it
(``layers/sha256/ab/<hex>.chunks``); a requester reads that record (from the repository, never from a peer)
and checks every chunk a peer sends before it uses or caches it.

The record is written *before* the layer is published, with the same atomic write as every repository object,
so every layer put since this record existed has one, complete; a crash in between leaves a record without a
layer (harmless: the same bytes are written again by the next put of that layer, and deleting the layer
deletes it).  A layer without a record (put by an older node) is simply never fetched from peers.  Listings
of layers ignore it (its name is not 64 hex digits).

This module owns the record: :class:`ChunkSums` (typed, versioned), :class:`ChunkHasher` (computes it while
a backend streams a layer's bytes) and the key it is stored under.  Nothing else parses it.
"""

from __future__ import annotations

import hashlib
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .manifest import Digest, check_digest

__all__ = ["CHUNKSUM_SIZE", "ChunkSums", "ChunkHasher", "ChecksumMismatch", "chunksums_key"]

#: The piece a record sums: the local cache's chunk (256 KiB), so a cached chunk is checked by one sum.
CHUNKSUM_SIZE = 256 * 1024

_HEX64 = r"^[0-9a-f]{64}$"


class ChecksumMismatch(ValueError):
    """Bytes of a layer range do not match its checksum record (or do not cover whole chunks)."""


def chunksums_key(digest: str) -> str:
    """The repository-relative key of a layer's record: ``layers/sha256/ab/<hex>.chunks`` (every backend)."""
    hexd = check_digest(digest)
    return f"layers/sha256/{hexd[:2]}/{hexd}.chunks"


class ChunkSums(BaseModel):
    """The SHA-256 of every ``chunk_size`` piece of layer ``digest`` (``size`` bytes; the last piece may be
    short).  ``version`` is the record's format (1)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    version: Literal[1] = 1
    digest: Digest
    size: int = Field(ge=0)
    chunk_size: int = Field(gt=0, multiple_of=4096)
    algorithm: Literal["sha256"] = "sha256"
    sums: list[str]

    @model_validator(mode="after")
    def _complete(self) -> "ChunkSums":
        want = (self.size + self.chunk_size - 1) // self.chunk_size
        if len(self.sums) != want:
            raise ValueError(f"{len(self.sums)} sums for {want} chunks of {self.size} bytes")
        for s in self.sums:
            if len(s) != 64 or not all(c in "0123456789abcdef" for c in s):
                raise ValueError(f"not a lowercase hex SHA-256: {s!r}")
        return self

    @property
    def n_chunks(self) -> int:
        return len(self.sums)

    def encode(self) -> bytes:
        return self.model_dump_json().encode()

    @classmethod
    def decode(cls, data: bytes) -> "ChunkSums":
        """Parse a stored record (``ValueError`` if it is not one this code reads)."""
        try:
            return cls.model_validate_json(data)
        except ValidationError as exc:
            raise ValueError(f"not a chunk checksum record: {str(exc).splitlines()[0]}") from None

    def covers(self, offset: int, length: int) -> bool:
        """Whether ``[offset, offset+length)`` is whole chunks of this record (a range it can check)."""
        end = offset + length
        return (length > 0 and offset % self.chunk_size == 0 and end <= self.size
                and (end % self.chunk_size == 0 or end == self.size))

    def verify(self, offset: int, data: bytes | memoryview) -> None:
        """Check that ``data`` are the layer's bytes at ``offset`` (``ChecksumMismatch`` if not)."""
        n = len(data)
        if not self.covers(offset, n):
            raise ChecksumMismatch(f"{self.digest} [{offset}, {offset + n}) is not whole chunks of "
                                   f"{self.chunk_size} bytes of a {self.size}-byte layer")
        view = memoryview(data)
        first = offset // self.chunk_size
        for i, pos in enumerate(range(0, n, self.chunk_size)):
            got = hashlib.sha256(view[pos:pos + self.chunk_size]).hexdigest()
            if got != self.sums[first + i]:
                raise ChecksumMismatch(f"{self.digest} chunk {first + i} (offset {offset + pos}) does not match "
                                       "its checksum")


class ChunkHasher:
    """Computes a layer's :class:`ChunkSums` from its bytes, fed front to back in pieces of any size."""

    def __init__(self, chunk_size: int = CHUNKSUM_SIZE) -> None:
        self.chunk_size = chunk_size
        self.size = 0
        self._sums: list[str] = []
        self._h = hashlib.sha256()
        self._fill = 0

    def update(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data)
        self.size += len(view)
        while view:
            take = min(len(view), self.chunk_size - self._fill)
            self._h.update(view[:take])
            self._fill += take
            view = view[take:]
            if self._fill == self.chunk_size:
                self._sums.append(self._h.hexdigest())
                self._h = hashlib.sha256()
                self._fill = 0

    def record(self, digest: str) -> ChunkSums:
        """The record of the bytes fed so far, as layer ``digest``."""
        sums = list(self._sums)
        if self._fill:
            sums.append(self._h.hexdigest())
        return ChunkSums(digest=digest, size=self.size, chunk_size=self.chunk_size, sums=sums)
