"""Real S3-compatible HTTP servers for the storage tests, started as subprocesses.

* moto in server mode (``moto_endpoint``): the main test server; it implements every call the repository uses
  (including ListMultipartUploads, so tests can check that no upload is left pending).  It is started through
  moto_atomic.py, which makes moto's conditional writes atomic, as AWS's are.
* s3rver (``big_s3``), a file-backed Node server installed by scripts/setup.d/55-s3rver.sh: used for large
  objects, because moto copies the whole object on each ranged GET (about 1 s per GET at 1 GiB).  When s3rver is
  not installed, ``big_s3`` falls back to moto.

Tests talk to them over the wire with boto3 (no in-process mocking).  One server of each kind serves the whole
test session (modules that import the fixtures share it through a reference count) and is terminated by PID at
the end.  Each test gets its own bucket, so tests do not see each other's objects.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Iterator, NamedTuple

import pytest

ACCESS_KEY = "testing"
SECRET_KEY = "testing"
REGION = "us-east-1"


S3RVER = Path(sys.prefix) / "s3rver" / "node_modules" / ".bin" / "s3rver"
S3RVER_KEY = "S3RVER"  # s3rver's built-in credentials


class MotoServer:
    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.endpoint = ""
        self.refs = 0
        self.lock = threading.Lock()
        self.data_dir: str | None = None

    def command(self, port: int) -> list[str]:
        # moto's own app, with its conditional writes made atomic as on AWS (see moto_atomic.py for why).
        return [sys.executable, str(Path(__file__).with_name("moto_atomic.py")), "127.0.0.1", str(port)]

    def start(self) -> str:
        with self.lock:
            self.refs += 1
            if self.proc is not None:
                return self.endpoint
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            env = dict(os.environ, AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY)
            try:
                self.proc = subprocess.Popen(
                    self.command(port),
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    env=env,
                )
            except BaseException:
                self.refs -= 1
                self._kill()  # removes a data directory made for it
                raise
            self.endpoint = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 30
            while True:
                if self.proc.poll() is not None:
                    code, name = self.proc.returncode, self.command(port)[0]
                    self.refs -= 1
                    self._kill()
                    raise RuntimeError(f"{name} exited with {code}")
                try:
                    with socket.create_connection(("127.0.0.1", port), timeout=1):
                        break
                except OSError:
                    if time.monotonic() > deadline:
                        self.refs -= 1
                        self._kill()
                        raise RuntimeError(f"{self.command(port)[0]} did not answer within 30 s") from None
                    time.sleep(0.1)
            return self.endpoint

    def _kill(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None
        if self.data_dir is not None:
            shutil.rmtree(self.data_dir, ignore_errors=True)
            self.data_dir = None

    def release(self) -> None:
        with self.lock:
            self.refs -= 1
            if self.refs == 0:
                self._kill()


class S3rverServer(MotoServer):
    def command(self, port: int) -> list[str]:
        if self.data_dir is None:
            self.data_dir = tempfile.mkdtemp(prefix="s3rver-")
        return [str(S3RVER), "-d", self.data_dir, "-a", "127.0.0.1", "-p", str(port), "-s", "--no-vhost-buckets"]


_SERVER = MotoServer()
_S3RVER = S3rverServer()


class S3Endpoint(NamedTuple):
    kind: str  # "s3rver" | "moto"
    endpoint: str
    access_key: str
    secret_key: str


@pytest.fixture(scope="session")
def big_s3() -> Iterator[S3Endpoint]:
    """An S3 server fit for large objects: s3rver if installed, else moto."""
    server, ep = (_S3RVER, ("s3rver", S3RVER_KEY, S3RVER_KEY)) if S3RVER.exists() else (
        _SERVER, ("moto", ACCESS_KEY, SECRET_KEY))
    endpoint = server.start()
    try:
        yield S3Endpoint(ep[0], endpoint, ep[1], ep[2])
    finally:
        server.release()


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    endpoint = _SERVER.start()
    try:
        yield endpoint
    finally:
        _SERVER.release()


def make_s3_repository(endpoint: "str | S3Endpoint", bucket: str | None = None, **options):  # type: ignore[no-untyped-def]
    """An ``S3Repository`` on a test server, in a fresh bucket (created)."""
    from aenv_node.storage.repository.s3 import S3Repository

    if isinstance(endpoint, S3Endpoint):
        url, key, secret = endpoint.endpoint, endpoint.access_key, endpoint.secret_key
    else:
        url, key, secret = endpoint, ACCESS_KEY, SECRET_KEY
    repo = S3Repository(
        bucket=bucket or f"t-{uuid.uuid4().hex[:16]}",
        region=REGION,
        endpoint_url=url,
        prefix=options.pop("prefix", "aenv/"),
        access_key_id=key,
        secret_access_key=secret,
        **options,
    )
    repo.ensure_bucket()
    return repo


def delete_bucket(repo) -> None:  # type: ignore[no-untyped-def]
    """Remove everything a test put in its bucket, then the bucket."""
    c = repo.client
    try:
        uploads = repo.pending_uploads()
    except Exception:  # s3rver does not implement ListMultipartUploads
        uploads = []
    for u in uploads:
        c.abort_multipart_upload(Bucket=repo.bucket, Key=u["Key"], UploadId=u["UploadId"])
    for page in c.get_paginator("list_objects_v2").paginate(Bucket=repo.bucket):
        for o in page.get("Contents", ()):
            c.delete_object(Bucket=repo.bucket, Key=o["Key"])
    c.delete_bucket(Bucket=repo.bucket)
    repo.close()
