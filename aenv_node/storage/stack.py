"""Merging the indexes of a stack of layers into one lookup structure.

Given extent lists bottom-first, ``merge`` computes which layer serves every byte: the top-most one that maps
it.  It works on numpy arrays over the *elementary intervals* (between consecutive extent boundaries of all
layers), so merging is O(E log E) for E extents in total however the layers overlap, with no per-extent Python
work.  The image turns the result into plain lists for bisect lookups (scalar access to lists is ~10x faster
than to numpy arrays, and a read needs only a handful of them); compaction, materialize and diff iterate it.
"""

from __future__ import annotations

import array
from dataclasses import dataclass
from typing import Iterator, Protocol, Sequence

import numpy as np

from . import layer_format as F

__all__ = ["HOLE", "ZERO", "Level", "StackLayer", "Runs", "merge", "merge_layers", "layer_level", "runs_level"]

HOLE = -1  # no layer maps the range: reads as zeros, falls through to whatever is below the merged stack
ZERO = -2  # a zeroed extent maps the range: reads as zeros, shadows what is below


class StackLayer(Protocol):
    """What merging and reading a stack needs of one of its read-only layers: a ``LayerReader``, or an upper
    that ``Image.freeze`` took out of service and that serves reads until it is sealed."""

    @property
    def extents(self) -> np.ndarray: ...  # EXTENT_DTYPE

    @property
    def virtual_size(self) -> int: ...

    @property
    def digest(self) -> str | None: ...

    def read_stream(self, doff: int, length: int) -> bytes: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class Level:
    start: np.ndarray  # int64, sorted, non-overlapping
    length: np.ndarray
    doff: np.ndarray
    zeroed: np.ndarray  # bool
    owner: np.ndarray | None = None  # per-extent owner id; None: the level's own index in the merge


def layer_level(extents: np.ndarray, owner: int | None = None) -> Level:
    """A ``Level`` from a layer's index (numpy EXTENT_DTYPE array); ``owner`` overrides its owner id."""
    n = len(extents)
    return Level(
        extents["voff"].astype(np.int64),
        extents["length"].astype(np.int64),
        extents["doff"].astype(np.int64),
        (extents["flags"] & F.EXTENT_ZEROED).astype(bool),
        None if owner is None else np.full(n, owner, np.int64),
    )


def runs_level(runs: "Runs") -> Level:
    """An already merged stack as one level (its owners kept), to paint a new layer over it."""
    return Level(runs.start, runs.end - runs.start, runs.doff, runs.owner == ZERO, runs.owner)


@dataclass(frozen=True)
class Runs:
    """Sorted, non-overlapping mapped runs of a merged stack (holes omitted).

    ``owner[i]`` is the index of the level serving ``[start[i], end[i])`` or ``ZERO``; ``doff[i]`` is the data
    stream offset (in that level's layer) of ``start[i]``.  Adjacent runs are coalesced when contiguous in the
    same layer's data stream.
    """

    start: np.ndarray
    end: np.ndarray
    owner: np.ndarray
    doff: np.ndarray

    def __len__(self) -> int:
        return len(self.start)

    def __iter__(self) -> Iterator[tuple[int, int, int, int]]:
        """(start, end, owner, doff) tuples."""
        return zip(self.start.tolist(), self.end.tolist(), self.owner.tolist(), self.doff.tolist())

    def partition(self, size: int) -> tuple[array.array[int], array.array[int], array.array[int]]:
        """Cover ``[0, size)`` completely (holes as ``HOLE`` runs): arrays (starts + [size] sentinel, owner,
        doff) for bisect lookups (``array.array``: fast scalar access, 8 bytes per entry)."""
        s, e, o, d = self.start, self.end, self.owner, self.doff
        keep = s < size
        s, e, o, d = s[keep], np.minimum(e[keep], size), o[keep], d[keep]
        n = len(s)
        prev_end = np.concatenate(([0], e[:-1])) if n else np.zeros(0, np.int64)
        gap = s > prev_end
        # interleave: for each run, an optional hole before it
        ng = int(gap.sum())
        starts = np.empty(n + ng, np.int64)
        owner = np.empty(n + ng, np.int64)
        doff = np.zeros(n + ng, np.int64)
        pos = np.arange(n) + np.cumsum(gap)  # index of run i in the output
        starts[pos], owner[pos], doff[pos] = s, o, d
        gpos = pos[gap] - 1
        starts[gpos], owner[gpos] = prev_end[gap], HOLE
        if n == 0:
            starts, owner, doff = np.array([0], np.int64), np.array([HOLE], np.int64), np.array([0], np.int64)
        tail = int(e[-1]) if n else size
        if starts[0] != 0:
            starts, owner, doff = (np.concatenate(([v], a)) for v, a in ((0, starts), (HOLE, owner), (0, doff)))
        if tail < size:
            starts, owner, doff = (np.concatenate((a, [v])) for v, a in ((tail, starts), (HOLE, owner), (0, doff)))
        starts = np.concatenate((starts, [size]))

        def arr(x: np.ndarray) -> array.array[int]:
            out = array.array("q")
            out.frombytes(x.astype("=i8").tobytes())
            return out

        return arr(starts), arr(owner), arr(doff)


def _ranges(first: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Concatenation of arange(first[i], first[i] + counts[i]) for all i, vectorised."""
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, np.int64)
    csum = np.cumsum(counts)
    offs = np.repeat(first - (csum - counts), counts)
    return offs + np.arange(total, dtype=np.int64)


def merge(levels: Sequence[Level]) -> Runs:
    """Merge extent levels (bottom first) into the runs of the top-most mapping."""
    nonempty = [lv for lv in levels if len(lv.start)]
    if not nonempty:
        z = np.zeros(0, np.int64)
        return Runs(z, z, z, z)
    bounds = np.concatenate([np.concatenate((lv.start, lv.start + lv.length)) for lv in nonempty])
    bounds.sort(kind="stable")  # (sort + dedupe: np.unique's hash path is ~5x slower on this data)
    bounds = bounds[np.concatenate(([True], bounds[1:] != bounds[:-1]))]
    m = len(bounds) - 1
    owner = np.full(m, HOLE, np.int64)
    doff = np.zeros(m, np.int64)
    for k, lv in enumerate(levels):
        if not len(lv.start):
            continue
        i0 = np.searchsorted(bounds, lv.start)
        i1 = np.searchsorted(bounds, lv.start + lv.length)
        counts = i1 - i0
        pos = _ranges(i0, counts)
        ext = np.repeat(np.arange(len(lv.start)), counts)
        z = lv.zeroed[ext]
        own = k if lv.owner is None else lv.owner[ext]
        owner[pos] = np.where(z, ZERO, own)
        doff[pos] = np.where(z, 0, lv.doff[ext] + (bounds[pos] - lv.start[ext]))
    start, end = bounds[:-1], bounds[1:]
    keep = owner != HOLE
    start, end, owner, doff = start[keep], end[keep], owner[keep], doff[keep]
    if len(start) > 1:
        same = (
            (start[1:] == end[:-1])
            & (owner[1:] == owner[:-1])
            & ((owner[1:] == ZERO) | (doff[1:] == doff[:-1] + (end[:-1] - start[:-1])))
        )
        first = np.concatenate(([True], ~same))
        idx = np.flatnonzero(first)
        last = np.concatenate((idx[1:] - 1, [len(start) - 1]))
        start, end, owner, doff = start[idx], end[last], owner[idx], doff[idx]
    return Runs(start, end, owner, doff)


def merge_layers(layers: Sequence[StackLayer]) -> Runs:
    """Merge layers (bottom first); run owners index into ``layers``."""
    return merge([layer_level(l.extents) for l in layers])
