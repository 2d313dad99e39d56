"""Where a bench writes its JSON: ``bench/results/<name>.json``, or ``$AENV_BENCH_RESULTS/<name>.json`` when that
is set. ``bench/run --smoke`` points it at a directory of its own, so a tiny run never replaces the figures
docs/benchmarks.md quotes."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def results_dir(*, smoke: bool = False) -> Path:
    """``$AENV_BENCH_RESULTS``; else bench/results, or for a ``--smoke`` run a directory under the system's
    temporary one."""
    env = os.environ.get("AENV_BENCH_RESULTS")
    d = Path(env) if env else Path(tempfile.gettempdir()) / "aenv-bench-smoke" if smoke else RESULTS
    d.mkdir(parents=True, exist_ok=True)
    return d


def result_path(name: str, suffix: str = ".json", *, smoke: bool = False) -> Path:
    """The file a bench named ``name`` writes its results to."""
    return results_dir(smoke=smoke) / f"{name}{suffix}"
