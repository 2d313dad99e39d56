"""bench/proxy_overhead.py --smoke: the bench runs, nginx included, and all three paths answer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_proxy_overhead_bench_smoke(tmp_path: Path) -> None:
    out = tmp_path / "proxy_overhead.json"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "proxy_overhead.py"), "--smoke"],
                         env={**os.environ, "PYTHONPATH": str(ROOT), "AENV_BENCH_RESULTS": str(tmp_path)},
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    for name in ("direct", "nginx", "proxy"):
        assert result[name]["unary_1k_p50_ms"] > 0 and result[name]["download_1m_mib_per_s"] > 0
        assert result[name]["requests"]["concurrent"] >= 64
    assert result["smoke"] and set(result["ratios"]) == {"proxy_over_nginx", "proxy_over_direct", "nginx_over_direct"}
