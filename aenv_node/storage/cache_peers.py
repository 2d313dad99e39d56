"""Peer-to-peer ranges for the local layer cache: fetch a missing range from a node that caches it, checked
against the layer's per-chunk checksums, before asking the shared repository; and the bounds of serving ranges
to other nodes.

Why here and why an interface: when N nodes start sandboxes from the same new layer, every one of them would
read the same bytes from the repository (one S3 bucket, one NFS server): N times the traffic at the one place
that does not scale out.  With P2P the first node reads it there and the others read it from nodes that
already cache it.  The cache (storage/) must not know how nodes find each other or talk (HTTP, the scheduler:
cluster and runtime, above it; dependencies point down), so it is given a :class:`PeerSource`, a small
blocking interface ("who holds layer D", "read this range from that peer"), by whoever assembles the node
(runtime/peers.py implements it over HTTP).

Trust: a peer's bytes are used only after every chunk of them matches the layer's checksum record
(repository/chunksums.py), read from the repository, never from a peer.  A layer without a record, a range
the record cannot check, and any failure of a peer (it does not hold the range, times out, is gone, answers
garbage) fall back to the repository: P2P can make a read cheaper, never wrong and never fail.  Every
outcome is counted (:class:`PeerCounters`; the node's /metrics shows them).

Serving: a node answers a peer only from chunks PRESENT in its cache (``ChunkReader.read_present_range``),
never by fetching, so a node that does not hold the range says so at once; ranges are at most
``max_range_bytes`` and at most ``max_serves`` are read at a time (more: :class:`PeerServeBusy`, the asker
goes to the repository instead of queueing behind others).
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from .repository.base import Repository
from .repository.chunksums import ChecksumMismatch, ChunkSums
from .repository.errors import RepositoryError

__all__ = [
    "FAILURE_REASONS",
    "PeerCounters",
    "PeerFetchError",
    "PeerOptions",
    "PeerReader",
    "PeerServeBusy",
    "PeerServeRefused",
    "PeerSource",
]

log = logging.getLogger("aenv_node.storage.cache")

#: why a peer read failed (the label of the failure counter): no holder list (the index did not answer), the
#: peer does not hold the range (404), another status, a timeout, the peer cannot be reached (gone), a body of
#: the wrong length, bytes that fail their checksums, anything else
FAILURE_REASONS = ("lookup", "absent", "status", "timeout", "unreachable", "short", "checksum", "error")


class PeerFetchError(Exception):
    """A peer (or the holder index) did not give the range; ``reason`` is one of ``FAILURE_REASONS``."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason if reason in FAILURE_REASONS else "error"


class PeerServeRefused(Exception):
    """This node does not serve that range to peers (P2P off, a range too long, or not cached): a 4xx."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class PeerServeBusy(PeerServeRefused):
    """``max_serves`` peer reads are in progress already: the asker should use the repository (503)."""

    def __init__(self, message: str) -> None:
        super().__init__(503, message)


class PeerSource(Protocol):
    """How the cache reaches other nodes.  Blocking, thread-safe; called from the cache's reader threads."""

    def holders(self, digest: str) -> Sequence[str]:
        """Peers (opaque ids) that announced caching layer ``digest``, this node excluded; best first.
        ``PeerFetchError("lookup", ...)`` if the index cannot be asked."""
        ...

    def read_range(self, peer: str, digest: str, offset: int, length: int) -> bytes:
        """``length`` bytes of the layer from ``offset`` as ``peer`` has them cached (unchecked);
        ``PeerFetchError`` if the peer does not give them."""
        ...

    def close(self) -> None:
        """Release connections (the node stops; the cache using it is closed)."""
        ...


@dataclass(frozen=True)
class PeerOptions:
    """P2P settings of one cache (the node's ``[p2p]`` section)."""

    source: PeerSource
    #: the longest range asked of, or served to, a peer in one request
    max_range_bytes: int = 4 * 1024 * 1024
    #: peers tried for one range before the repository
    max_attempts: int = 2
    #: peer reads served at once
    max_serves: int = 16
    #: checksum records kept in memory (one per layer read through peers)
    records_cached: int = 1024

    def __post_init__(self) -> None:
        if self.max_range_bytes < 4096 or self.max_attempts < 1 or self.max_serves < 1 or self.records_cached < 1:
            raise ValueError("P2P options: need max_range_bytes >= 4096 and max_attempts, max_serves, "
                             "records_cached >= 1")


@dataclass
class PeerCounters:
    """What P2P did for and from this cache (totals since it opened)."""

    #: ranges got from peers (checked) and their bytes
    peer_fetches: int = 0
    peer_bytes: int = 0
    #: peer reads that failed, by reason (``FAILURE_REASONS``)
    peer_failures: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FAILURE_REASONS, 0))
    #: ranges that went to the repository although P2P was on (no record, no holder, every peer failed)
    peer_fallbacks: int = 0
    #: ranges served to peers, their bytes, and the ones refused (not cached here; too many at once)
    served_ranges: int = 0
    served_bytes: int = 0
    served_absent: int = 0
    served_busy: int = 0

    def copy(self) -> PeerCounters:
        return PeerCounters(self.peer_fetches, self.peer_bytes, dict(self.peer_failures), self.peer_fallbacks,
                            self.served_ranges, self.served_bytes, self.served_absent, self.served_busy)


class PeerReader:
    """The requester's side: one range from a peer, checked, or None (then the caller reads the repository)."""

    def __init__(self, options: PeerOptions, repository: Repository, chunk_size: int) -> None:
        self.options = options
        self.repository = repository
        self.chunk_size = chunk_size
        self.counters = PeerCounters()
        self._lock = threading.Lock()
        self._records: collections.OrderedDict[str, ChunkSums | None] = collections.OrderedDict()
        self._serving = threading.BoundedSemaphore(options.max_serves)

    # -- asking ----------------------------------------------------------------------------------------------
    def _record(self, digest: str) -> ChunkSums | None:
        """The layer's checksum record (cached: layers are immutable, and so is the absence of a record, which
        is written before its layer), None if it has none or cannot be read now."""
        with self._lock:
            if digest in self._records:
                self._records.move_to_end(digest)
                return self._records[digest]
        try:
            record = self.repository.get_chunksums(digest)
        except (RepositoryError, ValueError, OSError) as exc:
            log.warning("cache: no checksum record for %s now (%s): reading it from the repository", digest, exc)
            return None
        with self._lock:
            self._records[digest] = record
            while len(self._records) > self.options.records_cached:
                self._records.popitem(last=False)
        return record

    def _failed(self, reason: str) -> None:
        with self._lock:
            self.counters.peer_failures[reason] = self.counters.peer_failures.get(reason, 0) + 1

    def fetch(self, digest: str, size: int, offset: int, length: int) -> bytes | None:
        """The checked bytes ``[offset, offset+length)`` of layer ``digest`` from a peer, or None."""
        got = self._fetch(digest, size, offset, length)
        with self._lock:
            if got is None:
                self.counters.peer_fallbacks += 1
            else:
                self.counters.peer_fetches += 1
                self.counters.peer_bytes += len(got)
        return got

    def _fetch(self, digest: str, size: int, offset: int, length: int) -> bytes | None:
        if length > self.options.max_range_bytes:
            return None
        record = self._record(digest)
        if record is None or record.size != size or not record.covers(offset, length):
            return None
        try:
            peers = list(self.options.source.holders(digest))
        except PeerFetchError as exc:
            self._failed(exc.reason)
            return None
        for peer in peers[: self.options.max_attempts]:
            try:
                data = self.options.source.read_range(peer, digest, offset, length)
                if len(data) != length:
                    raise PeerFetchError("short", f"{peer} sent {len(data)} bytes of {length}")
                record.verify(offset, data)
            except PeerFetchError as exc:
                self._failed(exc.reason)
                log.debug("cache: peer %s did not give %s [%d, +%d): %s", peer, digest, offset, length, exc)
                continue
            except ChecksumMismatch as exc:
                self._failed("checksum")
                log.warning("cache: peer %s sent bad bytes of %s: %s", peer, digest, exc)
                continue
            return data
        return None

    # -- serving ---------------------------------------------------------------------------------------------
    def admit(self, length: int) -> None:
        """Take one of the ``max_serves`` places for a range of ``length`` bytes (``PeerServeRefused`` /
        ``PeerServeBusy``); the caller gives it back with ``release``."""
        if length > self.options.max_range_bytes:
            raise PeerServeRefused(400, f"a peer range is at most {self.options.max_range_bytes} bytes "
                                   f"(p2p.max_range_bytes), not {length}")
        if not self._serving.acquire(blocking=False):
            with self._lock:
                self.counters.served_busy += 1
            raise PeerServeBusy(f"{self.options.max_serves} peer ranges are being served already "
                                "(p2p.max_concurrent_serves)")

    def release(self, served: int | None) -> None:
        """Give the place back; ``served`` bytes were sent (None: the range was not cached here)."""
        self._serving.release()
        with self._lock:
            if served is None:
                self.counters.served_absent += 1
            else:
                self.counters.served_ranges += 1
                self.counters.served_bytes += served

    def snapshot(self) -> PeerCounters:
        with self._lock:
            return self.counters.copy()
