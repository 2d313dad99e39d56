"""Compaction: a chain of layers becomes one equivalent layer; and diffs between a stack and its base.

Compaction reads every byte that the merged chain serves (verified by the readers) and streams it into a
``LayerWriter``; it holds no lock of any image, so it runs in a background thread while the image serves I/O
(``Image.compact`` swaps the result in).  When the chain starts at the bottom of the stack, zeroed extents and
all-zero blocks become holes (there is nothing below them to shadow).  Data garbage (blocks trimmed in an upper
before it was sealed, overwritten extents of lower layers) is dropped.
"""

from __future__ import annotations

import os
from typing import NamedTuple, Sequence

import numpy as np

from .layer import LayerInfo, LayerWriter
from .stack import ZERO, StackLayer, merge_layers

__all__ = ["compact_layers", "diff_extents", "Change"]

_COPY_CHUNK = 1 << 20


def compact_layers(layers: Sequence[StackLayer], dest_dir: str | os.PathLike[str], *, bottom: bool,
                   compression: str | None = None, virtual_size: int | None = None) -> LayerInfo:
    """Write one layer equivalent to ``layers`` (bottom first) stacked; ``bottom`` if nothing lies below."""
    if not layers:
        raise ValueError("nothing to compact")
    size = virtual_size if virtual_size is not None else max(l.virtual_size for l in layers)
    runs = merge_layers(layers)
    with LayerWriter(dest_dir, size, compression=compression,
                     zero_blocks="omit" if bottom else "zeroed") as w:
        for start, end, owner, doff in runs:
            if owner == ZERO:
                if not bottom:
                    w.add_zeroed(start, end - start)
                continue
            read = layers[owner].read_stream
            for pos in range(start, end, _COPY_CHUNK):
                n = min(_COPY_CHUNK, end - pos)
                w.add_data(pos, read(doff + pos - start, n))
        return w.finish()


class Change(NamedTuple):
    offset: int
    length: int
    zeroed: bool  # True: the range now reads as zeros; False: it holds data of the newer layers


def diff_extents(newer: Sequence[StackLayer], base: Sequence[StackLayer]) -> list[Change]:
    """Ranges where ``base + newer`` may read differently from ``base`` alone: everything the newer layers
    map, except zeroed ranges over parts where the base holds no data (they read as zeros either way)."""
    top = merge_layers(newer)
    below = merge_layers(base)
    data_start = below.start[below.owner >= 0]
    data_end = below.end[below.owner >= 0]
    out: list[Change] = []
    for start, end, owner, _ in top:
        if owner != ZERO:
            out.append(Change(start, end - start, False))
            continue
        # keep only the parts of [start, end) that overlap data of the base
        i = int(np.searchsorted(data_end, start, side="right"))
        while i < len(data_start) and data_start[i] < end:
            s, t = max(start, int(data_start[i])), min(end, int(data_end[i]))
            if s < t:
                if out and out[-1].zeroed and out[-1].offset + out[-1].length == s:
                    out[-1] = Change(out[-1].offset, out[-1].length + t - s, True)
                else:
                    out.append(Change(s, t - s, True))
            i += 1
    return out
