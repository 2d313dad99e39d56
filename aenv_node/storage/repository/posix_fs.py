"""``posix_fs``: the default repository, a plain directory (local disk or a shared filesystem such as NFS,
CephFS or Lustre mounted on every node).

Layout (the same keys as every backend)::

    <root>/layers/sha256/ab/<hex>      one immutable file per layer
    <root>/layers/sha256/ab/<hex>.chunks  its per-chunk checksum record (chunksums.py), written before it
    <root>/manifests/<id>.json         one small JSON document per snapshot

Atomic commits use the classic sequence: write to a temporary name *in the same directory* (``.tmp-...``, never
listed), ``fsync`` it, ``rename`` it over the final name, ``fsync`` the directory.  ``rename`` within one
directory is atomic on POSIX filesystems (and on the usual distributed ones), so a reader sees either no file
or the whole file; the two fsyncs make the result survive a power cut in that order.  Layers are hashed while
they are copied in, so a file that does not match its digest never gets a final name.  A layer file on the
repository's own filesystem is hard-linked instead of copied (``put_layer``), so a repository next to the
node's layers directory costs no second copy of each layer.  A layer's mtime is its age for garbage
collection (gc.py): a reuse refreshes it (``touch_layer``).

Sandbox ownership records (``manifests/sandbox-<id>.json``, see base.py) change by compare-and-swap: an
exclusive ``fcntl.flock`` on one of 256 lock files (``<root>/locks/<xx>.lock``, picked by a hash of the record
id, so lock files never pile up) is held around read-compare-write, and the write is the same atomic
tmp + fsync + rename + fsync(dir).  ``flock`` excludes other processes on this host (and, with the in-process
lock taken first, other threads of this one).  On a shared filesystem it needs locks that work across clients:

* NFS: the Linux client turns ``flock`` into a whole-file POSIX lock on the server, so it works with NFSv4 (or
  NFSv3 with lockd/statd running); never mount the repository with ``nolock`` or ``local_lock=flock|all``
  (locks become local to each host and two nodes can both claim).  Mount it with ``lookupcache=positive``
  (or ``noac``) so a record renamed into place by another host is seen once the lock is held;
* CephFS: ``flock`` is cluster-wide (kernel client and ceph-fuse);
* Lustre: mount with ``-o flock`` (the default ``localflock`` is node-local only);
* anything else: check that an ``flock`` taken on one host blocks another host before sharing a repository.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import stat
import threading
import time
import uuid
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional

from ..fileops import fsync_dir
from .base import (
    READ_CHUNK,
    ObjectInfo,
    Repository,
    check_digest,
    iter_file,
    layer_key,
    manifest_key,
    verify_digest,
)
from .chunksums import ChunkHasher, chunksums_key
from .errors import (
    LayerNotFound,
    ManifestNotFound,
    OwnershipChanged,
    RepositoryError,
    RepositoryUnavailable,
)
from .ownership import RECORD_PREFIX

__all__ = ["PosixFsRepository"]

_TMP_PREFIX = ".tmp-"
#: Ownership records are locked by stripe: one of this many lock files, picked by a hash of the record id.
_LOCK_STRIPES = 256
#: ``link()`` errors that mean "this filesystem or policy does not allow a hard link here": copy instead.
_NO_LINK = {errno.EXDEV, errno.EPERM, errno.EACCES, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP}




class PosixFsRepository(Repository):
    """A repository in a directory.  ``durable=False`` skips the fsyncs (scratch repositories only)."""

    kind = "posix_fs"

    def __init__(self, root: str | os.PathLike[str], *, create: bool = True, durable: bool = True) -> None:
        self.root = Path(root)
        self.durable = durable
        self._thread_locks = [threading.Lock() for _ in range(_LOCK_STRIPES)]
        if create:
            for d in (self.root / "layers" / "sha256", self.root / "manifests", self.root / "locks"):
                d.mkdir(parents=True, exist_ok=True)
        elif not (self.root / "layers").is_dir():
            raise RepositoryUnavailable(f"{self.root} is not a repository (no layers/ directory)")

    def __repr__(self) -> str:
        return f"PosixFsRepository({str(self.root)!r})"

    # -- helpers ------------------------------------------------------------------------------------------
    def _layer_path(self, digest: str) -> Path:
        return self.root / layer_key(digest)

    def _tmp_name(self, directory: Path, stem: str) -> Path:
        return directory / f"{_TMP_PREFIX}{stem}-{uuid.uuid4().hex[:12]}"

    def _publish(self, tmp: Path, final: Path) -> None:
        os.rename(tmp, final)
        if self.durable:
            fsync_dir(final.parent)

    def _write_atomic(self, final: Path, chunks: Iterable[bytes | bytearray | memoryview], stem: str,
                      check: Callable[[], None] | None = None) -> None:
        """Write ``chunks`` to ``final`` atomically; ``check()`` runs after the data is written, before publish."""
        directory = final.parent
        if not directory.is_dir():
            directory.mkdir(parents=True, exist_ok=True)
            if self.durable:
                fsync_dir(directory.parent)
        tmp = self._tmp_name(directory, stem)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            with open(fd, "wb", buffering=0) as f:
                for b in chunks:
                    view = memoryview(b)
                    while view:
                        n = f.write(view)
                        view = view[n:]
                if check is not None:
                    check()
                if self.durable:
                    os.fsync(f.fileno())
            self._publish(tmp, final)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise

    # -- layers -------------------------------------------------------------------------------------------
    def put_layer(self, digest: str, path: str | os.PathLike[str]) -> str:
        """Store a layer: hard-linked when ``path`` is a regular file on the repository's filesystem, else copied.

        A node's layer files are immutable and content-addressed, so when the repository lives on the same
        filesystem (the default ``<state>/repository`` next to ``<state>/layers``) a second copy only doubles
        the disk used: the file is linked to a temporary name in the layer's directory, its size checked
        against the source, its bytes hashed (kept: it costs a read, not a write, and catches a caller that
        passes the wrong digest or a file that changed), its mtime set to now (the link shares the inode, so
        the source's mtime moves too; garbage collection reads a layer's age from it), then renamed into
        place.  Where linking is refused (``EXDEV``: another filesystem; ``EPERM``/``EACCES``/``EMLINK``/
        ``ENOTSUP``: a filesystem or policy without hard links) the bytes are copied and hashed as before.
        A layer already present is only touched (``touch_layer``).
        """
        hexd = check_digest(digest)
        final = self._layer_path(digest)
        key = layer_key(digest)
        if self.touch_layer(digest):
            return key
        try:
            if self._link_layer(digest, path, final, hexd):
                return key
        except OSError as e:
            raise RepositoryError(f"cannot store layer {digest} from {os.fspath(path)} in {self.root}: {e}") from e
        h = hashlib.sha256()
        chunks = ChunkHasher()

        def hashed() -> Iterator[bytes]:
            for b in iter_file(path, READ_CHUNK):
                h.update(b)
                chunks.update(b)
                yield b

        def check() -> None:  # the bytes are the layer: its checksum record goes in before the layer does
            verify_digest(digest, h, os.fspath(path))
            self._put_chunksums(chunks, digest)

        try:
            self._write_atomic(final, hashed(), hexd[:16], check=check)
        except OSError as e:
            raise RepositoryError(f"cannot store layer {digest} from {os.fspath(path)} in {self.root}: {e}") from e
        return key

    def _link_layer(self, digest: str, path: str | os.PathLike[str], final: Path, hexd: str) -> bool:
        """Hard-link ``path`` into place as ``final`` (see ``put_layer``); False if linking is not possible."""
        try:
            src = os.stat(path)
        except OSError:
            return False  # let the copy path report it
        if not stat.S_ISREG(src.st_mode):
            return False  # a pipe or device: copy it
        directory = final.parent
        if not directory.is_dir():
            directory.mkdir(parents=True, exist_ok=True)
            if self.durable:
                fsync_dir(directory.parent)
        tmp = self._tmp_name(directory, hexd[:16])
        # its age starts now, before its temporary name exists: the link shares the source's inode, so its mtime,
        # and a sweep of incomplete uploads (sweep_incomplete) running meanwhile took an old-looking temporary
        # name for a cut upload and removed it under a publish of a large layer. Touched after the link, a
        # sweep could still take it in between (CI saw that ENOENT), so the source is touched first.
        with contextlib.suppress(OSError):  # (a source we may not touch: the link below fails the same way)
            os.utime(path, None)
        try:
            os.link(path, tmp)
        except OSError as e:
            if e.errno in _NO_LINK:
                return False
            raise
        try:
            h = hashlib.sha256()
            chunks = ChunkHasher()
            fd = os.open(tmp, os.O_RDONLY | os.O_CLOEXEC)
            try:
                size = os.fstat(fd).st_size
                if size != src.st_size:
                    raise RepositoryError(f"layer {digest}: {os.fspath(path)} changed size while it was linked "
                                          f"({src.st_size} -> {size} bytes)")
                got = 0
                while True:
                    b = os.read(fd, READ_CHUNK)
                    if not b:
                        break
                    h.update(b)
                    chunks.update(b)
                    got += len(b)
                if got != size:
                    raise RepositoryError(f"layer {digest}: read {got} bytes of {size} from {os.fspath(path)}")
                verify_digest(digest, h, os.fspath(path))
                if self.durable:
                    os.fsync(fd)
                self._put_chunksums(chunks, digest)
            finally:
                os.close(fd)
            os.utime(tmp, None)  # its age in the repository starts when it is in place (gc.py)
            self._publish(tmp, final)
            # rename() of a link onto another link of the same inode does nothing and succeeds (POSIX): when
            # a concurrent put of the same layer linked it first, the temporary name is still there
            tmp.unlink(missing_ok=True)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return True

    def _put_chunksums(self, chunks: ChunkHasher, digest: str) -> None:
        """Store the layer's checksum record (atomically, like every object here) before the layer itself."""
        hexd = check_digest(digest)
        self._write_atomic(self.root / chunksums_key(digest), [chunks.record(digest).encode()], hexd[:16] + "-c")

    def _get_chunksums_bytes(self, digest: str) -> Optional[bytes]:
        try:
            return (self.root / chunksums_key(digest)).read_bytes()
        except FileNotFoundError:
            return None

    def touch_layer(self, digest: str) -> bool:
        try:
            os.utime(self._layer_path(digest), None)
        except FileNotFoundError:
            return False
        except OSError as e:
            raise RepositoryError(f"cannot refresh the age of layer {digest} in {self.root} (garbage collection "
                                  f"could remove it while it is reused): {e}") from e
        return True

    def layer_infos(self) -> dict[str, ObjectInfo]:
        out: dict[str, ObjectInfo] = {}
        base = self.root / "layers" / "sha256"
        for sub in sorted(base.iterdir()) if base.is_dir() else ():
            if not sub.is_dir():
                continue
            with os.scandir(sub) as it:
                for e in it:
                    if e.name.startswith(".") or len(e.name) != 64:
                        continue
                    try:
                        st = e.stat()
                    except FileNotFoundError:
                        continue
                    out["sha256:" + e.name] = ObjectInfo(st.st_mtime, st.st_size)
        return out

    def layer_info(self, digest: str) -> Optional[ObjectInfo]:
        try:
            st = self._layer_path(digest).stat()
        except FileNotFoundError:
            return None
        return ObjectInfo(st.st_mtime, st.st_size)

    def manifest_infos(self) -> dict[str, ObjectInfo]:
        out: dict[str, ObjectInfo] = {}
        with os.scandir(self.root / "manifests") as it:
            for e in it:
                if e.name.startswith(".") or not e.name.endswith(".json"):
                    continue
                try:
                    st = e.stat()
                except FileNotFoundError:
                    continue
                out[e.name[: -len(".json")]] = ObjectInfo(st.st_mtime, st.st_size)
        return out

    def manifest_info(self, manifest_id: str) -> Optional[ObjectInfo]:
        try:
            st = (self.root / manifest_key(manifest_id)).stat()
        except FileNotFoundError:
            return None
        return ObjectInfo(st.st_mtime, st.st_size)

    def read_range(self, digest: str, offset: int, length: int) -> bytes:
        if offset < 0 or length < 0:
            raise ValueError(f"bad range offset={offset} length={length}")
        p = self._layer_path(digest)
        try:
            fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise LayerNotFound(digest, str(self.root)) from None
        try:
            if length == 0:
                return b""
            out = os.pread(fd, length, offset)
            if len(out) < length:  # pread may return short on some filesystems: loop to EOF
                parts = [out]
                got = len(out)
                while got < length:
                    b = os.pread(fd, length - got, offset + got)
                    if not b:
                        break
                    parts.append(b)
                    got += len(b)
                out = b"".join(parts)
            return out
        finally:
            os.close(fd)

    def layer_size(self, digest: str) -> int:
        try:
            return self._layer_path(digest).stat().st_size
        except FileNotFoundError:
            raise LayerNotFound(digest, str(self.root)) from None

    def local_path(self, digest: str) -> str | None:
        return str(self._layer_path(digest))

    def has_layer(self, digest: str) -> bool:
        return self._layer_path(digest).is_file()

    def _unlink(self, p: Path) -> None:
        try:
            p.unlink()
        except FileNotFoundError:
            return
        if self.durable:
            fsync_dir(p.parent)

    def delete_layer(self, digest: str) -> None:
        self._unlink(self._layer_path(digest))
        self._unlink(self.root / chunksums_key(digest))

    def list_layers(self) -> list[str]:
        out = []
        base = self.root / "layers" / "sha256"
        for sub in sorted(base.iterdir()) if base.is_dir() else ():
            if not sub.is_dir():
                continue
            for f in sorted(sub.iterdir()):
                name = f.name
                if not name.startswith(".") and len(name) == 64:
                    out.append("sha256:" + name)
        return out

    # -- manifests ----------------------------------------------------------------------------------------
    def _put_manifest_bytes(self, manifest_id: str, data: bytes) -> None:
        final = self.root / manifest_key(manifest_id)
        try:
            self._write_atomic(final, [data], manifest_id[:32])
        except OSError as e:
            raise RepositoryError(f"cannot write manifest {manifest_id!r} in {self.root}: {e}") from e

    def _get_manifest_bytes(self, manifest_id: str) -> bytes:
        try:
            return (self.root / manifest_key(manifest_id)).read_bytes()
        except FileNotFoundError:
            raise ManifestNotFound(manifest_id, str(self.root)) from None

    def has_manifest(self, manifest_id: str) -> bool:
        return (self.root / manifest_key(manifest_id)).is_file()

    def list_manifests(self) -> list[str]:
        d = self.root / "manifests"
        return sorted(f.name[: -len(".json")] for f in d.iterdir() if f.name.endswith(".json") and not f.name.startswith("."))

    def delete_manifest(self, manifest_id: str) -> None:
        self._unlink(self.root / manifest_key(manifest_id))

    # -- compare-and-swap of ownership records -------------------------------------------------------------
    @contextlib.contextmanager
    def _locked(self, manifest_id: str) -> Iterator[None]:
        """Exclusive hold of the record's lock stripe: other threads here, other processes (and other hosts, on
        a shared filesystem whose locks work across clients: see the module docstring)."""
        stripe = int(hashlib.sha256(manifest_id.encode()).hexdigest()[:4], 16) % _LOCK_STRIPES
        locks = self.root / "locks"
        with self._thread_locks[stripe]:
            if not locks.is_dir():
                locks.mkdir(parents=True, exist_ok=True)
            fd = os.open(locks / f"{stripe:02x}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                yield
            finally:
                os.close(fd)  # releases the flock

    def _check_version(self, manifest_id: str, expect_token: Optional[str]) -> None:
        got = self._get_versioned(manifest_id)
        token = got[1] if got is not None else None
        if token != expect_token:
            raise OwnershipChanged(manifest_id.removeprefix(RECORD_PREFIX),
                                   "it was created meanwhile" if expect_token is None else
                                   "it was removed meanwhile" if token is None else "it was rewritten meanwhile")

    def _put_if(self, manifest_id: str, data: bytes, expect_token: Optional[str]) -> str:
        with self._locked(manifest_id):
            self._check_version(manifest_id, expect_token)
            self._put_manifest_bytes(manifest_id, data)
        return hashlib.sha256(data).hexdigest()[:32]

    def _delete_if(self, manifest_id: str, expect_token: str) -> None:
        with self._locked(manifest_id):
            self._check_version(manifest_id, expect_token)
            self.delete_manifest(manifest_id)

    # -- housekeeping -------------------------------------------------------------------------------------
    def sweep_incomplete(self, older_than_s: float = 3600.0) -> int:
        cutoff = time.time() - older_than_s
        removed = 0
        dirs = [self.root / "manifests"]
        base = self.root / "layers" / "sha256"
        if base.is_dir():
            dirs += [d for d in base.iterdir() if d.is_dir()]
        for d in dirs:
            for f in d.iterdir():
                if not f.name.startswith(_TMP_PREFIX):
                    continue
                try:
                    if f.stat().st_mtime < cutoff:
                        f.unlink()
                        removed += 1
                except FileNotFoundError:
                    pass
                except OSError as e:
                    if e.errno not in (errno.ENOENT,):
                        raise
        return removed
