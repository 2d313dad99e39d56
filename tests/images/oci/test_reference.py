"""Parsing image references and resolving short names through the configured registries (no network)."""

from __future__ import annotations

import pytest

from aenv_node.images.oci import BadReference, ImageReference, parse_reference

DIGEST = "sha256:" + "0123456789abcdef" * 4


@pytest.mark.parametrize(("text", "expected"), [
    ("python", ImageReference(None, "python", "latest", None)),
    ("python:3.12-slim", ImageReference(None, "python", "3.12-slim", None)),
    ("library/python:3", ImageReference(None, "library/python", "3", None)),
    ("e2bdev/code-interpreter:latest", ImageReference(None, "e2bdev/code-interpreter", "latest", None)),
    ("docker.io/python", ImageReference("docker.io", "library/python", "latest", None)),
    ("index.docker.io/foo/bar:1", ImageReference("docker.io", "foo/bar", "1", None)),
    ("ghcr.io/owner/repo/sub:v1", ImageReference("ghcr.io", "owner/repo/sub", "v1", None)),
    ("localhost/app", ImageReference("localhost", "app", "latest", None)),
    ("localhost:5000/app:v1", ImageReference("localhost:5000", "app", "v1", None)),
    ("127.0.0.1:5000/a/b_c__d-e.f:T_1.x", ImageReference("127.0.0.1:5000", "a/b_c__d-e.f", "T_1.x", None)),
    ("[::1]:5000/app", ImageReference("[::1]:5000", "app", "latest", None)),
    ("Registry/app", ImageReference("Registry", "app", "latest", None)),  # upper case: a host
    (f"app@{DIGEST}", ImageReference(None, "app", None, DIGEST)),
    (f"quay.io/app:v1@{DIGEST}", ImageReference("quay.io", "app", "v1", DIGEST)),
])
def test_parse(text: str, expected: ImageReference) -> None:
    assert parse_reference(text) == expected


@pytest.mark.parametrize("text", [
    "", " python", "py thon", "Python", "python:", "python:-tag", "python:" + "t" * 129, "/python", "python/",
    "a//b", "ghcr.io/", "ghcr.io/Owner/repo", "python@sha256:abc", f"python@sha512:{'0' * 128}",
    f"python@{DIGEST.upper()}", "a..b", "-a", "a-", "host:port:x/app", "bad_host.io:99999999/app",
])
def test_malformed(text: str) -> None:
    with pytest.raises(BadReference) as caught:
        parse_reference(text)
    assert isinstance(caught.value, ValueError)
    assert "\n" not in str(caught.value)


def test_short_names_resolve_through_registries() -> None:
    ref = parse_reference("python:3.12")
    hub, mine = ref.candidates(["docker.io", "registry.example:5000"])
    assert (hub.registry, hub.repository, hub.endpoint) == ("docker.io", "library/python", "registry-1.docker.io")
    assert (mine.registry, mine.repository, mine.endpoint) == (
        "registry.example:5000", "python", "registry.example:5000")
    assert str(hub) == "docker.io/library/python:3.12"
    assert str(hub.with_digest(DIGEST)) == f"docker.io/library/python@{DIGEST}"
    # a two-component name is not an official image
    assert parse_reference("e2bdev/base").on("docker.io").repository == "e2bdev/base"
    # a qualified name ignores the list
    qualified = parse_reference("ghcr.io/a/b:1")
    assert qualified.candidates(["docker.io"]) == (qualified,)
    with pytest.raises(BadReference, match="images.registries"):
        ref.candidates([])
    with pytest.raises(BadReference):
        ref.on("not a host")


def test_manifest_ref() -> None:
    assert parse_reference("app").manifest_ref == "latest"
    assert parse_reference(f"app:v1@{DIGEST}").manifest_ref == DIGEST
