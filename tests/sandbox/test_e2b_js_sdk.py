"""The official E2B JS SDK (npm ``e2b``, Node.js 20) quickstart against a real node.

It differs from the Python SDK in ways the node must handle: chunked request
bodies without Content-Length, WatchDir as a server stream, and error codes
read from the JSON body rather than the HTTP status.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.vm

JS_DIR = Path(os.environ.get("E2B_JS_SDK_DIR") or Path(__file__).resolve().parents[1] / "js")


def test_js_sdk_quickstart(node) -> None:
    assert shutil.which("node"), "Node.js 20 is needed"
    assert (JS_DIR / "node_modules" / "e2b").is_dir(), "run scripts/setup.sh (installs the E2B JS SDK)"
    script = JS_DIR / "aenv_quickstart.mjs"
    shutil.copy(Path(__file__).parent / "js" / "quickstart.mjs", script)
    try:
        r = subprocess.run(["node", str(script)], capture_output=True, text=True, timeout=300,
                           cwd=JS_DIR, env={**os.environ, **node.sdk_env()})
    finally:
        script.unlink()
    assert r.returncode == 0, r.stderr[-3000:]
    results = {row[0]: row[1:] for row in json.loads(r.stdout.strip().splitlines()[-1])}
    assert results["run"] == [0, "hi yes\n"]
    assert results["read"] == ["written by the js sdk"]
    assert results["big"] == [True]
    assert results["watch"] == [True]
    assert results["list"] == [True]
    assert results["connect-missing"][0] is True, results["connect-missing"]
    assert results["kill"] == [True]
    assert results["killed-listed"] == [False]
