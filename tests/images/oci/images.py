"""Test images made by real tools: ``umoci`` builds an OCI layout from small trees (busybox from the
busybox-static package, a few files), ``skopeo copy`` pushes its tags to registries (Docker v2s2 with gzip, OCI
with zstd). Indexes (manifest lists) are PUT through the Registry API, which is how a multi-platform image
reaches a registry anyway.

skopeo runs as ``nobody`` with ``HOME`` in the test's temp dir: as root it would create its blob-info cache in
``/var/lib/containers``, which the tests must not leave behind.
"""

from __future__ import annotations

import json
import os
import shutil
import ssl
import subprocess
from dataclasses import dataclass
from pathlib import Path

import httpx

from .servers import sha256_digest

NOBODY = 65534

OCI_INDEX = "application/vnd.oci.image.index.v1+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
ACCEPT = ", ".join((
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
    OCI_INDEX,
    DOCKER_LIST,
))

# what the v1 image holds, layer by layer (base first), for the tests' checks
GREETING = b"hello from layer two\n"
DATA_SIZE = 384 * 1024  # incompressible, so its layer is a real download


def _run(*argv: str | Path, env: dict[str, str] | None = None) -> None:
    proc = subprocess.run([str(a) for a in argv], capture_output=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{argv[0]} failed ({proc.returncode}): {proc.stderr.decode(errors='replace')}")


@dataclass
class Images:
    """The OCI layout and the directory skopeo runs in."""

    workdir: Path
    layout: Path
    data: bytes  # /app/data.bin of v1
    single_data: bytes  # /srv/data.bin of the one-layer image "single"

    def skopeo_copy(self, source_tag: str, dest: str, *flags: str) -> None:
        """``skopeo copy oci:<layout>:<tag> docker://<dest>`` (plain HTTP or unverified TLS) as nobody.

        A tag ``zstd:<tag>`` is taken from the zstd layout, digests preserved (skopeo would otherwise reuse
        the gzip blobs it already pushed for the same content).
        """
        if source_tag.startswith("zstd:"):
            source = f"oci:{self.layout}-zstd:{source_tag.removeprefix('zstd:')}"
            flags = (*flags, "--preserve-digests")
        else:
            source = f"oci:{self.layout}:{source_tag}"
        _skopeo(self.workdir, "copy", "-q", "--dest-tls-verify=false", *flags, source, f"docker://{dest}")


def _skopeo(workdir: Path, *args: str) -> None:
    home = workdir / "skopeo-home"
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": str(home),
           "XDG_RUNTIME_DIR": str(home / "run"), "XDG_DATA_HOME": str(home / "share")}
    _run("setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--",
         "skopeo", "--insecure-policy", *args, env=env)


def build_images(workdir: Path) -> Images:
    """An OCI layout with tags ``v1`` (4 layers and a full config), ``v2`` (v1 plus a layer), ``amd64`` and
    ``arm64`` (one layer each, for indexes) and ``single`` (one layer of random data).

    Layers are made with ``umoci unpack`` + ``repack --refresh-bundle`` (each repack is one layer: what changed
    in the bundle). Not ``umoci insert``: umoci 0.4.7 writes its layers without the tar end-of-archive blocks
    (and without the last file's padding), which Go's tar reader tolerates and Python's ``tarfile`` does not.
    """
    layout = workdir / "layout"
    data = os.urandom(DATA_SIZE)
    single_data = os.urandom(128 * 1024)

    def layers(tag: str, steps: list[dict[str, bytes | str]]) -> None:
        """One repacked layer per step: path -> bytes (a file) or str (a symlink target)."""
        bundle = workdir / f"bundle-{tag}"
        _run("umoci", "unpack", "--image", f"{layout}:{tag}", bundle)
        for files in steps:
            for rel, content in files.items():
                path = bundle / "rootfs" / rel
                path.parent.mkdir(parents=True, exist_ok=True)
                if isinstance(content, str):
                    path.symlink_to(content)
                else:
                    path.write_bytes(content)
                    path.chmod(0o755 if rel.startswith("bin/") else 0o644)
            _run("umoci", "repack", "--refresh-bundle", "--image", f"{layout}:{tag}", bundle)
        shutil.rmtree(bundle)

    _run("umoci", "init", "--layout", layout)
    _run("umoci", "new", "--image", f"{layout}:v1")
    layers("v1", [
        {"bin/busybox": Path("/bin/busybox").read_bytes(), "bin/sh": "busybox"},
        {"etc/greeting": GREETING},
        {"app/data.bin": data},
        {"app/conf/config.json": b'{"answer": 42}\n'},
    ])
    _run("umoci", "config", "--image", f"{layout}:v1", "--config.env", "FOO=bar", "--config.env",
         "PATH=/bin:/usr/bin", "--config.workingdir", "/app", "--config.user", "1000:1000",
         "--config.entrypoint", "/bin/busybox", "--config.entrypoint", "sh",
         "--config.cmd", "-c", "--config.cmd", "echo hi")
    _run("umoci", "tag", "--image", f"{layout}:v1", "v2")
    layers("v2", [{"etc/version": b"2\n"}])
    for arch in ("amd64", "arm64"):
        _run("umoci", "new", "--image", f"{layout}:{arch}")
        layers(arch, [{"etc/arch": arch.encode()}])
        _run("umoci", "config", "--image", f"{layout}:{arch}", "--architecture", arch, "--os", "linux")
    _run("umoci", "new", "--image", f"{layout}:single")
    layers("single", [{"srv/data.bin": single_data}])

    # skopeo runs as nobody: it must read the layout and write its cache under the work dir
    workdir.chmod(0o755)
    (workdir / "skopeo-home" / "run").mkdir(parents=True)
    _run("chown", "-R", f"{NOBODY}:{NOBODY}", workdir)
    _skopeo(workdir, "copy", "-q", "--dest-compress", "--dest-compress-format", "zstd", f"oci:{layout}:v1",
            f"oci:{layout}-zstd:v1")
    return Images(workdir, layout, data, single_data)


def manifest_of(host: str, repo: str, ref: str, *, verify: bool | ssl.SSLContext = True,
                auth: tuple[str, str] | None = None, scheme: str = "http") -> tuple[bytes, str, str]:
    """(bytes, media type, digest) of a manifest as the registry serves it."""
    response = httpx.get(f"{scheme}://{host}/v2/{repo}/manifests/{ref}", headers={"Accept": ACCEPT},
                         verify=verify, auth=auth)
    response.raise_for_status()
    return response.content, response.headers["content-type"], sha256_digest(response.content)


def push_blob(host: str, repo: str, data: bytes) -> str:
    """A monolithic blob upload (POST, then PUT with the digest); returns the digest."""
    digest = sha256_digest(data)
    started = httpx.post(f"http://{host}/v2/{repo}/blobs/uploads/")
    if started.status_code != 202:
        raise RuntimeError(f"upload POST failed: {started.status_code} {started.text}")
    location = httpx.URL(f"http://{host}").join(started.headers["location"])
    done = httpx.put(location.copy_merge_params({"digest": digest}), content=data,
                     headers={"Content-Type": "application/octet-stream"})
    if done.status_code != 201:
        raise RuntimeError(f"upload PUT failed: {done.status_code} {done.text}")
    return digest


def push_manifest(host: str, repo: str, tag: str, doc: dict[str, object], media_type: str) -> str:
    """PUT a manifest or index as ``repo:tag``; returns its digest."""
    body = json.dumps(doc).encode()
    response = httpx.put(f"http://{host}/v2/{repo}/manifests/{tag}", content=body,
                         headers={"Content-Type": media_type})
    if response.status_code != 201:
        raise RuntimeError(f"manifest PUT failed: {response.status_code} {response.text}")
    return sha256_digest(body)


def push_index(host: str, repo: str, tag: str, entries: list[tuple[str, dict[str, str]]], *,
               media_type: str = OCI_INDEX) -> str:
    """PUT an index of ``entries`` (a tag or digest already in ``repo``, its platform) as ``repo:tag``;
    returns the index digest."""
    manifests = []
    for ref, platform in entries:
        data, child_type, digest = manifest_of(host, repo, ref)
        manifests.append({"mediaType": child_type, "digest": digest, "size": len(data), "platform": platform})
    return push_manifest(host, repo, tag, {"schemaVersion": 2, "mediaType": media_type, "manifests": manifests},
                         media_type)
