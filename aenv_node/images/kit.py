"""The guest kit: kernel, initramfs and tools drive shared by every sandbox on a node.

Everything comes from Debian packages (downloaded with the host's apt, unpacked with ``dpkg-deb -x``, never
installed), so the kit needs no compiler and follows Debian's security updates:

- ``vmlinuz``: Debian's cloud kernel (``linux-image-cloud-amd64`` resolved to its versioned package), booted by
  QEMU; ``vmlinux``: the ELF kernel extracted from it (:mod:`.bzimage`), booted by Firecracker.
- ``initramfs.cpio.zst``: busybox-static, the virtio (and a few other) kernel modules in dependency order, and
  ``/init`` (``data/initramfs-init.sh``), which mounts ``/dev/vda`` as root and the tools drive read-only at
  ``/opt/aenv``, configures eth0 and switches root into our minimal init or the image's own.
- ``tools.ext4``: a read-only ext4 image mounted at ``/opt/aenv`` in every guest: a self-contained Python 3.11
  (Debian's, with its own ``ld-linux`` and the closure of the shared libraries it needs, launched by
  ``bin/python`` through that loader, so it runs on any guest distro), ``envd`` (the ``aenv_node/guest``
  folder as a top-level package) and its pure-Python dependencies (``requirements.txt``, as wheels from PyPI),
  all byte-compiled, plus busybox and the minimal init (``data/aenv-init.sh``) so the guest image needs nothing.

The kit lives in ``<state-dir>/kit/<hash>/``; the hash covers every input (package versions, the spec, the
init scripts, the envd sources and requirements, and this package's build code: every ``*.py`` module of
``aenv_node/images``), so a kit is rebuilt exactly when one of them changes. Builds happen in a temporary
directory renamed into place when complete (see :mod:`.cache`).

This module is the kit's face and its cache: :class:`Kit`, :func:`ensure_kit`, :func:`kit_hash` and
:func:`remove_other_kits`.  What goes into a kit is :mod:`.kit_spec`, how it is built :mod:`.kit_build`, how it
is booted :mod:`.cmdline` (re-exported here).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from . import cache, debs
from .cmdline import DEFAULT_GATEWAY_IP, DEFAULT_GUEST_IP, host_tsc_khz, kernel_cmdline
from .kit_build import Progress, build_kit
from .kit_spec import KIT_FORMAT, KitSpec

__all__ = [
    "DEFAULT_GATEWAY_IP",
    "DEFAULT_GUEST_IP",
    "ENVD_PORT",
    "ENVD_READY_MARKER",
    "Kit",
    "KitSpec",
    "ensure_kit",
    "host_tsc_khz",
    "kernel_cmdline",
    "kit_hash",
    "remove_other_kits",
]

_PACKAGE_DIR = Path(__file__).resolve().parent
_DATA_DIR = _PACKAGE_DIR / "data"

ENVD_PORT = 49983
ENVD_READY_MARKER = "aenv: envd ready"
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class Kit:
    """A built guest kit (all paths exist)."""

    hash: str
    root: Path
    kernel_version: str
    vmlinuz: Path
    vmlinux: Path
    initramfs: Path
    tools_img: Path
    manifest: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def load(cls, root: Path) -> Kit:
        manifest = json.loads((root / MANIFEST).read_text())
        return cls(
            hash=manifest["hash"],
            root=root,
            kernel_version=manifest["kernel_version"],
            vmlinuz=root / "vmlinuz",
            vmlinux=root / "vmlinux",
            initramfs=root / manifest["initramfs"],
            tools_img=root / "tools.ext4",
            manifest=manifest,
        )


# --------------------------------------------------------------------------------------------- hashing


def _code_files() -> list[Path]:
    """The build code a kit's hash covers: every module of this package (a glob, not a list of names, so a
    module added to the build is covered without a change here) and every file in ``data/``."""
    return sorted(p for p in _PACKAGE_DIR.glob("*.py")) + sorted(_DATA_DIR.glob("*"))


def kit_hash(spec: KitSpec, versions: dict[str, str]) -> str:
    """Hash of every input of a kit: spec, resolved package versions, scripts, envd sources, build code."""
    h = cache.InputHasher("aenv-guest-kit")
    h.add_text("format", str(KIT_FORMAT))
    spec_fields = {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(spec).items()}
    spec_fields.pop("guest_dir")  # the location does not matter, its contents do
    h.add_text("spec", json.dumps(spec_fields, sort_keys=True))
    h.add_text("versions", json.dumps(versions, sort_keys=True))
    for path in _code_files():
        h.add_file(f"code/{path.relative_to(_PACKAGE_DIR).as_posix()}", path)
    h.add_tree("guest", spec.guest_dir)
    return h.hexdigest()


def _resolve(spec: KitSpec) -> tuple[str, dict[str, str]]:
    kernel_pkg = debs.resolve_kernel_package(spec.kernel_package)
    packages = [kernel_pkg, spec.busybox_package, *spec.python_packages]
    return kernel_pkg, debs.resolve_versions(packages)


# --------------------------------------------------------------------------------------------- public API


def ensure_kit(state_dir: Path, spec: KitSpec | None = None, *, progress: Progress | None = None) -> Kit:
    """Return the kit for ``spec`` from ``<state_dir>/kit/``, building it first if it is not there.

    Blocking (a build takes about a minute): call it from a thread in async code.
    """
    spec = spec or KitSpec()
    say = progress or (lambda _msg: None)
    kit_dir = Path(state_dir) / "kit"
    kernel_pkg, versions = _resolve(spec)
    digest = kit_hash(spec, versions)
    final = kit_dir / digest
    if (final / MANIFEST).is_file():
        return Kit.load(final)
    with cache.build_lock(kit_dir):
        if (final / MANIFEST).is_file():  # another process built it while we waited
            return Kit.load(final)
        for stale in cache.remove_stale(kit_dir):
            say(f"removed leftover of an interrupted build: {stale.name}")
        with cache.staging_dir(kit_dir, digest) as tmp:
            say(f"building guest kit {digest} in {tmp}")
            out = tmp / "kit"
            out.mkdir()
            manifest = build_kit(spec, kernel_pkg, versions, digest, tmp, out, say)
            (out / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
            cache.publish(out, final)
    say(f"guest kit ready: {final}")
    return Kit.load(final)


def remove_other_kits(state_dir: Path, keep: Kit) -> list[Path]:
    """Delete every cached kit except ``keep`` (and leftovers of interrupted builds); returns what went.

    Only safe when no VM still uses an older kit's files.
    """
    kit_dir = Path(state_dir) / "kit"
    removed: list[Path] = []
    with cache.build_lock(kit_dir):
        removed += cache.remove_stale(kit_dir)
        for entry in kit_dir.iterdir():
            if entry.is_dir() and entry.name != keep.hash and (entry / MANIFEST).is_file():
                shutil.rmtree(entry)
                removed.append(entry)
    return removed
