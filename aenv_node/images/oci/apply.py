"""Apply one OCI image layer (an uncompressed tar stream) onto a directory tree, with the image-spec semantics.

The node turns every OCI layer into a block layer by loop-mounting its parent's ext4 filesystem and applying the
layer's tar onto the mount point, as root; this module does the applying. Entries are applied in tar order:
regular files, directories, symlinks, hard links, character and block devices and FIFOs, with numeric owners
(never names), modes including setuid/setgid/sticky (chmod after chown, which clears them), ``SCHILY.xattr.*``
PAX records (``security.capability``, ``user.*``...) and nanosecond mtimes. Whiteouts (``.wh.<name>``) remove
what lower layers left at ``<name>``; an opaque marker (``.wh..wh..opq``) removes every child of its directory
that this layer did not itself create, wherever the marker sits in the tar (the paths this layer created are
tracked). Whiteout files never appear in the result. Directory mtimes are set once the whole layer is applied
(creating children changes them), deepest first. A non-directory replaces whatever is at its path (a directory
is removed recursively; an existing file is unlinked, never truncated, since a lower layer may have hard-linked
it); a directory entry over an existing directory updates its mode, owner, xattrs and mtime and keeps its
content. Hard links take no metadata from their header: the inode is the target's.

A layer is untrusted input, and it is applied as root, so nothing in it may touch anything outside the root.
Confinement semantics: names are cleaned lexically first (``a/./b``, ``a/b/../c``); a name whose ``..`` climbs
above the root is rejected (``LayerApplyError``, as Docker does), a leading ``/`` is dropped (as GNU tar, Docker,
containerd and umoci do). Symlinks met while resolving the *parent* directories of an entry are resolved as if
the root were ``/`` (chroot semantics): ``etc -> /etc`` followed by ``etc/passwd`` writes ``<root>/etc/passwd``,
and ``up -> ../../..`` followed by ``up/x`` writes ``<root>/x``. This is what container runtimes do (containerd's
``fs.RootPath``, umoci's securejoin, Docker's chrooted unpack), and real images depend on it (e.g. a layer that
writes ``bin/foo`` where a lower layer made ``bin -> usr/bin``), whereas refusing every symlinked parent would
reject valid images. The resolution is our own openat-style walk: every component is ``lstat``-ed and opened
with ``O_NOFOLLOW | O_DIRECTORY`` relative to the directory fd above it, symlinks are read with ``readlink`` and
spliced into the walk by hand (an absolute target restarts at the root fd, ``..`` never climbs above it), so
the kernel never follows a symlink and every write, chmod, chown, unlink, link or mknod is a ``*at`` call on a
real directory fd inside the root with a single name component. The last component of an entry is never
followed (a symlink there is replaced, not written through). Hard-link targets resolve the same way and must
exist inside the root. ``/proc`` must be mounted: a device node's mode and the xattrs of symlinks and devices
are set through ``/proc/self/fd`` (magic links to our own fds, not symlinks of the tree) so no path is followed.

The tar is streamed (``tarfile`` mode ``r|``, 1 MiB copies): layers can be gigabytes. Names are decoded as
UTF-8 with ``surrogateescape`` so non-UTF-8 names round-trip byte for byte. Two ``tarfile`` pitfalls are
handled here: a stream that is cut short or holds a corrupt header after the first one ends the iteration
silently (both are detected and rejected), and ``TarFile`` keeps every member it has read in ``members`` (kept
empty, or a layer with millions of entries would hold them all in memory). The stream is read to its end once
the archive ends, so a caller that hashes the stream sees every byte.

``python -m aenv_node.images.oci.apply ROOT`` applies the tar read on stdin and prints the stats as one JSON
line; on error it exits 1 with a one-line message on stderr. The node runs it in a subprocess
(:func:`apply_layer_in_subprocess`) so a multi-GB untar does not hold the node's GIL against its own FUSE server
threads. A failed or cancelled apply leaves the tree half-written: discard it.
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import json
import os
import shutil
import stat
import sys
import tarfile
from dataclasses import dataclass
from decimal import ROUND_FLOOR, Decimal, InvalidOperation
from pathlib import Path
from typing import IO, Protocol

from aenv_node.images.errors import ImageError

__all__ = ["ApplyStats", "LayerApplyError", "apply_layer", "apply_layer_in_subprocess", "main"]

CHUNK = 1 << 20
MAX_SYMLINKS = 40  # per resolved path, as Linux's own limit
WHITEOUT_PREFIX = ".wh."
OPAQUE_MARKER = ".wh..wh..opq"
_WHITEOUT_META = ".wh..wh."  # aufs bookkeeping (.wh..wh.plnk, .wh..wh.aufs): never applied
_XATTR_PAX = "SCHILY.xattr."
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_AHEAD = 64 * 1024  # tarfile reads the stream in chunks this big (its 10 KiB default costs ~10% more)
_TAIL = 4 * _READ_AHEAD  # raw bytes kept to check how the archive ended
_MODULE = "aenv_node.images.oci.apply"


class LayerApplyError(ImageError):
    """A layer tar could not be applied: malformed or truncated tar, an entry that would escape the root, a hard
    link to a missing target, or an I/O error (the message names the entry)."""


@dataclass
class ApplyStats:
    """What one layer did to the tree. ``entries`` counts every tar member (whiteouts included)."""

    entries: int = 0
    files: int = 0
    directories: int = 0
    symlinks: int = 0
    hardlinks: int = 0
    devices: int = 0  # character and block devices and FIFOs
    whiteouts: int = 0  # .wh.<name> and opaque markers
    bytes_written: int = 0
    xattrs: int = 0


class Readable(Protocol):
    def read(self, size: int, /) -> bytes: ...


def apply_layer(stream: Readable, root: Path | str) -> ApplyStats:
    """Apply the uncompressed layer tar read from ``stream`` onto the existing directory ``root``. Blocking.

    Raises :class:`LayerApplyError`; the tree is then partly applied.
    """
    try:
        root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise LayerApplyError(f"cannot open the root {str(root)!r}: {e.strerror}") from e
    reader = _TailReader(stream)
    applier = _Applier(root_fd)
    try:
        try:
            tf = tarfile.open(
                fileobj=reader, mode="r|", bufsize=_READ_AHEAD, encoding="utf-8", errors="surrogateescape"
            )
        except (tarfile.TarError, OSError, EOFError) as e:
            raise LayerApplyError(f"not a tar archive: {e}") from e
        with tf:
            while True:
                try:
                    member = tf.next()
                except (tarfile.TarError, OSError, EOFError) as e:
                    raise LayerApplyError(f"corrupt tar after {applier.stats.entries} entries: {e}") from e
                if member is None:
                    break
                # TarFile keeps every member it reads (not in the stubs); a layer can have millions
                tf.members.clear()  # type: ignore[attr-defined]
                applier.apply(tf, member)
            reader.check_end(tf.offset)
        applier.finish()
        _drain(reader)
    finally:
        applier.close()
    return applier.stats


async def apply_layer_in_subprocess(tar: Path | int | IO[bytes], root: Path) -> ApplyStats:
    """Run :func:`apply_layer` in ``python -m aenv_node.images.oci.apply``: ``tar`` is a file path, or a file
    descriptor or file object (e.g. a pipe from a decompressor) given to the child as its stdin. Cancelling
    kills the child."""
    import trio

    cmd = [sys.executable, "-m", _MODULE, str(root)]
    if isinstance(tar, Path):
        with open(tar, "rb") as f:
            proc = await trio.run_process(cmd, stdin=f, capture_stdout=True, capture_stderr=True, check=False)
    else:
        proc = await trio.run_process(cmd, stdin=tar, capture_stdout=True, capture_stderr=True, check=False)
    if proc.returncode != 0:
        lines = proc.stderr.decode("utf-8", "replace").strip().splitlines()
        raise LayerApplyError(lines[-1] if lines else f"layer apply exited with status {proc.returncode}")
    return ApplyStats(**json.loads(proc.stdout))


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0].startswith("-"):
        print(f"usage: python -m {_MODULE} ROOT  (reads an uncompressed layer tar on stdin)", file=sys.stderr)
        return 2
    try:
        stats = apply_layer(sys.stdin.buffer, Path(args[0]))
    except Exception as e:  # the parent reads one line: whatever went wrong, say it on one line
        msg = " ".join(str(e).split()) or type(e).__name__
        print(f"apply layer: {msg}", file=sys.stderr)
        return 1
    print(json.dumps(dataclasses.asdict(stats)), flush=True)
    return 0


# --- the stream ------------------------------------------------------------------------------------------------


class _TailReader:
    """The layer stream as tarfile's file object, keeping its last bytes: ``TarFile.next()`` returns None both
    on the end-of-archive block and on a corrupt or cut-short header, so :meth:`check_end` looks at the block
    where the iteration stopped."""

    def __init__(self, raw: Readable) -> None:
        self.raw = raw
        self.pos = 0
        self._chunks: collections.deque[bytes] = collections.deque()
        self._kept = 0

    def read(self, size: int = -1, /) -> bytes:
        data = self.raw.read(size)
        if data:
            self.pos += len(data)
            self._chunks.append(data)
            self._kept += len(data)
            while self._kept - len(self._chunks[0]) >= _TAIL:
                self._kept -= len(self._chunks.popleft())
        return data

    def write(self, b: bytes, /) -> int:
        raise OSError("read-only stream")

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, /) -> int:
        raise OSError("the layer stream cannot seek")

    def close(self) -> None:
        pass

    def check_end(self, offset: int) -> None:
        start = self.pos - self._kept
        if offset < start:
            return  # cannot happen with tarfile's read-ahead smaller than _TAIL; nothing to check then
        block = b"".join(self._chunks)[offset - start : offset - start + tarfile.BLOCKSIZE]
        if not block:
            return  # ended on a block boundary without the zero blocks: accepted, as Go's archive/tar does
        if len(block) < tarfile.BLOCKSIZE:
            raise LayerApplyError(f"the layer tar is truncated (cut inside the header at offset {offset})")
        if block.count(0) != tarfile.BLOCKSIZE:
            raise LayerApplyError(f"corrupt tar: invalid header at offset {offset}")


def _drain(reader: _TailReader) -> None:
    while reader.raw.read(CHUNK):
        pass


# --- names and headers ------------------------------------------------------------------------------------------


def _clean(name: str, what: str) -> list[str]:
    """The components of a tar name, cleaned lexically (filepath.Clean); a leading '/' is dropped."""
    parts: list[str] = []
    for p in name.split("/"):
        if p in ("", "."):
            continue
        if p == "..":
            if not parts:
                raise LayerApplyError(f"{what} {name!r} escapes the root ('..' climbs above it)")
            parts.pop()
        else:
            parts.append(p)
    return parts


def _key(parts: list[str]) -> str:
    return "/".join(parts)


def _ns(member: tarfile.TarInfo, field: str) -> int:
    """A header time in nanoseconds: the PAX record exactly (TarInfo.mtime is a float), else the ustar seconds."""
    text = member.pax_headers.get(field)
    if text is not None:
        try:
            return int(Decimal(text).scaleb(9).to_integral_value(ROUND_FLOOR))
        except (InvalidOperation, ValueError):
            pass
    return int(member.mtime) * 1_000_000_000


def _times(member: tarfile.TarInfo) -> tuple[int, int]:
    """(atime, mtime) in ns; the atime is the mtime unless a PAX record gives it."""
    mtime = _ns(member, "mtime")
    return (_ns(member, "atime") if "atime" in member.pax_headers else mtime), mtime


def _xattrs(member: tarfile.TarInfo) -> dict[str, bytes]:
    # tarfile decodes PAX values as UTF-8 or, failing that, with surrogateescape: encoding back gives the bytes
    return {
        k[len(_XATTR_PAX) :]: v.encode("utf-8", "surrogateescape")
        for k, v in member.pax_headers.items()
        if k.startswith(_XATTR_PAX)
    }


# --- the tree ---------------------------------------------------------------------------------------------------


class _Applier:
    def __init__(self, root_fd: int) -> None:
        self.root_fd = root_fd
        self.stats = ApplyStats()
        self.layer_paths: set[str] = set()  # paths this layer created (opaque markers and whiteouts keep them)
        self.ancestors: set[str] = set()  # their parent directories
        self.dir_times: dict[str, tuple[int, int]] = {}
        self._cached: tuple[tuple[str, ...], int, list[str]] | None = None  # the last parent directory opened
        self._stale = False

    def close(self) -> None:
        self._drop_cache()
        os.close(self.root_fd)

    # resolution

    def _walk(self, parts: list[str], *, create: bool, name: str) -> tuple[int, list[str]] | None:
        """Open the directory ``parts`` (symlinks resolved inside the root, see the module docstring): a new fd
        and the real path's components. With ``create``, missing directories are created (0755, root-owned, as
        runtimes do for parents a layer does not list); without, a missing component or one that is not a
        directory gives None."""
        todo = list(reversed(parts))
        stack: list[int] = []
        names: list[str] = []
        links = 0
        try:
            while todo:
                comp = todo.pop()
                if comp in ("", "."):
                    continue
                if comp == "..":
                    if stack:
                        os.close(stack.pop())
                        names.pop()
                    continue
                cur = stack[-1] if stack else self.root_fd
                try:
                    mode: int | None = os.stat(comp, dir_fd=cur, follow_symlinks=False).st_mode
                except FileNotFoundError:
                    if not create:
                        return None
                    os.mkdir(comp, 0o755, dir_fd=cur)
                    self._mark(names + [comp])
                    mode = None
                if mode is not None and stat.S_ISLNK(mode):
                    links += 1
                    if links > MAX_SYMLINKS:
                        raise LayerApplyError(f"entry {name!r}: too many levels of symbolic links")
                    target = os.readlink(comp, dir_fd=cur)
                    if target.startswith("/"):
                        while stack:
                            os.close(stack.pop())
                        names.clear()
                    todo.extend(reversed(target.split("/")))
                    continue
                if mode is not None and not stat.S_ISDIR(mode):
                    if not create:
                        return None  # e.g. umoci whites out the children of a directory it replaced by a file
                    raise LayerApplyError(f"entry {name!r}: {_key(names + [comp])!r} is not a directory")
                fd = os.open(comp, _DIR_FLAGS, dir_fd=cur)
                if mode is None:
                    os.fchmod(fd, 0o755)  # whatever the umask
                stack.append(fd)
                names.append(comp)
            return (stack.pop() if stack else os.dup(self.root_fd)), names
        finally:
            for fd in stack:
                os.close(fd)

    def _opendir(self, parts: list[str], *, create: bool, name: str) -> tuple[int, list[str]] | None:
        """:meth:`_walk` through a one-entry cache (tar entries come grouped by directory). The fd is borrowed:
        valid until the next call; any removal in the tree makes the cache stale."""
        key = tuple(parts)
        if self._cached is not None and not self._stale and self._cached[0] == key:
            return self._cached[1], self._cached[2]
        self._drop_cache()
        found = self._walk(parts, create=create, name=name)
        if found is None:
            return None
        self._cached = (key, found[0], found[1])
        return found

    def _drop_cache(self) -> None:
        if self._cached is not None:
            os.close(self._cached[1])
            self._cached = None
        self._stale = False

    def _mark(self, parts: list[str]) -> None:
        self.layer_paths.add(_key(parts))
        for i in range(len(parts) - 1, 0, -1):
            k = _key(parts[:i])
            if k in self.ancestors:
                break
            self.ancestors.add(k)

    def _remove(self, dfd: int, base: str) -> bool:
        """Remove ``base`` (a directory recursively, symlinks never followed); False if there was nothing."""
        try:
            mode = os.stat(base, dir_fd=dfd, follow_symlinks=False).st_mode
        except FileNotFoundError:
            return False
        self._stale = True  # a removed directory or symlink may be part of the cached parent's resolution
        if stat.S_ISDIR(mode):
            shutil.rmtree(base, dir_fd=dfd)
        else:
            os.unlink(base, dir_fd=dfd)
        return True

    def _prune(self, dfd: int, rel: list[str]) -> None:
        """Opaque directory: remove every child this layer did not create, keeping the way to those it did."""
        for base in os.listdir(dfd):
            k = _key(rel + [base])
            if k not in self.layer_paths and k not in self.ancestors:
                self._remove(dfd, base)
            elif stat.S_ISDIR(os.stat(base, dir_fd=dfd, follow_symlinks=False).st_mode):
                cfd = os.open(base, _DIR_FLAGS, dir_fd=dfd)
                try:
                    self._prune(cfd, rel + [base])
                finally:
                    os.close(cfd)

    # entries

    def apply(self, tf: tarfile.TarFile, m: tarfile.TarInfo) -> None:
        self.stats.entries += 1
        try:
            self._apply(tf, m)
        except LayerApplyError:
            raise
        except tarfile.TarError as e:
            raise LayerApplyError(f"corrupt tar at entry {m.name!r}: {e}") from e
        except (OSError, ValueError, RecursionError) as e:
            reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            where = f" ({e.filename!r})" if isinstance(e, OSError) and e.filename not in (None, "") else ""
            raise LayerApplyError(f"entry {m.name!r}: {reason}{where}") from e

    def _apply(self, tf: tarfile.TarFile, m: tarfile.TarInfo) -> None:
        parts = _clean(m.name, "entry")
        if not parts:
            if not m.isdir():
                raise LayerApplyError(f"entry {m.name!r} names the root but is not a directory")
            self._dir_meta(self.root_fd, m, existed=True, key="")
            return
        base = parts[-1]
        if base.startswith(WHITEOUT_PREFIX):
            self._whiteout(m, parts)
            return
        if not (m.isdir() or m.issym() or m.islnk() or m.isreg() or m.ischr() or m.isblk() or m.isfifo()):
            raise LayerApplyError(f"entry {m.name!r} has an unsupported tar type {m.type!r}")
        found = self._opendir(parts[:-1], create=True, name=m.name)
        assert found is not None  # created
        pfd, pnames = found
        rel = pnames + [base]
        times = _times(m)
        if m.islnk():
            self._hardlink(m, pfd, base)
        elif m.isdir():
            existed = False
            try:
                existed = stat.S_ISDIR(os.stat(base, dir_fd=pfd, follow_symlinks=False).st_mode)
            except FileNotFoundError:
                pass
            if not existed:
                self._remove(pfd, base)
                os.mkdir(base, 0o700, dir_fd=pfd)
            fd = os.open(base, _DIR_FLAGS, dir_fd=pfd)
            try:
                self._dir_meta(fd, m, existed=existed, key=_key(rel))
            finally:
                os.close(fd)
        elif m.isreg():
            self._remove(pfd, base)
            fd = os.open(base, _FILE_FLAGS, 0o600, dir_fd=pfd)
            try:
                src = tf.extractfile(m)
                if src is not None:
                    with src, open(fd, "wb", closefd=False) as out:
                        shutil.copyfileobj(src, out, CHUNK)
                # chown clears setuid/setgid and file capabilities, writing clears them too: data, owner, mode,
                # xattrs, times, in this order
                os.fchown(fd, m.uid, m.gid)
                os.fchmod(fd, m.mode & 0o7777)
                for k, v in _xattrs(m).items():
                    os.setxattr(fd, k, v)
                    self.stats.xattrs += 1
                os.utime(fd, ns=times)
            finally:
                os.close(fd)
            self.stats.files += 1
            self.stats.bytes_written += m.size
        else:
            self._remove(pfd, base)
            if m.issym():
                os.symlink(m.linkname, base, dir_fd=pfd)
                self.stats.symlinks += 1
            else:
                kind = stat.S_IFCHR if m.ischr() else stat.S_IFBLK if m.isblk() else stat.S_IFIFO
                dev = os.makedev(m.devmajor, m.devminor) if kind != stat.S_IFIFO else 0
                os.mknod(base, kind | 0o600, dev, dir_fd=pfd)
                self.stats.devices += 1
            os.chown(base, m.uid, m.gid, dir_fd=pfd, follow_symlinks=False)
            if not m.issym():  # Linux symlinks have no mode
                self._chmod_node(pfd, base, m.mode & 0o7777)
            for k, v in _xattrs(m).items():
                if k.startswith("user."):
                    continue  # the kernel allows user.* xattrs on files and directories only
                os.setxattr(f"/proc/self/fd/{pfd}/{base}", k, v, follow_symlinks=False)
                self.stats.xattrs += 1
            os.utime(base, ns=times, dir_fd=pfd, follow_symlinks=False)
        self._mark(rel)

    def _dir_meta(self, fd: int, m: tarfile.TarInfo, *, existed: bool, key: str) -> None:
        self.stats.directories += 1
        self.dir_times[key] = _times(m)  # set last, by finish()
        os.fchown(fd, m.uid, m.gid)
        os.fchmod(fd, m.mode & 0o7777)
        wanted = _xattrs(m)
        if existed:  # the header is the directory's whole metadata: drop what a lower layer set and this one not
            for k in os.listxattr(fd):
                if k not in wanted:
                    os.removexattr(fd, k)
        for k, v in wanted.items():
            os.setxattr(fd, k, v)
            self.stats.xattrs += 1

    @staticmethod
    def _chmod_node(pfd: int, base: str, mode: int) -> None:
        """chmod a device or FIFO without opening it (which could block or have effects) or following a path."""
        fd = os.open(base, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=pfd)
        try:
            os.chmod(f"/proc/self/fd/{fd}", mode)
        finally:
            os.close(fd)

    def _hardlink(self, m: tarfile.TarInfo, pfd: int, base: str) -> None:
        tparts = _clean(m.linkname, f"entry {m.name!r}: hard link target")
        if not tparts:
            raise LayerApplyError(f"entry {m.name!r}: hard link to the root")
        found = self._walk(tparts[:-1], create=False, name=m.name)
        if found is None:
            raise LayerApplyError(f"entry {m.name!r}: hard link target {m.linkname!r} does not exist")
        tfd, _ = found
        try:
            tbase = tparts[-1]
            try:
                target = os.stat(tbase, dir_fd=tfd, follow_symlinks=False)
            except FileNotFoundError:
                raise LayerApplyError(f"entry {m.name!r}: hard link target {m.linkname!r} does not exist") from None
            if stat.S_ISDIR(target.st_mode):
                raise LayerApplyError(f"entry {m.name!r}: hard link target {m.linkname!r} is a directory")
            try:
                here = os.stat(base, dir_fd=pfd, follow_symlinks=False)
                if (here.st_dev, here.st_ino) == (target.st_dev, target.st_ino):
                    return  # already that file (a link to itself, or a repeated entry)
            except FileNotFoundError:
                pass
            self._remove(pfd, base)
            os.link(tbase, base, src_dir_fd=tfd, dst_dir_fd=pfd, follow_symlinks=False)
        finally:
            os.close(tfd)
        self.stats.hardlinks += 1

    def _whiteout(self, m: tarfile.TarInfo, parts: list[str]) -> None:
        base = parts[-1]
        if base.startswith(_WHITEOUT_META) and base != OPAQUE_MARKER:
            return
        victim = base[len(WHITEOUT_PREFIX) :]
        if victim in ("", ".", ".."):
            raise LayerApplyError(f"entry {m.name!r} is not a valid whiteout")
        self.stats.whiteouts += 1
        found = self._opendir(parts[:-1], create=False, name=m.name)
        if found is None:
            return  # nothing below to hide
        dfd, dnames = found
        if base == OPAQUE_MARKER:
            self._prune(dfd, dnames)
            self._stale = True
            return
        k = _key(dnames + [victim])
        if k in self.layer_paths:
            return  # a whiteout hides lower layers only, never an entry of its own layer
        if k in self.ancestors:  # this layer put entries below it: hide only what lower layers left there
            cfd = os.open(victim, _DIR_FLAGS, dir_fd=dfd)
            try:
                self._prune(cfd, dnames + [victim])
            finally:
                os.close(cfd)
            self._stale = True
            return
        self._remove(dfd, victim)

    def finish(self) -> None:
        """Directory times, deepest first, once nothing else will change them."""
        self._drop_cache()
        for k in sorted(self.dir_times, key=lambda p: p.count("/") + bool(p), reverse=True):
            parts = k.split("/") if k else []
            try:
                fd = self._walk_real(parts)
                if fd is None:
                    continue  # removed or replaced later in the layer
                try:
                    os.utime(fd, ns=self.dir_times[k])
                finally:
                    os.close(fd)
            except OSError as e:
                raise LayerApplyError(f"directory {k or '/'!r}: setting its times: {e.strerror}") from e

    def _walk_real(self, parts: list[str]) -> int | None:
        """Open a directory by its real path (no symlinks followed at all): None if it is no longer one."""
        fd = os.dup(self.root_fd)
        for comp in parts:
            try:
                nfd = os.open(comp, _DIR_FLAGS, dir_fd=fd)
            except OSError as e:
                os.close(fd)
                if e.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                    return None
                raise
            os.close(fd)
            fd = nfd
        return fd


if __name__ == "__main__":
    sys.exit(main())
