"""Garbage collection of the shared repository: snapshot manifests and layers no sandbox can reach any more.

Every pause publishes a snapshot manifest (and the layers it names that are not there yet) and moves the
sandbox's ``sandbox-<id>`` record to it; a kill deletes the record.  Nothing else ever removes a manifest or a
layer, so without this a sandbox paused 1000 times leaves 1000 manifests and every layer it ever had.

**Mark.**  The roots are the ``sandbox-<id>`` records, in any state (``paused``, ``running``, ``deleting``),
and the shared templates' ``template-<id>`` records (template_record.py, never swept here): each names a
snapshot manifest (ownership.py), which names its ``disk_layers`` and ``memory_layers``
(``LayerManifest``, manifest.py: the only part of a snapshot manifest read here).  Every
manifest that is kept (reachable, or too young to judge, see below) has its layers kept too, so nothing kept
ever names a removed layer.  Records are never removed here; neither are half-written uploads
(``sweep_incomplete`` owns those).

**Sweep.**  A snapshot manifest that no record reaches, and a layer that no kept manifest names, are removed
when their age says so: written (or, for a layer, last *reused*) before ``cutoff = start - grace_s``, where
``start`` is taken before anything is listed.  Each object's age is read again immediately before it is
deleted, so a reuse that happened after the listing saves it.

**Why it is safe next to publishers on other nodes** (there is no global lock; S3 has none).  A publish
uploads layers, then writes the snapshot manifest, then moves the record: in between, the new manifest and
its new layers are reachable from nothing.  They are young, and young objects are never removed.  The subtle
case is a layer that already exists: ``put_layer``/``commit_snapshot`` then store nothing, so an old layer no
record reaches any more (its sandbox was killed, or its snapshot superseded) could be swept right after a
publish decided to reuse it.  So reuse refreshes the layer's age (``Repository.touch_layer``: ``os.utime``
on posix_fs, a tiny reuse-mark object on S3, see s3.py) *before* the manifest is written.  With ``cutoff``
taken before the listing, the argument is:

* a layer touched (or uploaded) at or after ``cutoff`` is kept;
* a layer touched before ``cutoff`` belongs to a publish that, by the assumption below, finished (manifest
  and record written) before ``start``, so this collection's listing saw its manifest and record: if they
  reach the layer, it is marked; if not, that publish's snapshot really is superseded or killed;
* a publish that reuses it after the listing touches it, and the re-check right before the delete sees that.

**Assumptions.**  (1) A publish completes (layers, manifest, record) within ``grace_s`` of touching or
uploading its first layer; the default grace of an hour is orders of magnitude longer than a publish, and a
publish that takes longer risks only its own new snapshot.  (2) Clocks: ages compare the node's clock with
the storage's timestamps (file mtimes, S3 ``LastModified``, which has one-second resolution), so ``grace_s``
must be far above the skew (S3 refuses requests skewed by more than 15 minutes).  (3) The re-check and the delete are two operations, so a
publish that touches a layer in the microseconds (posix_fs) or milliseconds (S3) between them can still lose
it; the window is that of one ``stat``/``HEAD`` and one ``unlink``/``DELETE`` against a whole publish.
(4) Only what records reach is kept: layers stored without a manifest (``aenv layer import``/``seal``) and
``repo:`` layers a node still runs a sandbox from after the record that reached them was deleted (a fork of
an imported sandbox, killed before the fork paused) are collected once older than ``grace_s``.

Several nodes may collect the same repository at once: they compute the same answer and deletes of absent
objects are no-ops.  A crash mid-sweep leaves only garbage for the next run (manifests go before layers, so
no kept manifest ever names a removed layer).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from .errors import ManifestNotFound, RepositoryError
from .manifest import LayerManifest
from .ownership import RECORD_PREFIX
from .template_record import TEMPLATE_PREFIX, get_template, is_template_record

if TYPE_CHECKING:
    from .base import Repository

__all__ = ["GcReport", "collect_garbage", "RECORD_PREFIX"]

log = logging.getLogger(__name__)


@dataclass
class GcReport:
    """What one collection found and removed (or, with ``dry_run``, would remove)."""

    dry_run: bool
    grace_s: float
    records: int = 0
    manifests_kept: int = 0
    layers_kept: int = 0
    manifests_removed: list[str] = field(default_factory=list)
    layers_removed: list[str] = field(default_factory=list)
    bytes_removed: int = 0
    reuse_marks_removed: int = 0
    #: Candidates that turned out to be fresh (reused meanwhile) or gone at the re-check.
    rechecked_kept: int = 0
    #: Records naming a manifest that is absent (the sandbox cannot be resumed from the repository).
    missing_manifests: list[str] = field(default_factory=list)
    #: Kept manifests that could not be read: their layers are unknown, so no layer was removed.
    unreadable_manifests: list[str] = field(default_factory=list)
    stopped: bool = False
    duration_s: float = 0.0

    def summary(self) -> dict[str, Any]:
        """A compact form for logs and the ``events`` row: counts, bytes, and the first few names."""
        d = asdict(self)
        for k in ("manifests_removed", "layers_removed", "missing_manifests", "unreadable_manifests"):
            d[k] = d[k][:20]
        d["manifests_removed_count"] = len(self.manifests_removed)
        d["layers_removed_count"] = len(self.layers_removed)
        d["duration_s"] = round(self.duration_s, 3)
        return d


def collect_garbage(repo: "Repository", grace_s: float, *, dry_run: bool = False,
                    stop: Optional[threading.Event] = None) -> GcReport:
    """Mark from the ``sandbox-<id>`` records, sweep what is unreachable and older than ``grace_s`` (blocking).

    See the module docstring for the rules and why they are safe next to concurrent publishers."""
    if grace_s < 0:
        raise ValueError(f"grace_s must be >= 0, got {grace_s}")
    t0 = time.monotonic()
    start = time.time()
    cutoff = start - grace_s
    report = GcReport(dry_run=dry_run, grace_s=grace_s)

    # -- mark -------------------------------------------------------------------------------------------
    manifests = repo.manifest_infos()
    records = [m for m in manifests if m.startswith(RECORD_PREFIX)]
    report.records = len(records)
    reachable: set[str] = set()
    for rid in records:
        try:
            rec = repo.get_ownership(rid.removeprefix(RECORD_PREFIX))
        except (ValueError, RepositoryError) as exc:
            # a record we cannot read (or of a newer version) might name anything: keep every snapshot
            # manifest this round
            log.warning("repository gc: cannot read record %s (%s); keeping every manifest this round", rid, exc)
            report.unreadable_manifests.append(rid)
            continue
        if rec is None:
            continue  # killed since the listing
        if rec.snapshot_id:
            reachable.add(rec.snapshot_id)

    # shared templates (template_record.py) are roots too; their records are never swept here
    for rid in [m for m in manifests if m.startswith(TEMPLATE_PREFIX)]:
        try:
            template = get_template(repo, rid.removeprefix(TEMPLATE_PREFIX))
        except (ValueError, RepositoryError) as exc:
            log.warning("repository gc: cannot read record %s (%s); keeping every manifest this round", rid, exc)
            report.unreadable_manifests.append(rid)
            continue
        if template is not None:
            reachable.add(template.snapshot_id)

    snapshots = [m for m in manifests if not m.startswith(RECORD_PREFIX) and not is_template_record(m)]
    keep_all_manifests = bool(report.unreadable_manifests)
    kept = [m for m in snapshots if keep_all_manifests or m in reachable or manifests[m].mtime >= cutoff]
    report.missing_manifests = sorted(reachable - set(manifests))
    # a record may name a manifest written after the listing (a publish just now): it is young, so it and its
    # layers are protected by their age; one listed as absent is checked again here
    for sid in report.missing_manifests:
        if repo.manifest_info(sid) is not None:
            kept.append(sid)
    report.missing_manifests = [s for s in report.missing_manifests if s not in kept]
    marked: set[str] = set()
    for mid in kept:
        try:
            marked.update(repo.read_manifest(mid, LayerManifest).layer_digests())
        except ManifestNotFound:
            continue  # removed by another collection: it was unreachable, its layers need no mark
        except (ValueError, RepositoryError) as exc:
            log.warning("repository gc: cannot read manifest %s (%s); no layer is removed this round", mid, exc)
            report.unreadable_manifests.append(mid)
    report.manifests_kept = len(kept)

    # -- sweep manifests (before layers: a crash never leaves a kept manifest naming a removed layer) -------
    kept_set = set(kept)
    for mid in snapshots:
        if mid in kept_set:
            continue
        if stop is not None and stop.is_set():
            report.stopped = True
            break
        info = repo.manifest_info(mid)  # the re-check
        if info is None or info.mtime >= cutoff:
            report.rechecked_kept += 1
            continue
        if not dry_run:
            repo.delete_manifest(mid)
        report.manifests_removed.append(mid)

    # -- sweep layers -----------------------------------------------------------------------------------
    layers = repo.layer_infos()
    candidates = [d for d, info in layers.items() if d not in marked and info.mtime < cutoff]
    report.layers_kept = len(layers) - len(candidates)
    if report.unreadable_manifests:
        report.layers_kept = len(layers)
        candidates = []
    for d in candidates:
        if report.stopped or (stop is not None and stop.is_set()):
            report.stopped = True
            break
        info = repo.layer_info(d)  # the re-check: a publish may have reused it since the listing
        if info is None or info.mtime >= cutoff:
            report.rechecked_kept += 1
            report.layers_kept += info is not None
            continue
        if not dry_run:
            repo.delete_layer(d)
        report.layers_removed.append(d)
        report.bytes_removed += info.size

    if not report.stopped:
        report.reuse_marks_removed = repo.sweep_reuse_marks(cutoff, dry_run=dry_run)
    report.duration_s = time.monotonic() - t0
    return report

