"""stack.merge agrees with painting the layers block by block, bottom to top."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from aenv_node.storage.stack import HOLE, ZERO, Level, merge, runs_level

NB = 64  # blocks


@st.composite
def levels(draw: st.DrawFn) -> list[Level]:
    out = []
    for _ in range(draw(st.integers(0, 5))):
        cuts = sorted(draw(st.sets(st.integers(0, NB), max_size=12)))
        starts, lengths, doffs, zeroed = [], [], [], []
        d = 0
        for a, b in zip(cuts[::2], cuts[1::2]):
            if a == b:
                continue
            z = draw(st.booleans())
            starts.append(a)
            lengths.append(b - a)
            doffs.append(0 if z else d)
            zeroed.append(z)
            d += 0 if z else (b - a) + draw(st.integers(0, 3))
        out.append(Level(np.array(starts, np.int64), np.array(lengths, np.int64), np.array(doffs, np.int64),
                         np.array(zeroed, bool)))
    return out


def paint(lvls: list[Level]) -> list[tuple[int, int]]:
    """(owner, data offset) of every block."""
    blocks = [(HOLE, 0)] * NB
    for k, lv in enumerate(lvls):
        for s, n, d, z in zip(lv.start.tolist(), lv.length.tolist(), lv.doff.tolist(), lv.zeroed.tolist()):
            for b in range(s, s + n):
                blocks[b] = (ZERO, 0) if z else (k, d + b - s)
    return blocks


def expand(runs) -> list[tuple[int, int]]:  # type: ignore[no-untyped-def]
    blocks = [(HOLE, 0)] * NB
    for s, e, o, d in runs:
        for b in range(s, e):
            blocks[b] = (ZERO, 0) if o == ZERO else (o, d + b - s)
    return blocks


@settings(max_examples=300, deadline=None)
@given(levels())
def test_merge_matches_painting(lvls: list[Level]) -> None:
    runs = merge(lvls)
    assert expand(runs) == paint(lvls)
    # runs are sorted, disjoint and maximal (coalesced)
    items = list(runs)
    for (s1, e1, o1, d1), (s2, _e2, o2, d2) in zip(items, items[1:]):
        assert e1 <= s2
        assert not (e1 == s2 and o1 == o2 and (o1 == ZERO or d1 + (e1 - s1) == d2))
    # painting a new level over merged runs equals merging everything at once
    if len(lvls) >= 2:
        top = lvls[-1]
        inc = merge([runs_level(merge(lvls[:-1])),
                     Level(top.start, top.length, top.doff, top.zeroed, np.full(len(top.start), len(lvls) - 1))])
        assert expand(inc) == paint(lvls)
    # partition covers everything in order
    starts, owner, _ = runs.partition(NB)
    assert starts[0] == 0 and starts[-1] == NB and list(starts) == sorted(set(starts))
