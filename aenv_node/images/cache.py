"""Content-hash keyed, atomically published build outputs (the guest kit, template root filesystems).

Every artifact is named by a hash over all of its inputs, built in a hidden temporary sibling and renamed into
place only when complete, so a reader sees either nothing or a whole artifact: a crash or an interrupted build
leaves only a ``.tmp-*`` entry, which the next build (holding the lock) removes. One ``flock`` per cache
directory serialises builders across processes; readers never take it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

__all__ = ["InputHasher", "build_lock", "publish", "remove_stale", "staging_dir"]

TMP_PREFIX = ".tmp-"


class InputHasher:
    """sha256 over named inputs; every item is length-prefixed so no two input sets collide by concatenation."""

    def __init__(self, kind: str) -> None:
        self._h = hashlib.sha256()
        self.add("kind", kind.encode())

    def add(self, name: str, data: bytes) -> None:
        for part in (name.encode(), data):
            self._h.update(len(part).to_bytes(8, "little"))
            self._h.update(part)

    def add_text(self, name: str, text: str) -> None:
        self.add(name, text.encode())

    def add_file(self, name: str, path: Path) -> None:
        self.add(name, path.read_bytes())

    def add_tree(self, name: str, root: Path, *, skip: Iterable[str] = ("__pycache__",)) -> None:
        """Every regular file under ``root`` (sorted relative paths and contents); absent root hashes as empty."""
        skipped = set(skip)
        if not root.is_dir():
            self.add(f"{name}:absent", b"")
            return
        for path in sorted(root.rglob("*")):
            rel = path.relative_to(root)
            if any(part in skipped for part in rel.parts) or path.suffix in (".pyc", ".pyo"):
                continue
            if path.is_file():
                self.add(f"{name}/{rel.as_posix()}", path.read_bytes())

    def hexdigest(self, length: int = 16) -> str:
        return self._h.hexdigest()[:length]


@contextlib.contextmanager
def build_lock(cache_dir: Path) -> Iterator[None]:
    """Exclusive lock on ``cache_dir`` held for a whole build (blocks while another process builds)."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(cache_dir / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the flock


def remove_stale(cache_dir: Path) -> list[Path]:
    """Delete leftovers of interrupted builds. Call only while holding :func:`build_lock`."""
    removed = []
    if cache_dir.is_dir():
        for entry in cache_dir.iterdir():
            if entry.name.startswith(TMP_PREFIX):
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)
                removed.append(entry)
    return removed


@contextlib.contextmanager
def staging_dir(cache_dir: Path, name: str) -> Iterator[Path]:
    """A fresh temporary directory inside ``cache_dir`` (same filesystem, so the final rename is atomic).

    Removed on exit whatever happens; the caller renames what it wants to keep out of it (or the directory
    itself) before leaving the block.
    """
    tmp = cache_dir / f"{TMP_PREFIX}{name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def publish(src: Path, dest: Path) -> None:
    """Atomically make ``src`` (file or directory) visible as ``dest`` (which must not exist yet)."""
    os.rename(src, dest)
    fd = os.open(dest.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
