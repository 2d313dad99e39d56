"""``bench/run --smoke``: every bench runs tiny, end to end, and writes its JSON; the plots draw from it.

It asserts no timing (the figures come from full runs, in docs/benchmarks.md): only that each bench ran, exited
0, and wrote parseable JSON the runner checked, and that the plots were drawn. Here, beside the VM tests,
because most benches boot guests: this package's pytest runs them one at a time."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from _run import BENCHES  # noqa: E402

pytestmark = pytest.mark.vm


def test_every_bench_runs_tiny_and_writes_its_json(tmp_path: Path) -> None:
    results = tmp_path / "results"
    run = subprocess.run([str(ROOT / "bench" / "run"), "--smoke", "--results", str(results)], cwd=ROOT,
                         capture_output=True, text=True, timeout=40 * 60)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    smoked = [b for b in BENCHES if b.smoke_by_default]
    for bench in smoked:
        for name in bench.outputs:
            doc = json.loads((results / name).read_text())
            assert isinstance(doc, dict) and doc, (bench.name, name)
    # the summary names every bench, ok
    summary = run.stdout.rsplit("bench                      s  result", 1)[1]
    assert {line.split()[0] for line in summary.splitlines()[1:] if line.strip() and "ok" in line.split()} >= {
        b.name for b in smoked}, summary
    drawn = {p.name for p in (results / "img").glob("*.png")}
    assert {"lifecycle.png", "soak.png", "create.png", "density.png"} <= drawn, drawn
