"""The E2B JS SDK against envd.

The set-up script installs the SDK into ``tests/js/node_modules`` (``E2B_JS_SDK_DIR``
overrides the directory); the script is ``js/sdk_check.mjs``. A missing SDK is a
failure, not a skip: CI must run this.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path


from .conftest import EnvdProcess, start_envd, stop_envd

SDK_DIR = os.environ.get("E2B_JS_SDK_DIR") or str(Path(__file__).resolve().parents[1] / "js")


def test_js_sdk_is_installed() -> None:
    assert shutil.which("node"), "Node.js is needed for the E2B JS SDK tests"
    assert (Path(SDK_DIR) / "node_modules" / "e2b").is_dir(), \
        f"no E2B JS SDK in {SDK_DIR}/node_modules: run scripts/setup.sh"


def test_js_sdk_roundtrip(tmp_path: Path) -> None:
    server: EnvdProcess = start_envd("root")
    try:
        script = Path(SDK_DIR) / "aenv_envd_check.mjs"
        shutil.copy(Path(__file__).parent / "js" / "sdk_check.mjs", script)
        try:
            out = subprocess.run(["node", str(script), server.url, str(tmp_path)], capture_output=True, text=True,
                                 timeout=60, cwd=SDK_DIR)
        finally:
            script.unlink()
    finally:
        stop_envd(server)
    assert out.returncode == 0, out.stderr
    results = dict((row[0], row[1:]) for row in json.loads(out.stdout.strip().splitlines()[-1]))
    assert results["run"] == [0, "js-hello\nroot\n"]
    assert results["exit"] == [4]
    assert results["read"] == ["from js"] and results["exists"] == [False] and results["mkdir"] == [True]
    assert results["kill"] == [True] and results["watch"] == [True] and results["pty"] == [True]
