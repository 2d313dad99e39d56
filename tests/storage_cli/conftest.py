"""Helpers for the storage CLI tests: the CLI run as a real subprocess against a private state directory, a
small ext4 image made by mkfs.ext4, an ``image serve`` process, and qemu-io / qemu-img as the NBD clients."""

from __future__ import annotations

import hashlib
import os
import re
import select
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
IMAGE_SIZE = 8 * 1024 * 1024


def cli_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment without any AENV_* setting of the host, and no system config file."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AENV_")}
    env["AENV_CONFIG"] = os.devnull
    env.update(extra or {})
    return env


@dataclass
class Cli:
    state_dir: Path
    env: dict[str, str]

    def run(self, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        p = subprocess.run([sys.executable, "-m", "aenv_node.cli.node", *args, "--state-dir", str(self.state_dir)],
                           capture_output=True, text=True, env=self.env, timeout=timeout, check=False)
        if check:
            assert p.returncode == 0, (args, p.stdout, p.stderr)
        return p

    def fails(self, *args: str) -> str:
        """Run a command that must fail with exactly one line on stderr and no traceback; return that line."""
        p = self.run(*args, check=False)
        assert p.returncode != 0, (args, p.stdout, p.stderr)
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("Error: "), p.stderr
        assert "Traceback" not in p.stderr
        return lines[0]

    def import_layer(self, path: Path, *extra: str) -> str:
        out = self.run("layer", "import", str(path), *extra).stdout.strip().splitlines()
        assert len(out) == 1 and DIGEST_RE.match(out[0]), out
        return out[0]

    @property
    def repository(self) -> Path:
        return self.state_dir / "repository"

    def repo_files(self) -> list[Path]:
        """Every file under the repository's layers/ (complete layers and any leftover temp file)."""
        root = self.repository / "layers"
        return sorted(p for p in root.rglob("*") if p.is_file()) if root.exists() else []

    def layer_rows(self) -> dict[str, tuple]:
        db = self.state_dir / "aenv.db"
        if not db.exists():
            return {}
        with sqlite3.connect(db) as c:
            return {r[0]: r[1:] for r in c.execute(
                "select digest, kind, size_bytes, virtual_size_bytes, repository_key, refcount from layers")}

    def serve(self, *args: str) -> Server:
        return Server(self, list(args))


class Server:
    """``aenv-node image serve`` as a child process; ``uri`` once it printed it.  Terminated by PID on exit."""

    def __init__(self, cli: Cli, args: list[str]) -> None:
        self.cli = cli
        self.args = args
        self.proc: subprocess.Popen[str] | None = None
        self.uri = ""
        self.stderr = ""

    def __enter__(self) -> Server:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "aenv_node.cli.node", "image", "serve", *self.args,
             "--state-dir", str(self.cli.state_dir)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=self.cli.env)
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], 60)
        line = self.proc.stdout.readline().strip() if ready else ""
        if not line.startswith("nbd+unix://"):
            self.stop(signal.SIGKILL)
            raise AssertionError(f"image serve did not print a URI: {line!r}; stderr: {self.stderr}")
        self.uri = line
        return self

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            _, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        self.stderr += err or ""
        return self.proc.returncode

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.stop(signal.SIGKILL)


def tool(*argv: str) -> str:
    """Run qemu-io / qemu-img; fail on a non-zero exit or a failed pattern check (qemu-io exits 0 then)."""
    p = subprocess.run(list(argv), capture_output=True, text=True, timeout=120, check=False)
    out = p.stdout + p.stderr
    assert p.returncode == 0 and "failed" not in out.lower(), (argv, out)
    return out


def qemu_io(uri: str, *cmds: str, read_only: bool = False) -> str:
    argv = ["qemu-io", "-f", "raw", *(["-r"] if read_only else []), uri]
    for c in cmds:
        argv += ["-c", c]
    return tool(*argv)


def compare(uri: str, path: Path) -> None:
    out = tool("qemu-img", "compare", "-f", "raw", "-F", "raw", uri, str(path))
    assert "identical" in out, out


def sha256_file(path: Path) -> str:
    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def cli(tmp_path: Path) -> Cli:
    return Cli(tmp_path / "state", cli_env())


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    """A short directory for unix sockets (sun_path is limited to 108 bytes; tmp_path can be longer)."""
    d = tempfile.mkdtemp(prefix="aenv-cli-", dir="/tmp")
    try:
        yield Path(d)
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def ext4_image(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An 8 MiB ext4 filesystem image holding a few files (random data, so the layer has real extents)."""
    d = tmp_path_factory.mktemp("ext4")
    src = d / "src"
    (src / "etc").mkdir(parents=True)
    (src / "etc" / "hostname").write_text("aenv-test\n")
    (src / "blob.bin").write_bytes(os.urandom(700 * 1024))
    img = d / "disk.img"
    subprocess.run(["mkfs.ext4", "-q", "-F", "-d", str(src), str(img), f"{IMAGE_SIZE >> 20}M"], check=True,
                   capture_output=True)
    assert img.stat().st_size == IMAGE_SIZE
    return img


def wait_gone(path: Path, timeout: float = 5) -> bool:
    deadline = time.monotonic() + timeout
    while path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return not path.exists()
