"""Resolve, download and unpack Debian packages with the host's apt (no dpkg database, no installation).

The guest kit is assembled from Debian's binaries (kernel, busybox, Python and its libraries) so it gets
Debian's security updates and needs no compiler. ``apt-cache show`` pins each package to the candidate version
the host's apt lists offer (those versions feed the kit's content hash), ``apt-get download`` fetches exactly
those versions (apt verifies them against the signed indexes), and ``dpkg-deb -x`` unpacks them into a work
directory.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Sequence
from pathlib import Path

from .errors import PackageError, ToolMissingError

__all__ = ["download", "extract", "resolve_kernel_package", "resolve_versions"]

_APT_OPTS = ["-o", "APT::Sandbox::User=root", "-q"]


def _run(cmd: Sequence[str], *, cwd: Path | None = None) -> str:
    try:
        proc = subprocess.run(list(cmd), cwd=cwd, capture_output=True, text=True, check=False)
    except FileNotFoundError as e:
        raise ToolMissingError(f"{cmd[0]} is not installed (Debian package apt / dpkg)") from e
    if proc.returncode != 0:
        raise PackageError(f"`{' '.join(cmd)}` failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return proc.stdout


def _stanzas(text: str) -> list[dict[str, str]]:
    out = []
    for block in text.split("\n\n"):
        fields: dict[str, str] = {}
        key = None
        for line in block.splitlines():
            if line.startswith((" ", "\t")) and key:
                fields[key] += "\n" + line.strip()
            elif ":" in line:
                key, _, value = line.partition(":")
                fields[key] = value.strip()
        if fields.get("Package"):
            out.append(fields)
    return out


def resolve_versions(packages: Sequence[str]) -> dict[str, str]:
    """Candidate version of each package in the host's apt lists (``PackageError`` names missing ones)."""
    stanzas = _stanzas(_run(["apt-cache", "show", "--no-all-versions", *packages]))
    versions = {s["Package"]: s["Version"] for s in stanzas}
    missing = [p for p in packages if p not in versions]
    if missing:
        raise PackageError(
            f"apt knows no candidate for {', '.join(missing)}; run `apt-get update` (Debian bookworm lists needed)"
        )
    return {p: versions[p] for p in packages}


def resolve_kernel_package(meta_package: str) -> str:
    """The real, versioned kernel package a meta package depends on.

    ``linux-image-cloud-amd64`` -> ``linux-image-6.1.0-57-cloud-amd64``.
    """
    (stanza,) = _stanzas(_run(["apt-cache", "show", "--no-all-versions", meta_package]))[:1] or [{}]
    depends = stanza.get("Depends", "")
    for dep in depends.split(","):
        name = dep.strip().split(" ")[0]
        if re.fullmatch(r"linux-image-\d[\w.+-]*", name):
            return name
    if re.fullmatch(r"linux-image-\d[\w.+-]*", meta_package):
        return meta_package
    raise PackageError(f"cannot find the versioned kernel package behind {meta_package} (Depends: {depends!r})")


def download(versions: dict[str, str], dest: Path) -> dict[str, Path]:
    """Download ``name=version`` for every package into ``dest``; returns package -> .deb path."""
    dest.mkdir(parents=True, exist_ok=True)
    _run(["apt-get", *_APT_OPTS, "download", *(f"{p}={v}" for p, v in versions.items())], cwd=dest)
    files: dict[str, Path] = {}
    for deb in dest.glob("*.deb"):
        name = deb.name.split("_", 1)[0]
        if name in versions:
            files[name] = deb
    missing = [p for p in versions if p not in files]
    if missing:
        raise PackageError(f"apt-get download produced no .deb for {', '.join(missing)}")
    return files


def extract(deb: Path, root: Path) -> None:
    """Unpack a .deb's files into ``root`` (maintainer scripts are not run)."""
    root.mkdir(parents=True, exist_ok=True)
    _run(["dpkg-deb", "-x", str(deb), str(root)])
