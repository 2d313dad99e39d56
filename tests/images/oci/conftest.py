"""Fixtures of the OCI pull tests: images built once per session, registries on loopback, a store per test.

Registries are Debian's docker-registry (distribution 2.8), each in its own directory under one session temp
dir: an anonymous one with every test image, an empty one, one with htpasswd (Basic) auth behind TLS with a
self-signed certificate, one with token (Bearer) auth and its token server, and per-test ones for tests that
damage a registry. Everything started here is stopped here (registry processes killed by PID), and the
session temp dir is removed.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

from .images import DOCKER_LIST, Images, build_images, push_index
from .servers import RedirectingFront, Registry, TokenServer, self_signed, start_registry, stop_registry_process

USER, PASSWORD = "alice", "s3cret-pw"


@contextlib.contextmanager
def running_registry(
    workdir: Path,
    *,
    auth: Mapping[str, object] | None = None,
    tls: tuple[Path, Path] | None = None,
    extra: Mapping[str, object] | None = None,
) -> Iterator[Registry]:
    registry = start_registry(workdir, auth=auth, tls=tls, extra=extra)
    try:
        yield registry
    finally:
        stop_registry_process(registry.proc)


@pytest.fixture(scope="session")
def oci_tmp() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="aenv-oci-tests-"))
    path.chmod(0o755)  # skopeo runs as nobody and reads the image layout below
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def images(oci_tmp: Path) -> Images:
    return build_images(oci_tmp / "images")


@pytest.fixture(scope="session")
def registry(oci_tmp: Path, images: Images) -> Iterator[Registry]:
    """Anonymous, plain HTTP: ``app:v1`` (Docker v2s2, gzip, 4 layers), ``app:v2`` (OCI), ``appz:v1`` (OCI,
    zstd), ``multi:v1`` (OCI index: linux/amd64 + linux/arm64), ``armonly:v1`` (Docker manifest list without
    amd64), ``single:v1`` (one layer). Foreign layers may point at example.invalid (distribution 2.8 refuses
    every foreign-layer URL unless a pattern allows it; the URL is never fetched)."""
    foreign_ok = {"validation": {"manifests": {"urls": {"allow": [r"^https://example\.invalid/"]}}}}
    with running_registry(oci_tmp / "registry", extra=foreign_ok) as reg:
        images.skopeo_copy("v1", f"{reg.host}/app:v1", "--format", "v2s2")
        images.skopeo_copy("v2", f"{reg.host}/app:v2")
        images.skopeo_copy("zstd:v1", f"{reg.host}/appz:v1")
        images.skopeo_copy("single", f"{reg.host}/single:v1")
        for arch in ("amd64", "arm64"):
            images.skopeo_copy(arch, f"{reg.host}/multi:{arch}")
        push_index(reg.host, "multi", "v1", [
            ("arm64", {"os": "linux", "architecture": "arm64", "variant": "v8"}),
            ("amd64", {"os": "linux", "architecture": "amd64"}),
        ])
        images.skopeo_copy("arm64", f"{reg.host}/armonly:arm64", "--format", "v2s2")
        push_index(reg.host, "armonly", "v1", [
            ("arm64", {"os": "linux", "architecture": "arm64", "variant": "v8"}),
            ("arm64", {"os": "linux", "architecture": "arm", "variant": "v7"}),
            ("arm64", {"os": "unknown", "architecture": "unknown"}),
        ], media_type=DOCKER_LIST)
        yield reg


@pytest.fixture(scope="session")
def empty_registry(oci_tmp: Path) -> Iterator[Registry]:
    with running_registry(oci_tmp / "empty-registry") as reg:
        yield reg


@pytest.fixture
def own_registry(oci_tmp: Path) -> Iterator[Registry]:
    """A registry for one test (one that damages its storage, say)."""
    workdir = Path(tempfile.mkdtemp(prefix="registry-", dir=oci_tmp))
    try:
        with running_registry(workdir) as reg:
            yield reg
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


@dataclass
class TlsRegistry:
    registry: Registry
    ca_bundle: Path


@pytest.fixture(scope="session")
def basic_registry(oci_tmp: Path, images: Images) -> Iterator[TlsRegistry]:
    """htpasswd (Basic) auth over TLS with a self-signed certificate (``ca_bundle`` trusts it); ``app:v1``."""
    workdir = oci_tmp / "basic-registry"
    cert, key, _ = self_signed(workdir / "tls")
    htpasswd = subprocess.run(["htpasswd", "-Bbn", USER, PASSWORD], capture_output=True, check=True).stdout
    (workdir / "htpasswd").write_bytes(htpasswd)
    auth = {"htpasswd": {"realm": "test-basic", "path": str(workdir / "htpasswd")}}
    with running_registry(workdir, auth=auth, tls=(cert, key)) as reg:
        images.skopeo_copy("v1", f"{reg.host}/app:v1", "--dest-creds", f"{USER}:{PASSWORD}")
        yield TlsRegistry(reg, cert)


@dataclass
class BearerRegistry:
    registry: Registry
    tokens: TokenServer


@pytest.fixture(scope="session")
def bearer_registry(oci_tmp: Path, images: Images) -> Iterator[BearerRegistry]:
    """Token (Bearer) auth, plain HTTP, with a token server signing RS256 JWTs; ``app:v1``."""
    workdir = oci_tmp / "bearer-registry"
    cert, _, key = self_signed(workdir / "token-signing", common_name="test token issuer")
    tokens = TokenServer(users={USER: PASSWORD}, service="test-registry", issuer="test-issuer", cert_path=cert,
                         key=key)
    tokens.start()
    try:
        auth = {"token": {"realm": tokens.realm, "service": tokens.service, "issuer": tokens.issuer,
                          "rootcertbundle": str(cert)}}
        with running_registry(workdir, auth=auth) as reg:
            images.skopeo_copy("v1", f"{reg.host}/app:v1", "--dest-creds", f"{USER}:{PASSWORD}")
            tokens.requests.clear()
            yield BearerRegistry(reg, tokens)
    finally:
        tokens.stop()


@pytest.fixture
def redirecting_front(registry: Registry) -> Iterator[RedirectingFront]:
    """A Basic-auth registry front over ``registry`` whose blobs redirect to storage on another host."""
    front = RedirectingFront(backend=registry, user=USER, password=PASSWORD)
    front.start()
    try:
        yield front
    finally:
        front.stop()


@pytest.fixture
def store_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="aenv-oci-store-") as path:
        yield Path(path)
