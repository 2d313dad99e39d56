"""The KVM host's root filesystem, built on this machine from Debian packages and the project's wheels.

Nothing is fetched inside the VM (it has no route off the machine): debootstrap and ``apt-get download`` run here,
and ``pip download`` fetches the project's dependencies here as wheels, installed into a venv inside the tree with
``chroot ... pip install --no-index``.  The tree gets the Debian 6.12 backports cloud kernel's modules (KVM for
the nested guests, ublk_drv for the ublk block frontend) and the Firecracker binaries this host uses.

The image is cached as ``<cache>/kvmhost/kvmhost-<hash>.ext4``; the hash covers the spec, the dependency list of
``pyproject.toml``, the Firecracker binaries and this module's code.  The project's own code is *not* in it: it
goes on a small drive made from the working tree at each ``up`` (``vm.py``), so a code change costs seconds, not
a rebuild.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import shutil
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from aenv_node.images import cache, debs

REPO = Path(__file__).resolve().parents[2]
FIRECRACKER_DIR = Path("/opt/aenv/bin")
Progress = Callable[[str], None]



@dataclass(frozen=True)
class KvmHostSpec:
    """Inputs of the KVM host image; all of them are hashed."""

    suite: str = "bookworm"
    mirror: str = "http://deb.debian.org/debian"
    include: tuple[str, ...] = (
        "bash", "coreutils", "procps", "iproute2", "kmod", "ca-certificates", "util-linux", "e2fsprogs",
        "nftables", "iptables", "python3", "python3-venv", "sqlite3", "busybox", "qemu-system-x86", "qemu-utils",
        "psmisc", "strace", "conntrack",
    )
    kernel_meta: str = r"^linux-image-6\.12.*-cloud-amd64-unsigned$"
    size_mib: int = 6144
    revision: int = 1


def kernel_package(spec: KvmHostSpec) -> str:
    """The newest 6.12 cloud kernel apt offers (it has both the KVM modules and ublk_drv)."""
    out = subprocess.run(["apt-cache", "search", "--names-only", spec.kernel_meta],
                         capture_output=True, text=True, check=True).stdout
    names = [line.split(" ")[0] for line in out.splitlines() if line.strip()]
    if not names:
        raise RuntimeError(f"apt offers no package matching {spec.kernel_meta} (Debian bookworm-backports)")

    def key(name: str) -> list[int]:
        return [int(x) for x in name.replace("+", ".").replace("-", ".").split(".") if x.isdigit()]

    return sorted(names, key=key)[-1]


#: what the requirements need on the tree's Python (Debian 12's 3.11.2) but not on this host's: ``pip download``
#: evaluates environment markers with the interpreter that runs it, whatever ``--python-version`` says, so a
#: dependency behind ``python_full_version < "3.11.3"`` (redis's async-timeout) would be left out
GUEST_PYTHON_EXTRAS = ["async-timeout>=4.0.3"]


def dependencies() -> list[str]:
    """The node's runtime requirements, from pyproject.toml (what the venv inside must hold), and what they need
    on the tree's older Python."""
    data = tomllib.loads((REPO / "pyproject.toml").read_text())
    return [*data["project"]["dependencies"], *GUEST_PYTHON_EXTRAS]


def image_hash(spec: KvmHostSpec, kernel: str) -> str:
    h = cache.InputHasher("aenv-kvmhost")
    h.add_text("spec", json.dumps(dataclasses.asdict(spec), sort_keys=True))
    h.add_text("kernel", kernel)
    h.add_text("deps", json.dumps(dependencies()))
    h.add_text("code", inspect.getsource(sys.modules[__name__]))
    for name in ("firecracker", "jailer"):
        h.add_text(f"bin/{name}", _sha256(FIRECRACKER_DIR / name))
    return h.hexdigest()


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def ensure_image(cache_dir: Path, spec: KvmHostSpec | None = None, *, progress: Progress | None = None) -> Path:
    """Path of the cached KVM host image, built first if missing (several minutes). Blocking."""
    spec = spec or KvmHostSpec()
    say = progress or (lambda _m: None)
    out_dir = Path(cache_dir) / "kvmhost"
    out_dir.mkdir(parents=True, exist_ok=True)
    kernel = kernel_package(spec)
    final = out_dir / f"kvmhost-{image_hash(spec, kernel)}.ext4"
    if final.is_file():
        return final
    with cache.build_lock(out_dir):
        if final.is_file():
            return final
        for stale in cache.remove_stale(out_dir):
            say(f"removed leftover of an interrupted build: {stale.name}")
        with cache.staging_dir(out_dir, final.stem) as tmp:
            t0 = time.monotonic()
            root = tmp / "root"
            _debootstrap(spec, root, say)
            _install_kernel(kernel, root, tmp, say)
            _install_venv(root, tmp, say)
            _install_files(root)
            say(f"mkfs.ext4 ({spec.size_mib} MiB sparse)")
            image = tmp / "image.ext4"
            with image.open("wb") as f:
                f.truncate(spec.size_mib << 20)
            _run(["mkfs.ext4", "-q", "-F", "-L", "kvmhost", "-b", "4096", "-d", str(root), str(image)])
            say(f"KVM host image built in {time.monotonic() - t0:.0f} s")
            cache.publish(image, final)
    for old in out_dir.glob("kvmhost-*.ext4"):
        if old != final:
            old.unlink(missing_ok=True)  # one image is enough: the previous one is stale
    return final


def _run(cmd: list[str], **kw: object) -> str:
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C.UTF-8",
           "HOME": "/root"}
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env, **kw)  # type: ignore[call-overload]
    if proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed ({proc.returncode}): {(proc.stderr or proc.stdout)[-3000:]}")
    return str(proc.stdout)


def _debootstrap(spec: KvmHostSpec, root: Path, say: Progress) -> None:
    say(f"debootstrap {spec.suite} ({len(spec.include)} packages and their dependencies)")
    _run(["debootstrap", "--variant=minbase", f"--include={','.join(spec.include)}", spec.suite, str(root),
          spec.mirror])
    for pattern in ("var/cache/apt/archives/*.deb", "var/cache/apt/*.bin"):
        for p in root.glob(pattern):
            p.unlink()
    missing = [b for b in ("usr/bin/python3", "usr/sbin/modprobe", "usr/bin/kmod", "usr/sbin/ip", "usr/sbin/nft",
                           "usr/bin/qemu-system-x86_64") if not (root / b).exists()]
    if missing:
        raise RuntimeError(f"debootstrap left out {missing} (packages {spec.include})")


def _install_kernel(kernel: str, root: Path, tmp: Path, say: Progress) -> None:
    say(f"kernel modules from {kernel}")
    versions = debs.resolve_versions([kernel])
    (tmp / "debs").mkdir()
    unpacked = tmp / "kernel"
    for deb in debs.download(versions, tmp / "debs").values():
        debs.extract(deb, unpacked)
    # moved, not extracted in place: unpacking over the tree would replace its /lib -> usr/lib symlink
    (root / "usr/lib/modules").mkdir(parents=True, exist_ok=True)
    kver = next(p.name for p in (unpacked / "lib/modules").iterdir())
    shutil.move(unpacked / "lib/modules" / kver, root / "usr/lib/modules" / kver)
    _run(["depmod", "-b", str(root), kver])  # this host's depmod, on the tree


def _install_venv(root: Path, tmp: Path, say: Progress) -> None:
    """A venv at /opt/aenv-node/venv with the node's dependencies, from wheels downloaded on this host."""
    wheels = root / "tmp/wheels"
    wheels.mkdir(parents=True)
    say("pip download (the node's dependencies as wheels, on this host)")
    _run([sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "--python-version", "3.11",
          "--platform", "manylinux2014_x86_64", "--platform", "manylinux_2_28_x86_64", "--platform", "linux_x86_64",
          "-d", str(wheels), *dependencies()])
    say("venv inside the tree (pip install --no-index)")
    _run(["chroot", str(root), "python3", "-m", "venv", "/opt/aenv-node/venv"])
    _run(["chroot", str(root), "/opt/aenv-node/venv/bin/pip", "install", "-q", "--no-index", "--find-links",
          "/tmp/wheels", *dependencies()])
    shutil.rmtree(wheels)
    site = next((root / "opt/aenv-node/venv/lib").glob("python3*/site-packages"))
    # the project itself is on the drive made at each `up`, mounted at /opt/aenv-node/src
    (site / "aenv-node-src.pth").write_text("/opt/aenv-node/src\n")


INIT = r"""#!/bin/bash
# PID 1 of the KVM host VM, first stage: mount the system filesystems and the project drive, then exec the
# second stage from that drive (tests/kvmhost/guest_init.sh), so changing it needs no image rebuild.
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
mount -t proc proc /proc; mount -t sysfs sysfs /sys
mount -t tmpfs -o mode=0755 tmpfs /run; mkdir -p /dev/pts /dev/shm /run/netns
mount -t devpts devpts /dev/pts; mount -t tmpfs tmpfs /dev/shm; mount -t tmpfs tmpfs /tmp
mkdir -p /opt/aenv-node/src
mount -o ro /dev/vdc /opt/aenv-node/src || { echo "kvmhost: FATAL: no project drive"; poweroff -f; }
exec /bin/bash /opt/aenv-node/src/kvmhost-init.sh
"""

WRAPPER = """#!/bin/sh
exec /opt/aenv-node/venv/bin/python -c 'import sys; from aenv_node.cli.{mod} import main; sys.argv[0] = "{name}"; main()' "$@"
"""


def _install_files(root: Path) -> None:
    init = root / "sbin/aenv-kvmhost-init"
    init.write_text(INIT)
    init.chmod(0o755)
    for name, mod in (("aenv-node", "node"), ("aenv", "client")):
        w = root / "usr/local/bin" / name
        w.write_text(WRAPPER.format(mod=mod, name=name))
        w.chmod(0o755)
    (root / "opt/aenv/bin").mkdir(parents=True, exist_ok=True)
    for name in ("firecracker", "jailer"):
        shutil.copy2(FIRECRACKER_DIR / name, root / "opt/aenv/bin" / name)
    (root / "etc/hostname").write_text("kvmhost\n")
    (root / "etc/hosts").write_text("127.0.0.1\tlocalhost kvmhost\n")
    (root / "etc/resolv.conf").unlink(missing_ok=True)
    (root / "etc/resolv.conf").write_text("nameserver 127.0.0.1\n")  # nothing to resolve: no route off the VM
