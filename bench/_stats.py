"""Small helpers the benchmark scripts share: timestamps, milliseconds, percentiles."""

from __future__ import annotations

import datetime as dt


def utc_now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def ms(seconds: float) -> float:
    return round(seconds * 1000, 1)


def pct(values: list[float], q: float) -> float:
    """Percentile q (0..100), linear interpolation between closest ranks."""
    v = sorted(values)
    if len(v) == 1:
        return v[0]
    k = (len(v) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)
