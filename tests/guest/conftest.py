"""Fixtures for envd tests: a throwaway Unix user and envd processes on loopback.

envd really runs (``python -m aenv_node.guest`` as a subprocess, as root, on a
free 127.0.0.1 port) and is driven over HTTP, by raw httpx and by the real E2B
SDK. The test user is created with ``useradd`` and removed with ``userdel -r``.
"""

from __future__ import annotations

import base64
import json
import os
import re
import secrets
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]

if os.geteuid() != 0:  # envd switches users and chowns files: it needs root
    pytest.skip("envd tests need root", allow_module_level=True)


@dataclass
class GuestUser:
    name: str
    uid: int
    gid: int
    home: str


@pytest.fixture(scope="session")
def test_user() -> Iterator[GuestUser]:
    name = "envdt" + secrets.token_hex(3)
    base = tempfile.mkdtemp(prefix="envd-home-")
    os.chmod(base, 0o755)
    home = os.path.join(base, name)
    subprocess.run(["useradd", "--create-home", "--home-dir", home, "--shell", "/bin/bash",
                    "--user-group", name], check=True, capture_output=True)
    try:
        import pwd

        entry = pwd.getpwnam(name)
        yield GuestUser(name=name, uid=entry.pw_uid, gid=entry.pw_gid, home=home)
    finally:
        subprocess.run(["userdel", "--remove", name], capture_output=True)
        shutil.rmtree(base, ignore_errors=True)


@dataclass
class EnvdProcess:
    url: str
    port: int
    proc: subprocess.Popen[bytes]
    log_path: str

    def client(self, **kwargs: object) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=30, **kwargs)  # type: ignore[arg-type]

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()


def start_envd(default_user: str, *extra: str) -> EnvdProcess:
    log = tempfile.NamedTemporaryFile(prefix="envd-", suffix=".log", delete=False)
    proc = subprocess.Popen(
        [sys.executable, "-m", "aenv_node.guest", "--host", "127.0.0.1", "--port", "0",
         "--default-user", default_user, "--no-set-clock", "--log-level", "DEBUG", *extra],
        cwd=str(ROOT), stdout=subprocess.DEVNULL, stderr=log, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    deadline = time.monotonic() + 20
    port = None
    while time.monotonic() < deadline:
        with open(log.name, errors="replace") as f:
            m = re.search(r"listening on 127\.0\.0\.1:(\d+)", f.read())
        if m:
            port = int(m.group(1))
            break
        if proc.poll() is not None:
            break
        time.sleep(0.02)
    if port is None:
        proc.kill()
        proc.wait()
        with open(log.name) as f:
            raise RuntimeError(f"envd did not start:\n{f.read()}")
    return EnvdProcess(url=f"http://127.0.0.1:{port}", port=port, proc=proc, log_path=log.name)


def stop_envd(envd: EnvdProcess) -> None:
    envd.proc.terminate()
    try:
        envd.proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        envd.proc.kill()
        envd.proc.wait()
    os.unlink(envd.log_path)


@pytest.fixture(scope="module")
def envd(test_user: GuestUser) -> Iterator[EnvdProcess]:
    """One envd shared by a module's tests (which must not change its /init state)."""
    server = start_envd(test_user.name)
    yield server
    stop_envd(server)


@pytest.fixture
def fresh_envd(test_user: GuestUser) -> Iterator[EnvdProcess]:
    """An envd of the test's own, free to /init with tokens and users."""
    server = start_envd(test_user.name)
    yield server
    stop_envd(server)


@pytest.fixture
def workdir(test_user: GuestUser) -> Iterator[str]:
    """A fresh directory owned by the test user, inside its home."""
    path = tempfile.mkdtemp(prefix="work-", dir=test_user.home)
    os.chown(path, test_user.uid, test_user.gid)
    yield path
    shutil.rmtree(path, ignore_errors=True)


# ----- Connect helpers ---------------------------------------------------------

def envelope(message: dict, flags: int = 0) -> bytes:
    payload = json.dumps(message).encode()
    return struct.pack(">BI", flags, len(payload)) + payload


def parse_envelopes(data: bytes) -> list[tuple[int, dict]]:
    out = []
    i = 0
    while i < len(data):
        flags, size = struct.unpack(">BI", data[i:i + 5])
        out.append((flags, json.loads(data[i + 5:i + 5 + size])))
        i += 5 + size
    assert i == len(data), "trailing bytes after the last envelope"
    return out


def iter_envelopes(response: httpx.Response) -> Iterator[tuple[int, dict]]:
    buf = b""
    for chunk in response.iter_raw():
        buf += chunk
        while len(buf) >= 5:
            flags, size = struct.unpack(">BI", buf[:5])
            if len(buf) < 5 + size:
                break
            yield flags, json.loads(buf[5:5 + size])
            buf = buf[5 + size:]


def rpc(client: httpx.Client, method: str, body: dict, **headers: str) -> httpx.Response:
    return client.post(f"/{method}", json=body, headers=headers)


def stream_rpc(client: httpx.Client, method: str, body: dict, **headers: str) -> list[tuple[int, dict]]:
    response = client.post(
        f"/{method}", content=envelope(body),
        headers={"content-type": "application/connect+json", **headers},
    )
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/connect+json"
    return parse_envelopes(response.content)


def run_process(client: httpx.Client, cmd: str, **extra: object) -> tuple[bytes, bytes, dict, list[dict]]:
    """Start ``bash -c cmd``; returns (stdout, stderr, end event, all messages)."""
    headers = extra.pop("headers", {})
    body = {"process": {"cmd": "/bin/bash", "args": ["-c", cmd], **extra.pop("process", {})}, **extra}
    messages = stream_rpc(client, "process.Process/Start", body, **headers)  # type: ignore[arg-type]
    out, err, end = b"", b"", {}
    for flags, msg in messages:
        if flags & 2:
            assert msg == {}, msg
            continue
        event = msg["event"]
        if "data" in event:
            out += base64.b64decode(event["data"].get("stdout", ""))
            err += base64.b64decode(event["data"].get("stderr", ""))
        if "end" in event:
            end = event["end"]
    return out, err, end, [m for _, m in messages]


def basic_auth(user: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:".encode()).decode()
