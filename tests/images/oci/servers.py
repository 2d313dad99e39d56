"""Real servers for the OCI pull tests, all on 127.0.0.1: Debian's docker-registry (distribution 2.8) processes,
a JWT token server for its ``auth.token`` mode, and a small registry front that redirects blobs to another host.

Every server is started by a fixture and stopped by it (registry processes killed by PID, threads shut down).
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import json
import re
import secrets
import socket
import subprocess
import threading
import time
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from cryptography.x509.oid import NameOID

from tests.conftest import free_port

REGISTRY_BIN = "/usr/bin/docker-registry"
_ACCESS_RE = re.compile(r'"(?P<method>[A-Z]+) (?P<uri>\S+) HTTP/[0-9.]+" (?P<status>\d{3}) (?P<bytes>\d+|-)')


@dataclass(frozen=True)
class Access:
    method: str
    uri: str
    status: int
    bytes: int


@dataclass
class Registry:
    """A running docker-registry: ``host`` is ``127.0.0.1:<port>``; its stdout/stderr (with the access log)
    go to ``log_path``."""

    host: str
    root: Path
    log_path: Path
    proc: subprocess.Popen[bytes]
    tls: bool = False

    def log_mark(self) -> int:
        return self.log_path.stat().st_size

    def accesses(self, since: int = 0) -> list[Access]:
        """The access log lines written since ``since`` (a :meth:`log_mark`), once the registry has logged every
        request answered before this call: the registry writes a line after its answer is sent, so a client
        can be done before its line is there (CI saw an empty list). A marker request is sent and waited for;
        it is left out of the result."""
        marker = f"/v2/?aenv-log-marker={secrets.token_hex(8)}"
        scheme = "https" if self.tls else "http"
        httpx.get(f"{scheme}://{self.host}{marker}", verify=False, timeout=10)
        deadline = time.monotonic() + 10
        while True:
            with open(self.log_path, "rb") as f:
                f.seek(since)
                text = f.read().decode(errors="replace")
            found = [m for m in _ACCESS_RE.finditer(text)]
            if any(m.group("uri") == marker for m in found) or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        out = []
        for m in found:
            if m.group("uri") == marker:
                continue
            written = m.group("bytes")
            out.append(Access(m.group("method"), m.group("uri"), int(m.group("status")),
                              0 if written == "-" else int(written)))
        return out

    def blob_data(self, digest: str) -> Path:
        """Where the registry keeps a blob's bytes (the filesystem driver's layout)."""
        hexdigest = digest.removeprefix("sha256:")
        return self.root / "docker/registry/v2/blobs/sha256" / hexdigest[:2] / hexdigest / "data"


def _wait_listening(host: str, proc: subprocess.Popen[bytes], log_path: Path, timeout: float = 10.0) -> None:
    address, port = host.rsplit(":", 1)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"docker-registry exited ({proc.returncode}): {log_path.read_text()[-2000:]}")
        try:
            with socket.create_connection((address, int(port)), timeout=0.2):
                return
        except OSError:
            time.sleep(0.02)
    raise RuntimeError(f"docker-registry did not listen on {host}: {log_path.read_text()[-2000:]}")


def start_registry(
    workdir: Path,
    *,
    auth: Mapping[str, object] | None = None,
    tls: tuple[Path, Path] | None = None,
    extra: Mapping[str, object] | None = None,
) -> Registry:
    """A docker-registry in ``workdir`` (storage, config, log) on a free loopback port; ``extra`` adds
    top-level config sections. The config is written as JSON, which is YAML too.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    host = f"127.0.0.1:{free_port()}"
    http: dict[str, object] = {"addr": host, "secret": secrets.token_hex(16)}
    if tls is not None:
        http["tls"] = {"certificate": str(tls[0]), "key": str(tls[1])}
    config: dict[str, object] = {
        "version": "0.1",
        "log": {"level": "warn", "accesslog": {"disabled": False}},
        "storage": {"filesystem": {"rootdirectory": str(workdir / "storage")}, "delete": {"enabled": True}},
        "http": http,
    }
    if auth is not None:
        config["auth"] = dict(auth)
    config.update(extra or {})
    (workdir / "config.yml").write_text(json.dumps(config))
    log_path = workdir / "registry.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([REGISTRY_BIN, "serve", str(workdir / "config.yml")], stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        _wait_listening(host, proc, log_path)
    except BaseException:
        stop_registry_process(proc)
        raise
    return Registry(host, workdir / "storage", log_path, proc, tls=tls is not None)


def stop_registry_process(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()  # by PID: Popen.kill signals exactly this child
    proc.wait(timeout=10)


# -- certificates and tokens ------------------------------------------------------------------------------------


def self_signed(workdir: Path, common_name: str = "127.0.0.1") -> tuple[Path, Path, rsa.RSAPrivateKey]:
    """A self-signed certificate for 127.0.0.1 (serving TLS, or signing tokens): (cert.pem, key.pem, key)."""
    import ipaddress

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = dt.datetime.now(dt.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                       critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    workdir.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = workdir / "cert.pem", workdir / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL,
                                           serialization.NoEncryption()))
    return cert_path, key_path, key


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


@dataclass
class TokenServer:
    """The token endpoint of distribution's ``auth.token`` mode: Basic credentials in, an RS256 JWT out.

    Valid credentials get every action asked for; anonymous requests get a token granting nothing (as Docker
    Hub gives for a private repository); wrong credentials get 401 with a message. ``requests`` counts calls.
    """

    users: dict[str, str]
    service: str
    issuer: str
    cert_path: Path
    key: rsa.RSAPrivateKey
    requests: list[dict[str, list[str]]] = field(default_factory=list)
    server: ThreadingHTTPServer | None = None
    thread: threading.Thread | None = None

    @property
    def realm(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.server_address[1]}/token"

    def _jwt(self, subject: str, scopes: list[str]) -> str:
        access = []
        for scope in scopes:
            kind, _, rest = scope.partition(":")
            name, _, actions = rest.rpartition(":")
            access.append({"type": kind, "name": name, "actions": actions.split(",")})
        cert = x509.load_pem_x509_certificate(self.cert_path.read_bytes())
        header = {"typ": "JWT", "alg": "RS256",
                  "x5c": [base64.b64encode(cert.public_bytes(serialization.Encoding.DER)).decode("ascii")]}
        now = int(time.time())
        claims = {"iss": self.issuer, "sub": subject, "aud": self.service, "exp": now + 300, "nbf": now - 30,
                  "iat": now, "jti": secrets.token_hex(8), "access": access}
        signing_input = f"{_b64url(json.dumps(header).encode())}.{_b64url(json.dumps(claims).encode())}"
        signature = self.key.sign(signing_input.encode(), padding.PKCS1v15(), hashes.SHA256())
        return f"{signing_input}.{_b64url(signature)}"

    def start(self) -> None:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: object) -> None:
                pass

            def _reply(self, status: int, doc: dict[str, object]) -> None:
                body = json.dumps(doc).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                url = urllib.parse.urlsplit(self.path)
                query = urllib.parse.parse_qs(url.query)
                outer.requests.append(query)
                scopes = [s for value in query.get("scope", []) for s in value.split(" ") if s]
                header = self.headers.get("Authorization", "")
                subject = ""
                if header.startswith("Basic "):
                    user, _, password = base64.b64decode(header[6:]).decode().partition(":")
                    if outer.users.get(user) != password:
                        self._reply(401, {"details": "incorrect username or password"})
                        return
                    subject = user
                else:
                    scopes = []  # anonymous: a valid token that grants nothing
                token = outer._jwt(subject, scopes)
                self._reply(200, {"token": token, "access_token": token, "expires_in": 300})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), name="token-server",
                                       daemon=True)
        self.thread.start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
        if self.thread is not None:
            self.thread.join(timeout=10)


# -- a registry front that sends blobs elsewhere ------------------------------------------------------------------


@dataclass
class RedirectingFront:
    """A minimal registry on 127.0.0.1 that wants Basic credentials, serves manifests from a real registry and
    redirects every blob GET to a storage server on ``localhost`` (another host), which ignores ``Range``
    (always 200 with the whole blob) and records the headers it was sent.
    """

    backend: Registry
    user: str
    password: str
    storage_headers: list[dict[str, str]] = field(default_factory=list)
    _servers: list[ThreadingHTTPServer] = field(default_factory=list)
    _threads: list[threading.Thread] = field(default_factory=list)

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self._servers[0].server_address[1]}"

    def _serve(self, handler: type[BaseHTTPRequestHandler]) -> int:
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        server.daemon_threads = True
        thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
        thread.start()
        self._servers.append(server)
        self._threads.append(thread)
        return int(server.server_address[1])

    def start(self) -> None:
        outer = self
        expected = "Basic " + base64.b64encode(f"{self.user}:{self.password}".encode()).decode()

        class Storage(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                outer.storage_headers.append({k.lower(): v for k, v in self.headers.items()})
                digest = self.path.rsplit("/", 1)[-1]
                data = outer.backend.blob_data(digest).read_bytes()
                self.send_response(200)  # Range ignored on purpose
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        storage_port = self._serve(Storage)

        class Front(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                if self.headers.get("Authorization") != expected:
                    body = b'{"errors":[{"code":"UNAUTHORIZED","message":"authentication required"}]}'
                    self.send_response(401)
                    self.send_header("WWW-Authenticate", 'Basic realm="front"')
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                if "/blobs/" in self.path:
                    digest = self.path.rsplit("/", 1)[-1]
                    self.send_response(307)
                    self.send_header("Location", f"http://localhost:{storage_port}/blobs/{digest}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                upstream = httpx.get(f"http://{outer.backend.host}{self.path}",
                                     headers={"Accept": self.headers.get("Accept", "")})
                self.send_response(upstream.status_code)
                for name in ("Content-Type", "Docker-Content-Digest"):
                    if name in upstream.headers:
                        self.send_header(name, upstream.headers[name])
                self.send_header("Content-Length", str(len(upstream.content)))
                self.end_headers()
                self.wfile.write(upstream.content)

        self._serve(Front)
        # the front must be the first server for .host
        self._servers.reverse()
        self._threads.reverse()

    def stop(self) -> None:
        for server in self._servers:
            server.shutdown()
            server.server_close()
        for thread in self._threads:
            thread.join(timeout=10)


def sha256_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()
