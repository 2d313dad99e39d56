"""The local, content-addressed blob store of pulled images: ``<root>/blobs/sha256/<hex>``.

A blob's path is its digest, and a file appears there only by an atomic rename after its bytes hashed to that
digest, so whatever is in the store is trusted as is and never downloaded again.

Downloads write ``<hex>.partial`` beside the final name (same filesystem, so the rename is atomic). A partial left
by an interrupted pull is resumed with ``Range: bytes=<size>-``; a server that ignores the range (``200``
instead of ``206``) or answers with another range gets the partial truncated and the blob fetched whole. If a
resumed blob fails to verify, the partial (which may be what was wrong) is dropped and the blob downloaded once
more from the start; a blob that fails from the start raises :class:`DigestMismatch` and leaves no partial.

Each partial is held under an exclusive ``flock`` while it is written, so two pulls of images sharing a layer
(in this process or another node process) never write the same file: the second waits, then finds the blob in
place. :func:`fetch_blobs` downloads several blobs at once in a Trio nursery, at most ``concurrency`` at a time;
the first failure cancels the others (their partials stay, to be resumed) and is raised as itself.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path

import trio

from .errors import DigestMismatch, RegistryError
from .manifest import Descriptor
from .reference import ImageReference
from .registry import RegistryClient

__all__ = ["BlobStore", "Progress", "fetch_blobs", "human_size", "short_digest"]

Progress = Callable[[str], None]

CHUNK = 1 << 20
_LOCK_POLL_S = 0.05


def short_digest(digest: str) -> str:
    algorithm, _, hexdigest = digest.partition(":")
    return f"{algorithm}:{hexdigest[:12]}…"


def human_size(n: int) -> str:
    if n >= 1 << 30:
        return f"{n / (1 << 30):.1f} GiB"
    if n >= 1 << 20:
        return f"{n / (1 << 20):.1f} MiB"
    if n >= 1 << 10:
        return f"{n / (1 << 10):.1f} KiB"
    return f"{n} B"


def _hash_prefix(fd: int, length: int) -> hashlib._Hash:
    h = hashlib.sha256()
    offset = 0
    while offset < length:
        chunk = os.pread(fd, min(CHUNK, length - offset), offset)
        if not chunk:
            break
        h.update(chunk)
        offset += len(chunk)
    return h


def _silent(_: str) -> None:
    pass


class BlobStore:
    """Blobs by digest under ``root`` (the node uses ``<images cache dir>/oci``)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._dir = root / "blobs" / "sha256"

    def path(self, digest: str) -> Path:
        algorithm, _, hexdigest = digest.partition(":")
        if algorithm != "sha256" or len(hexdigest) != 64:
            raise ValueError(f"not a sha256 digest: {digest!r}")
        return self._dir / hexdigest

    def partial_path(self, digest: str) -> Path:
        return self.path(digest).with_name(self.path(digest).name + ".partial")

    def has(self, digest: str) -> bool:
        return self.path(digest).is_file()

    @contextlib.asynccontextmanager
    async def _locked_partial(self, digest: str) -> AsyncIterator[int | None]:
        """An fd on ``<hex>.partial`` under an exclusive flock, or None once the blob is in place.

        After the lock is taken the fd is checked to still be the file at that path: a previous holder may
        have renamed it into place or deleted it while this one waited, and then the lock is on a stale file.
        """
        partial = self.partial_path(digest)
        while True:
            if self.has(digest):
                yield None
                return
            fd = os.open(partial, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                while True:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except OSError as e:
                        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                            raise
                    await trio.sleep(_LOCK_POLL_S)
                try:
                    current = os.stat(partial)
                except FileNotFoundError:
                    continue
                mine = os.fstat(fd)
                if (current.st_ino, current.st_dev) == (mine.st_ino, mine.st_dev):
                    yield fd
                    return
            finally:
                os.close(fd)  # releases the flock

    async def fetch(
        self,
        client: RegistryClient,
        ref: ImageReference,
        blob: Descriptor,
        *,
        progress: Progress = _silent,
    ) -> Path:
        """The blob's path in the store, downloaded (or resumed) and verified first if it is not there yet."""
        final = self.path(blob.digest)
        label = short_digest(blob.digest)
        if final.is_file():
            progress(f"{label} already present ({human_size(blob.size)})")
            return final
        self._dir.mkdir(parents=True, exist_ok=True)
        async with self._locked_partial(blob.digest) as fd:
            if fd is None or final.is_file():  # another pull published it while this one waited
                if fd is not None:
                    self.partial_path(blob.digest).unlink(missing_ok=True)  # the empty one this open created
                progress(f"{label} already present ({human_size(blob.size)})")
                return final
            await self._download(client, ref, blob, fd, progress)
            await trio.to_thread.run_sync(os.fsync, fd)
            os.rename(self.partial_path(blob.digest), final)
        return final

    async def _download(
        self, client: RegistryClient, ref: ImageReference, blob: Descriptor, fd: int, progress: Progress
    ) -> None:
        label = short_digest(blob.digest)
        started = time.monotonic()
        have = os.fstat(fd).st_size
        if have > blob.size:
            os.ftruncate(fd, 0)
            have = 0
        resumed_from = have
        if have:
            progress(f"resuming {label} at {human_size(have)} of {human_size(blob.size)}")
        else:
            progress(f"pulling {label} ({human_size(blob.size)})")
        received = 0
        for _attempt in range(2):
            hasher = await trio.to_thread.run_sync(_hash_prefix, fd, have) if have else hashlib.sha256()
            if have < blob.size:
                have, hasher, n = await self._stream(client, ref, blob, fd, have, hasher, progress)
                received += n
            digest = "sha256:" + hasher.hexdigest()
            if have == blob.size and digest == blob.digest:
                elapsed = time.monotonic() - started
                extra = f", {human_size(received)} fetched" if received != blob.size else ""
                progress(f"pulled {label} ({human_size(blob.size)}{extra}) in {elapsed:.1f}s")
                return
            os.ftruncate(fd, 0)
            if resumed_from:  # the kept bytes may be what is wrong: once more, from the start
                progress(f"{label}: resumed download did not verify; downloading it again from the start")
                have = resumed_from = 0
                continue
            break
        self.partial_path(blob.digest).unlink(missing_ok=True)
        got = f"{have} bytes" if have != blob.size else digest
        raise DigestMismatch(
            f"blob {blob.digest} of {ref.name} did not verify: expected {blob.size} bytes hashing to its digest, "
            f"got {got}"
        )

    async def _stream(
        self,
        client: RegistryClient,
        ref: ImageReference,
        blob: Descriptor,
        fd: int,
        have: int,
        hasher: hashlib._Hash,
        progress: Progress,
    ) -> tuple[int, hashlib._Hash, int]:
        """Append the blob's bytes from ``have`` on (or from 0 when the server does not honour the range);
        returns how many bytes the partial then holds, the hash over them and how many bytes were received.
        Stops one byte past the size."""
        label = short_digest(blob.digest)
        async with client.open_blob(ref, blob.digest, offset=have) as response:
            if have and response.status_code == 416:  # the registry has less than we hold: start over
                progress(f"{label}: registry refused to resume at {have} bytes; downloading it whole")
                os.ftruncate(fd, 0)
                return await self._stream(client, ref, blob, fd, 0, hashlib.sha256(), progress)
            if response.status_code == 416:
                raise RegistryError(f"blob {blob.digest} of {ref.name}: registry answered 416 to a plain GET")
            if have and response.status_code == 200:
                progress(f"{label}: registry ignored the range request; downloading it whole")
                os.ftruncate(fd, 0)
                have, hasher = 0, hashlib.sha256()
            elif response.status_code == 206:
                content_range = response.headers.get("content-range", "")
                if not content_range.startswith(f"bytes {have}-"):
                    raise RegistryError(
                        f"blob {blob.digest} of {ref.name}: asked for bytes {have}- and got {content_range!r}"
                    )
            received = 0
            async for chunk in response.aiter_bytes(CHUNK):
                chunk = chunk[: blob.size + 1 - have]
                os.pwrite(fd, chunk, have)
                hasher.update(chunk)
                have += len(chunk)
                received += len(chunk)
                if have > blob.size:
                    break
        return have, hasher, received


async def fetch_blobs(
    store: BlobStore,
    client: RegistryClient,
    ref: ImageReference,
    blobs: Sequence[Descriptor],
    *,
    concurrency: int,
    progress: Progress = _silent,
) -> dict[str, Path]:
    """Every blob in the store (at most ``concurrency`` downloading at once), as digest -> path.

    A digest listed twice is fetched once. The first failure cancels the other downloads and is raised as
    itself (not wrapped in an exception group), so callers catch the package's typed errors directly.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be at least 1, not {concurrency}")
    unique = list({b.digest: b for b in blobs}.values())
    paths: dict[str, Path] = {}
    failure: list[BaseException] = []
    limiter = trio.CapacityLimiter(concurrency)

    async def one(blob: Descriptor, cancel: trio.CancelScope) -> None:
        try:
            async with limiter:
                paths[blob.digest] = await store.fetch(client, ref, blob, progress=progress)
        except Exception as e:  # re-raised below, once the siblings are cancelled
            if not failure:
                failure.append(e)
            cancel.cancel()

    async with trio.open_nursery() as nursery:
        for blob in unique:
            nursery.start_soon(one, blob, nursery.cancel_scope)
    if failure:
        raise failure[0]
    return paths
