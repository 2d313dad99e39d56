"""The client must install and run where the node cannot (macOS, arm64): `aenv` imports nothing Linux-only and
nothing of the node. A subprocess refuses those modules and runs `aenv --help` and every command's help."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REFUSED = ["fcntl", "termios", "tty", "pty", "pyroute2", "trio", "quart", "quart_trio", "hypercorn", "sqlalchemy",
           "alembic", "boto3", "numpy", "zstandard", "aenv_node.vmm", "aenv_node.storage", "aenv_node.runtime",
           "aenv_node.net", "aenv_node.state", "aenv_node.api", "aenv_node.images", "aenv_node.templates",
           "aenv_node.snapshot", "aenv_node.config", "aenv_node.guest", "e2b"]

SCRIPT = f"""
import sys
REFUSED = {REFUSED!r}

class Refuse:
    def find_spec(self, name, path=None, target=None):
        if any(name == r or name.startswith(r + ".") for r in REFUSED):
            raise ImportError(f"{{name}} is refused: the client must not need it")
        return None

sys.meta_path.insert(0, Refuse())
for name in list(sys.modules):
    if any(name == r or name.startswith(r + ".") for r in REFUSED):
        del sys.modules[name]

from aenv_node.cli.client import main
import aenv_node.cli.aenv.dockerfile, aenv_node.cli.aenv.build_progress, aenv_node.cli.aenv.shell  # noqa: F401
import aenv_node.cli.aenv.files, aenv_node.cli.aenv.execute, aenv_node.cli.aenv.events  # noqa: F401
main(sys.argv[1:])
"""

ROOT = Path(__file__).resolve().parents[2]


def _aenv(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", SCRIPT, *args], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=60)


def test_help_without_linux_only_modules() -> None:
    r = _aenv("--help")
    assert r.returncode == 0, r.stderr
    assert "Usage: aenv" in r.stdout and "snapshot" in r.stdout


def test_every_command_help_without_linux_only_modules() -> None:
    for path in (["start"], ["cn"], ["exec"], ["upload"], ["pull"], ["build"], ["template", "ls"], ["events"],
                 ["completion"]):
        r = _aenv(*path, "--help")
        assert r.returncode == 0, (path, r.stderr)


def test_completion_without_linux_only_modules() -> None:
    r = _aenv("completion", "zsh")
    assert r.returncode == 0 and "#compdef aenv" in r.stdout, r.stderr


def test_the_refusal_works() -> None:
    """The finder really refuses: importing the node's server side fails under it."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    code = SCRIPT.split("from aenv_node.cli.client")[0] + "import aenv_node.cli.node\n"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    assert r.returncode != 0 and "is refused" in r.stderr
