"""Garbage collection of a node's local snapshot and layer files.

Every capture writes a disk layer and a memory layer (``layers/<hex>.layer``)
and a snapshot directory (``snapshots/<id>/``: ``vmstate`` and the flat
``memory`` image, often hundreds of MiB). Nothing else ever deletes them, so
this module decides which of those files are garbage and removes them.

What stays (a snapshot is **reachable**; ``REACHABLE_CTE`` is the SQL):

* the current snapshot of every template (``templates.boot_snapshot_id``:
  built templates and user snapshots not deleted), the snapshot of every
  build a tag names (``template_tags``), and every committed ``user``
  snapshot;
* ``sandboxes.snapshot_id`` of every sandbox not killed: a paused sandbox's
  pause snapshot, and the snapshot a creating/running/pausing/resuming
  sandbox was restored from (QEMU maps its flat memory copy-on-write, and
  the next capture patches its dirty pages into a copy of that file);
* the newest pause snapshot and the committed periodic snapshots of every
  sandbox not killed (the reconciler turns a crashed running sandbox into a
  paused one at its newest periodic snapshot);
* snapshots still ``committing``;
* the snapshot whose flat memory is the ``memory_base`` of a reachable
  snapshot (the template RAM image at the bottom of its memory chain, which
  publishing uploads as the chain's first layer).

A layer file stays while a reachable snapshot stacks it (``snapshot_layers``,
disk and memory), is a reachable boot snapshot's ``memory_base_layer``, is a
converted OCI layer (``image_layers``: the conversion cache images share), or
sits in the disk stack of a sandbox live on this node (the sandbox service passes
those stacks in: after a user snapshot is deleted its layers may still be
under a running sandbox, and that sandbox's next capture stacks them again).

Everything else goes: the snapshot rows are kept forever (lineage is history)
with ``status = 'collected'`` (no list, restore or reconcile considers such a
row), the layer rows are kept for the ``snapshot_layers`` rows that name them
(their ``refcount`` becomes 0). ``layers.refcount`` is recomputed by every
collection as the number of snapshots not collected that stack the layer (or
name it as their memory base layer): truthful after each collection, while
between collections captures only count their new layers. Reachability is
derived by SQL, not from the refcount.

Why this is safe:

* **One transaction, then the files.** A collection marks snapshots
  collected, recomputes refcounts and appends one ``events`` row
  (``operation = 'gc'``: the snapshots, layers and bytes) in one transaction,
  and unlinks files only after it commits. A crash in between leaves files
  whose rows say they are garbage; the start-up pass removes them.
* **No race with anything that opens files.** Creating, resuming, forking
  and capturing hold a *pin* (``GarbageCollector.pin``) from the moment they
  read a snapshot's rows until the sandbox row (``snapshot_id``) or the new
  snapshot's rows name what they use; a collection runs *exclusively* of all
  pins. Pins never wait for each other; a collection lets new pins go first
  for a few seconds, then holds them back until the current ones end (so it
  cannot starve), and holds the gate for milliseconds (a transaction and some
  unlinks). A layer is content-addressed, so a capture may rewrite
  the very file a collection is about to unlink: the pin rules that out too.
  Pins are not re-entrant against a waiting collection: never take one while
  holding another. Two things deliberately hold no pin: a template build
  (minutes; its files have no rows until its commit, and a collection only
  removes files that rows name, and the template's current snapshot, whose
  layers a rebuild shares, stays reachable), and publishing to the shared
  repository (it reads the newest pause snapshot, which is reachable; the
  publish of one superseded meanwhile fails with a logged warning, and its
  manifest, written last, never appears half).
* Unlinking a file a running VMM has open or mapped is harmless on Linux,
  but only files no live stack and no reachable snapshot names are unlinked.
* Only files inside the layers and snapshots directories are touched, and a
  repository-only layer (no local path: read through the cache) never.

The start-up pass (``sweep_orphans``, before any sandbox exists) also removes
files no row references: ``*.layer`` files in the layers directory that no
``layers`` row names, and snapshot directories of no (or a collected)
snapshot, if older than a grace period; and every temporary file (names
starting with ``.``, or ending in ``.part``/``.tmp``) in those directories and
in committed snapshots' directories, whatever its age: nothing of this run is
in progress yet, so a temporary belongs to an operation a crash cut.

Out of scope: objects in a shared repository (posix_fs, s3). A killed
sandbox's ``sandbox-<id>`` pointer is removed by the kill as before; the
layers and snapshot manifests it published stay in the repository.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import stat
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import trio
from sqlalchemy import text
from sqlalchemy.orm import Session

from ..faults import crash_point
from ..state import Database, EventSubject
from ..state.repository import record_event

__all__ = [
    "GARBAGE_LAYERS_SQL",
    "GARBAGE_SNAPSHOTS_SQL",
    "REACHABLE_CTE",
    "Collection",
    "GarbageCollector",
    "LiveStack",
]

log = logging.getLogger(__name__)

#: The reachable snapshot ids (``SELECT id FROM reachable``); see the module docstring.
REACHABLE_CTE = """
WITH RECURSIVE reachable(id) AS (
    SELECT boot_snapshot_id FROM templates WHERE boot_snapshot_id IS NOT NULL
  UNION
    SELECT b.snapshot_id FROM template_tags tt JOIN template_builds b ON b.id = tt.build_id
    WHERE b.snapshot_id IS NOT NULL
  UNION
    SELECT id FROM snapshots WHERE status = 'committing' OR (kind = 'user' AND status = 'committed')
  UNION
    SELECT snapshot_id FROM sandboxes WHERE state <> 'killed' AND snapshot_id IS NOT NULL
  UNION
    SELECT s.id FROM snapshots s JOIN sandboxes b ON b.id = s.source_sandbox_id
    WHERE b.state <> 'killed' AND s.kind = 'periodic' AND s.status = 'committed'
  UNION
    SELECT (SELECT p.id FROM snapshots p
            WHERE p.source_sandbox_id = b.id AND p.kind = 'pause' AND p.status = 'committed'
            ORDER BY p.created_at DESC LIMIT 1)
    FROM sandboxes b WHERE b.state <> 'killed'
  UNION
    SELECT base.id FROM reachable r
    JOIN snapshots s ON s.id = r.id
    JOIN snapshots base ON base.kind = 'boot' AND base.status <> 'collected'
         AND base.memory_location = s.memory_base_location
)
"""

#: Snapshots whose files a collection would remove now.
GARBAGE_SNAPSHOTS_SQL = REACHABLE_CTE + """
SELECT id, kind, status, source_sandbox_id, vmstate_location FROM snapshots
WHERE status <> 'collected' AND id NOT IN (SELECT id FROM reachable WHERE id IS NOT NULL)
ORDER BY created_at
"""

#: Local layers no reachable snapshot needs (those whose file still exists, and that no live
#: sandbox stacks, are what a collection removes).
GARBAGE_LAYERS_SQL = REACHABLE_CTE + """
SELECT digest, kind, local_path, size_bytes FROM layers
WHERE local_path IS NOT NULL
  AND digest NOT IN (SELECT layer_digest FROM snapshot_layers
                     WHERE snapshot_id IN (SELECT id FROM reachable WHERE id IS NOT NULL))
  AND digest NOT IN (SELECT memory_base_layer FROM snapshots
                     WHERE id IN (SELECT id FROM reachable WHERE id IS NOT NULL)
                       AND memory_base_layer IS NOT NULL)
  AND digest NOT IN (SELECT layer_digest FROM image_layers)
ORDER BY created_at
"""

_REFCOUNT_SQL = """
UPDATE layers SET refcount =
    (SELECT count(DISTINCT sl.snapshot_id) FROM snapshot_layers sl JOIN snapshots s ON s.id = sl.snapshot_id
     WHERE sl.layer_digest = layers.digest AND s.status <> 'collected')
  + (SELECT count(*) FROM snapshots s
     WHERE s.kind = 'boot' AND s.status <> 'collected'
       AND s.memory_base_layer = layers.digest)
"""

#: Suffixes of files that belong to an operation in progress (swept only at start-up).
_TEMP_SUFFIXES = (".part", ".tmp")


def _is_temporary(name: str) -> bool:
    return name.startswith(".") or name.endswith(_TEMP_SUFFIXES)


@dataclass(frozen=True)
class LiveStack:
    """What a sandbox live on this node uses: the snapshot it was restored from, the digests of the local
    disk layers under it (its source's stack and its image's own view) and of the memory chain its next
    capture will stack (``SnapshotSource.memory_layers``: loaded at its restore, so it still names layers
    a later compaction of that snapshot replaced)."""

    snapshot_id: str | None
    disk_layers: tuple[str, ...] = ()
    memory_layers: tuple[str, ...] = ()


@dataclass
class Collection:
    """What one collection (or start-up sweep) removed."""

    reason: str
    snapshots: list[str] = field(default_factory=list)
    layers: list[str] = field(default_factory=list)
    orphans: list[str] = field(default_factory=list)
    files: list[Path] = field(default_factory=list)
    bytes_freed: int = 0

    @property
    def empty(self) -> bool:
        return not (self.snapshots or self.layers or self.orphans or self.files)


def _allocated(path: Path) -> int:
    """Bytes ``path`` (a file, or a directory tree) occupies on disk (sparse files count what they hold)."""
    try:
        st = path.lstat()
    except OSError:
        return 0
    if not stat.S_ISDIR(st.st_mode):
        return st.st_blocks * 512
    total = st.st_blocks * 512
    for root, dirs, files in os.walk(path):
        for n in dirs + files:
            try:
                total += os.lstat(os.path.join(root, n)).st_blocks * 512
            except OSError:
                pass
    return total


def _newest_mtime(path: Path) -> float:
    """The newest modification time of ``path`` or (for a directory) anything directly in it."""
    newest = path.lstat().st_mtime
    if path.is_dir():
        for child in path.iterdir():
            try:
                newest = max(newest, child.lstat().st_mtime)
            except OSError:
                pass
    return newest


def _entries(directory: Path) -> list[os.DirEntry[str]]:
    """The entries of ``directory`` by name (none if it is not a directory)."""
    try:
        with os.scandir(directory) as it:
            return sorted(it, key=lambda e: e.name)
    except (FileNotFoundError, NotADirectoryError):
        return []


def _inside(path: Path, root: Path) -> bool:
    try:
        path.resolve().relative_to(root.resolve())
        return True
    except ValueError:
        return False


class _Gate:
    """Many pins or one collection. A collection first waits ``patience`` seconds for a moment
    without pins (new pins still enter: no operation waits for it); then it holds new pins back
    until the current ones end (so it cannot starve). Its own section is short."""

    def __init__(self) -> None:
        self._lot = trio.lowlevel.ParkingLot()
        self._pins = 0
        self._collecting = False
        self._waiting = 0

    @contextlib.asynccontextmanager
    async def pin(self) -> AsyncIterator[None]:
        while self._collecting or self._waiting:
            await self._lot.park()
        self._pins += 1
        try:
            yield
        finally:
            self._pins -= 1
            self._lot.unpark_all()

    @contextlib.asynccontextmanager
    async def exclusive(self, patience: float) -> AsyncIterator[None]:
        with trio.move_on_after(patience):
            while self._collecting or self._pins:
                await self._lot.park()
        self._waiting += 1
        try:
            while self._collecting or self._pins:
                await self._lot.park()
        finally:
            self._waiting -= 1
            self._lot.unpark_all()
        self._collecting = True
        try:
            yield
        finally:
            self._collecting = False
            self._lot.unpark_all()


class GarbageCollector:
    """Decides what local files are garbage and removes them (see the module docstring).

    ``live`` returns the stacks of the sandboxes live on this node (called inside a collection's
    exclusive section). ``interval_s``: a collection also runs this often without a request (a
    safety net for ends no hook sees). ``orphan_grace_s``: how old an unreferenced file must be
    before the start-up sweep removes it. ``patience_s``: how long a collection lets new
    restores and captures go first (see ``_Gate``) before it holds them back. ``min_gap_s``: requests made
    sooner than this after a collection wait for it, together: under a steady create -> kill churn every kill
    requests one, and a collection per kill (a scan of the snapshot and layer tables, under SQLite's write
    lock) would be most of what a kill costs.
    """

    def __init__(self, db: Database, *, layers_dir: Path, snapshots_dir: Path,
                 live: Callable[[], Iterable[LiveStack]], orphan_grace_s: float = 3600.0,
                 interval_s: float = 600.0, patience_s: float = 5.0, min_gap_s: float = 1.0) -> None:
        self.db = db
        self.layers_dir = Path(layers_dir)
        self.snapshots_dir = Path(snapshots_dir)
        self._live = live
        self.orphan_grace_s = orphan_grace_s
        self.interval_s = interval_s
        self.patience_s = patience_s
        self.min_gap_s = min_gap_s
        self._gate = _Gate()
        self._wanted = trio.Event()
        self._reasons: list[str] = []

    # -- the face the operations use ------------------------------------------------------------
    def pin(self) -> contextlib.AbstractAsyncContextManager[None]:
        """Hold while reading a snapshot's rows and opening its files, until rows name what is used."""
        return self._gate.pin()

    def request(self, reason: str) -> None:
        """Ask the service loop for a collection (requests coalesce)."""
        self._reasons.append(reason)
        self._wanted.set()

    async def run(self) -> None:
        """The service loop: a collection per (coalesced) request, and every ``interval_s``."""
        last = -math.inf
        while True:
            with trio.move_on_after(self.interval_s):
                await self._wanted.wait()
            await trio.sleep_until(last + self.min_gap_s)
            self._wanted = trio.Event()
            reasons, self._reasons = self._reasons, []
            try:
                await self.collect(",".join(dict.fromkeys(reasons)) or "interval")
            except Exception:
                log.exception("garbage collection failed; retrying at the next request")
            last = trio.current_time()

    async def startup(self) -> list[Collection]:
        """The start-up pass: sweep orphan files, then collect (before any sandbox exists)."""
        done = []
        for step in (self.sweep_orphans, lambda: self.collect("startup")):
            try:
                done.append(await step())
            except Exception:  # a node that cannot collect still serves; the loop retries later
                log.exception("garbage collection at start-up failed")
        return done

    # -- collection ---------------------------------------------------------------------------
    async def collect(self, reason: str) -> Collection:
        """One collection: mark and record in one transaction, then remove the files."""
        async with self._gate.exclusive(self.patience_s):
            live_snaps: set[str] = set()
            live_digests: set[str] = set()
            for st in self._live():
                if st.snapshot_id:
                    live_snaps.add(st.snapshot_id)
                live_digests.update(st.disk_layers)
                live_digests.update(st.memory_layers)
            t0 = time.monotonic()
            out = await self.db.run(self._mark, reason, live_snaps, live_digests)
            if not out.empty:
                crash_point("gc.marked")
                with trio.CancelScope(shield=True):  # committed: the files go now, or at start-up
                    await trio.to_thread.run_sync(self._remove, out.files)
                log.info("gc (%s): %d snapshots, %d layers, %d orphans collected, %.1f MiB freed in %.0f ms",
                         reason, len(out.snapshots), len(out.layers), len(out.orphans),
                         out.bytes_freed / 2**20, (time.monotonic() - t0) * 1000)
            return out

    def _mark(self, s: Session, reason: str, live_snaps: set[str], live_digests: set[str]) -> Collection:
        # take the write lock first: a read-then-write transaction could otherwise fail with
        # SQLITE_BUSY_SNAPSHOT when another writer commits in between (busy_timeout waits here)
        s.execute(text("UPDATE layers SET refcount = refcount WHERE 0"))
        out = Collection(reason)
        for sid, _kind, _status, _src, _vmstate in s.execute(text(GARBAGE_SNAPSHOTS_SQL)).all():
            if sid in live_snaps:
                continue
            out.snapshots.append(sid)
        if live_snaps:
            # a live stack's snapshot is kept, and with it what it stacks
            placeholders = ",".join(f":s{i}" for i in range(len(live_snaps)))
            params = {f"s{i}": v for i, v in enumerate(sorted(live_snaps))}
            live_digests |= {d for (d,) in s.execute(text(
                f"SELECT layer_digest FROM snapshot_layers WHERE snapshot_id IN ({placeholders})"), params)}
        for digest, _kind, location, _size in s.execute(text(GARBAGE_LAYERS_SQL)).all():  # location: a local path
            if digest in live_digests:
                continue
            path = Path(location)
            if not path.is_file() or not _inside(path, self.layers_dir):
                continue  # collected before (rows stay), or not ours to delete
            out.layers.append(digest)
            out.files.append(path)
        for sid in out.snapshots:
            d = self.snapshots_dir / sid
            if d.exists() and _inside(d, self.snapshots_dir):
                out.files.append(d)
        if out.snapshots:
            for i in range(0, len(out.snapshots), 500):
                chunk = out.snapshots[i:i + 500]
                placeholders = ",".join(f":s{j}" for j in range(len(chunk)))
                s.execute(text(f"UPDATE snapshots SET status = 'collected' WHERE id IN ({placeholders})"),
                          {f"s{j}": v for j, v in enumerate(chunk)})
        if out.empty:
            return out
        s.execute(text(_REFCOUNT_SQL))
        out.bytes_freed = sum(_allocated(p) for p in out.files)
        record_event(s, "gc", subject=EventSubject.NODE, subject_id=None, detail={
            "reason": reason, "snapshots": out.snapshots, "layers": out.layers,
            "files": len(out.files), "bytes_freed": out.bytes_freed})
        return out

    # -- start-up sweep -----------------------------------------------------------------------
    async def sweep_orphans(self) -> Collection:
        """Remove files no row references (older than the grace period), with their ``gc`` event."""
        async with self._gate.exclusive(self.patience_s):
            out = await self.db.run(self._mark_orphans)
            if not out.empty:
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(self._remove, out.files)
                log.info("gc sweep: %d orphan files, %.1f MiB freed", len(out.orphans), out.bytes_freed / 2**20)
            return out

    def _mark_orphans(self, s: Session) -> Collection:
        out = Collection("startup-sweep")
        cutoff = time.time() - self.orphan_grace_s
        known_layers = {os.path.basename(loc) for (loc,) in s.execute(text(
            "SELECT local_path FROM layers WHERE local_path IS NOT NULL"))}
        known_layers |= {d.split(":", 1)[1] + ".layer" for (d,) in s.execute(text("SELECT digest FROM layers"))}
        snaps: dict[str, str] = {sid: status for sid, status in s.execute(text("SELECT id, status FROM snapshots"))}

        def young(p: Path) -> bool:
            try:
                return _newest_mtime(p) > cutoff
            except OSError:
                return True

        def orphan(p: Path) -> None:
            out.orphans.append(str(p))
            out.files.append(p)

        # directory entries carry their type: tens of thousands of layer files and snapshot directories on a
        # node with 10,000 paused sandboxes are told apart without a stat each (bench/fleet_state.py)
        for e in _entries(self.layers_dir):
            n = e.name
            if not e.is_file(follow_symlinks=False):
                continue
            p = Path(e.path)
            if _is_temporary(n) or (n not in known_layers and not young(p)):
                orphan(p)
        for e in _entries(self.snapshots_dir):
            n = e.name
            p = Path(e.path)
            if e.is_symlink():
                continue
            if _is_temporary(n):
                orphan(p)
                continue
            status = snaps.get(n)
            if status is not None and status != "collected":
                if e.is_dir(follow_symlinks=False):  # a committed snapshot's materialization a crash cut
                    for f in _entries(p):
                        if _is_temporary(f.name) and not f.is_symlink():
                            orphan(Path(f.path))
                continue
            if status is None and young(p):
                continue  # unknown and recent: perhaps a capture or an import in progress
            orphan(p)
        if out.empty:
            return out
        out.bytes_freed = sum(_allocated(p) for p in out.files)
        record_event(s, "gc", subject=EventSubject.NODE, subject_id=None, detail={
            "reason": out.reason, "snapshots": [], "layers": [], "orphans": out.orphans,
            "files": len(out.files), "bytes_freed": out.bytes_freed})
        return out

    @staticmethod
    def _remove(paths: list[Path]) -> None:
        for p in paths:
            try:
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p)
                else:
                    p.unlink()
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("gc: removing %s failed: %s", p, exc)
