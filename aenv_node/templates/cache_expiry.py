"""What a node keeps for builds to come, and when it lets go: converted layers, uploaded files, pulled blobs.

Three caches make a rebuild cheap: the block layers converted from OCI layers and made by build steps
(``image_layers``, keyed by chain), the COPY archives clients uploaded (``template-files/<hash>.tar``), and the
pulled blobs (``oci/blobs/sha256/<hex>``). With one image per task (an RL run pulls millions), none may grow
forever. Each entry expires ``templates.cache_ttl_s`` after a build last used it:

* an ``image_layers`` row is dropped when its ``last_used_at`` is older than that, no snapshot the garbage
  collector keeps stacks its layer, no build in progress touched it, and no row kept stands on it (a kept
  chain keeps its ancestors). Dropping the row is all: the collector then removes the layer file like any
  other unreachable layer (``snapshot/gc.py``), in its own transaction-then-files order;
* a file (an upload, a blob) goes when its modification time is older than that (a build touches what it
  uses) and no build is in progress at that moment: plain files have no rows to guard them, so the sweep
  waits for a quiet moment rather than track each build's files.
"""

from __future__ import annotations

import datetime as dt
import os
import time
from collections.abc import Collection, Iterable
from pathlib import Path

from sqlalchemy import delete, select, text
from sqlalchemy.orm import Session

from ..snapshot.gc import REACHABLE_CTE
from ..state import EventSubject, ImageLayer
from ..state.repository import record_event

__all__ = ["expire_converted_layers", "expired_files", "touch"]

_STACKED_SQL = REACHABLE_CTE + """
SELECT DISTINCT layer_digest FROM snapshot_layers WHERE snapshot_id IN (SELECT id FROM reachable WHERE id IS NOT NULL)
"""


def expire_converted_layers(s: Session, cutoff: dt.datetime, in_use: Collection[str]) -> list[str]:
    """Drop the ``image_layers`` rows expired at ``cutoff`` (see the module docstring), with one event; returns
    their chain ids. ``in_use``: layer digests builds in progress touched."""
    s.execute(text("UPDATE image_layers SET chain_id = chain_id WHERE 0"))  # the write lock first
    rows = s.execute(select(ImageLayer.chain_id, ImageLayer.parent_chain_id, ImageLayer.layer_digest,
                            ImageLayer.last_used_at)).all()
    if not rows:
        return []
    stacked = {d for (d,) in s.execute(text(_STACKED_SQL))}
    parent = {chain: p for chain, p, _, _ in rows}
    kept: set[str] = set()
    for chain, _, digest, used in rows:
        if used >= cutoff or digest in stacked or digest in in_use:
            c: str | None = chain
            while c is not None and c not in kept:  # a kept chain keeps everything under it
                kept.add(c)
                c = parent.get(c)
    gone = [chain for chain, _, _, _ in rows if chain not in kept]
    for i in range(0, len(gone), 500):
        s.execute(delete(ImageLayer).where(ImageLayer.chain_id.in_(gone[i:i + 500])))
    if gone:
        record_event(s, "image_layer_expire", subject=EventSubject.IMAGE, subject_id=None,
                     detail={"chains": gone, "cutoff": cutoff.isoformat()})
    return gone


def expired_files(dirs: Iterable[Path], ttl_s: float, *, now: float | None = None) -> list[Path]:
    """Plain files under ``dirs`` not modified for ``ttl_s`` (temporary ones, ``.*`` and ``*.partial``/``*.part``,
    belong to writes in progress and never expire)."""
    cutoff = (time.time() if now is None else now) - ttl_s
    out = []
    for d in dirs:
        if not d.is_dir():
            continue
        for root, _, files in os.walk(d):
            for name in files:
                if name.startswith(".") or name.endswith((".partial", ".part")):
                    continue
                p = Path(root) / name
                try:
                    st = p.lstat()
                except OSError:
                    continue
                if st.st_mtime < cutoff and not p.is_symlink():
                    out.append(p)
    return out


def touch(paths: Iterable[Path]) -> None:
    """A build uses these files: their time to expire starts again."""
    for p in paths:
        try:
            os.utime(p)
        except OSError:
            pass
