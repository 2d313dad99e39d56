"""Registry authentication: htpasswd (Basic) over TLS and token (Bearer) auth, against docker-registry."""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest

from aenv_node.images.oci import ImageNotFound, PulledImage, RegistryAuthError, RegistryUnreachable, pull
from aenv_node.images.oci.auth import Challenge, parse_www_authenticate

from .conftest import PASSWORD, USER, BearerRegistry, TlsRegistry
from .images import manifest_of


async def test_basic_auth_over_tls(basic_registry: TlsRegistry, store_dir: Path) -> None:
    reg = basic_registry.registry
    mark = reg.log_mark()
    image = await pull(f"{reg.host}/app:v1", store_dir=store_dir, registries=(), insecure_registries=(),
                       concurrency=4, credentials=(USER, PASSWORD), ca_bundle=basic_registry.ca_bundle)
    statuses = [a.status for a in reg.accesses(mark)]
    verify = ssl.create_default_context(cafile=str(basic_registry.ca_bundle))
    _, _, digest = manifest_of(reg.host, "app", "v1", scheme="https", verify=verify, auth=(USER, PASSWORD))
    assert image.digest == digest
    assert len(image.layers) == 4
    # after the first challenge the credentials go with every request: one 401 for the whole pull
    assert statuses.count(401) == 1 and len(statuses) == 1 + 1 + 1 + 4, statuses


async def test_basic_auth_wrong_password(basic_registry: TlsRegistry, store_dir: Path) -> None:
    reg = basic_registry.registry
    with pytest.raises(RegistryAuthError) as caught:
        await pull(f"{reg.host}/app:v1", store_dir=store_dir, registries=(), insecure_registries=(), concurrency=4,
                   credentials=(USER, "wrong"), ca_bundle=basic_registry.ca_bundle)
    message = str(caught.value)
    assert reg.host in message and repr(USER) in message and "authentication required" in message
    assert "wrong" not in message  # the password is never echoed

    with pytest.raises(RegistryAuthError, match="none were given"):
        await pull(f"{reg.host}/app:v1", store_dir=store_dir, registries=(), insecure_registries=(), concurrency=4,
                   ca_bundle=basic_registry.ca_bundle)
    assert not list(store_dir.rglob("*"))


async def test_tls_certificate_not_trusted_without_the_ca_bundle(basic_registry: TlsRegistry, store_dir: Path) -> None:
    reg = basic_registry.registry
    with pytest.raises(RegistryUnreachable, match="certificate") as caught:
        await pull(f"{reg.host}/app:v1", store_dir=store_dir, registries=(), insecure_registries=(), concurrency=4,
                   credentials=(USER, PASSWORD))
    assert reg.host in str(caught.value)


async def test_bearer_token_auth(bearer_registry: BearerRegistry, store_dir: Path) -> None:
    reg, tokens = bearer_registry.registry, bearer_registry.tokens
    tokens.requests.clear()
    mark = reg.log_mark()
    image: PulledImage = await pull(f"{reg.host}/app:v1", store_dir=store_dir, registries=(),
                                    insecure_registries=(reg.host,), concurrency=4, credentials=(USER, PASSWORD))
    assert len(image.layers) == 4
    # one token for the whole pull (manifest, config, 4 layers in parallel), asked for the right scope
    assert len(tokens.requests) == 1
    assert tokens.requests[0]["scope"] == ["repository:app:pull"]
    assert tokens.requests[0]["service"] == ["test-registry"]
    assert tokens.requests[0]["account"] == [USER]
    statuses = [a.status for a in reg.accesses(mark)]
    assert statuses.count(401) == 1, statuses


async def test_bearer_wrong_credentials(bearer_registry: BearerRegistry, store_dir: Path) -> None:
    reg = bearer_registry.registry
    with pytest.raises(RegistryAuthError) as caught:
        await pull(f"{reg.host}/app:v1", store_dir=store_dir, registries=(), insecure_registries=(reg.host,),
                   concurrency=4, credentials=(USER, "wrong"))
    message = str(caught.value)
    assert "incorrect username or password" in message and repr(USER) in message and "wrong" not in message


async def test_bearer_anonymous_denied_reads_as_not_found_or_private(
    bearer_registry: BearerRegistry, store_dir: Path
) -> None:
    """A token that grants nothing is what Docker Hub gives for a private or missing repository; it reads as
    "not found" (so a short name moves on to the next registry), and says credentials may be needed."""
    reg = bearer_registry.registry
    with pytest.raises(ImageNotFound, match="needs credentials"):
        await pull(f"{reg.host}/app:v1", store_dir=store_dir, registries=(), insecure_registries=(reg.host,),
                   concurrency=4)


def test_parse_www_authenticate() -> None:
    assert parse_www_authenticate(['Bearer realm="https://auth.docker.io/token",service="registry.docker.io",'
                                   'scope="repository:library/ubuntu:pull"']) == [
        Challenge("bearer", {"realm": "https://auth.docker.io/token", "service": "registry.docker.io",
                             "scope": "repository:library/ubuntu:pull"})]
    assert parse_www_authenticate(['Basic realm="basic-realm"']) == [Challenge("basic", {"realm": "basic-realm"})]
    # several challenges in one value, spaces, a bare token value, an escaped quote, a scope with two actions
    assert parse_www_authenticate(['Basic realm="a \\"b\\"", Bearer  realm = "https://t/x" , error=invalid_token,'
                                   ' scope="repository:a/b:pull,push"']) == [
        Challenge("basic", {"realm": 'a "b"'}),
        Challenge("bearer", {"realm": "https://t/x", "error": "invalid_token", "scope": "repository:a/b:pull,push"}),
    ]
    assert parse_www_authenticate(["", "Negotiate"]) == [Challenge("negotiate", {})]
