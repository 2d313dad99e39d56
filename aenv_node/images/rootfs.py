"""The ``base`` template root filesystem: Debian bookworm (debootstrap minbase, then E2B's base set of packages:
python3 with pip and venv, git, curl, wget, Node.js with npm, build tools) in an ext4 image.

It is what a sandbox boots when no image is given, and the shape every template rootfs shares: a user
``user`` (uid 1000, home ``/home/user``, bash, passwordless sudo, as E2B sandboxes have) and an empty
``/opt/aenv`` where the initramfs mounts the tools drive. No init system is installed: the kit's minimal init
(``aenv.init=minimal``) runs as PID 1 from the tools drive.

The image is cached as ``<state-dir>/rootfs/base-<hash>.ext4`` where the hash covers the :class:`RootfsSpec`
and this module's code; it is built in a temporary directory and renamed into place when complete. A VM must
never write to it: boot it through a copy-on-write overlay (qcow2 overlay, or a writable upper layer).
Package versions are whatever the mirror serves at build time (they are not part of the hash: change the spec,
e.g. ``revision``, to force a rebuild after a Debian point release).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from . import cache
from .errors import RootfsBuildError, ToolMissingError

__all__ = ["RootfsSpec", "ensure_base_rootfs", "ensure_rootfs", "rootfs_hash"]

Progress = Callable[[str], None]

_PER_PACKAGE = re.compile(r"^I: (Retrieving|Validating|Extracting|Unpacking|Configuring) (?!the |Release|InRelease|Packages)\S")


@dataclass(frozen=True)
class RootfsSpec:
    """Inputs of a Debian template rootfs; all of them are hashed."""

    name: str = "base"
    suite: str = "bookworm"
    mirror: str = "http://deb.debian.org/debian"
    variant: str = "minbase"
    include: tuple[str, ...] = ("bash", "coreutils", "procps", "iproute2", "ca-certificates", "sudo")
    #: installed with apt inside the new root after debootstrap (whose own resolver cannot install npm's
    #: dependency tree): what E2B's base image gives agent code
    packages: tuple[str, ...] = ("python3", "python3-pip", "python3-venv", "python3-dev", "build-essential",
                                 "git", "curl", "wget", "nodejs", "npm", "less", "unzip", "xz-utils",
                                 "openssh-client", "jq", "vim-tiny")
    user: str = "user"
    uid: int = 1000
    hostname: str = "sandbox"
    nameserver: str = "8.8.8.8"
    size_mib: int = 4096
    revision: int = 1  # bump to force a rebuild (e.g. to pick up a Debian point release)


def rootfs_hash(spec: RootfsSpec) -> str:
    h = cache.InputHasher("aenv-rootfs")
    h.add_text("spec", json.dumps(dataclasses.asdict(spec), sort_keys=True))
    h.add_text("code/rootfs.py", inspect.getsource(sys.modules[rootfs_hash.__module__]))
    h.add_text("code/cache.py", inspect.getsource(cache))
    return h.hexdigest()


def ensure_base_rootfs(state_dir: Path, *, progress: Progress | None = None) -> Path:
    """Path of the cached ``base`` rootfs image, built first if missing (about a minute). Blocking."""
    return ensure_rootfs(state_dir, RootfsSpec(), progress=progress)


def ensure_rootfs(state_dir: Path, spec: RootfsSpec, *, progress: Progress | None = None) -> Path:
    say = progress or (lambda _msg: None)
    rootfs_dir = Path(state_dir) / "rootfs"
    digest = rootfs_hash(spec)
    final = rootfs_dir / f"{spec.name}-{digest}.ext4"
    if final.is_file():
        return final
    for tool in ("debootstrap", "mkfs.ext4", "chroot"):
        if shutil.which(tool) is None:
            raise ToolMissingError(f"{tool} is not installed (Debian packages debootstrap, e2fsprogs, coreutils)")
    with cache.build_lock(rootfs_dir):
        if final.is_file():
            return final
        for stale in cache.remove_stale(rootfs_dir):
            say(f"removed leftover of an interrupted build: {stale.name}")
        with cache.staging_dir(rootfs_dir, f"{spec.name}-{digest}") as tmp:
            t0 = time.monotonic()
            root = tmp / "root"
            _debootstrap(spec, root, tmp, say)
            if spec.packages:
                _install_packages(spec, root, say)
            say("configuring users, sudo, hostname")
            _configure(spec, root)
            say(f"mkfs.ext4 ({spec.size_mib} MiB sparse)")
            image = tmp / "image.ext4"
            _mkfs(root, image, spec.size_mib)
            used = sum(b.stat().st_blocks for b in [image]) * 512
            say(f"rootfs {spec.name} built in {time.monotonic() - t0:.1f} s ({used >> 20} MiB allocated)")
            cache.publish(image, final)
    return final


def _run(cmd: list[str], what: str) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RootfsBuildError(f"{what} failed ({proc.returncode}): {(proc.stderr or proc.stdout).strip()[-2000:]}")
    return proc.stdout


def _debootstrap(spec: RootfsSpec, root: Path, tmp: Path, say: Progress) -> None:
    cmd = ["debootstrap", f"--variant={spec.variant}", f"--include={','.join(spec.include)}",
           spec.suite, str(root), spec.mirror]  # fmt: skip
    say("$ " + " ".join(cmd))
    log = tmp / "debootstrap.out"
    counts: dict[str, int] = {}
    last_report = 0.0
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:
            lines.append(line)
            text = line.strip()
            # Per-package lines ("I: Retrieving foo 1.2") are summarised as counts at most every 2 s; phase
            # lines, warnings and errors are shown as they come.
            per_package = _PER_PACKAGE.match(text)
            if per_package:
                verb = per_package.group(1)
                counts[verb] = counts.get(verb, 0) + 1
                if time.monotonic() - last_report >= 2:
                    last_report = time.monotonic()
                    say(f"debootstrap: {verb.lower()} packages: {counts[verb]}")
            elif text:
                say("debootstrap: " + text)
        proc.wait()
    log.write_text("".join(lines))
    if proc.returncode != 0:
        tail = "".join(lines[-20:])
        extra = ""
        if (root / "debootstrap" / "debootstrap.log").exists():
            extra = (root / "debootstrap" / "debootstrap.log").read_text()[-1500:]
        raise RootfsBuildError(f"debootstrap failed ({proc.returncode}):\n{tail}\n{extra}")


_DEVICES = (("null", 1, 3), ("zero", 1, 5), ("full", 1, 7), ("random", 1, 8), ("urandom", 1, 9), ("tty", 5, 0))


def _install_packages(spec: RootfsSpec, root: Path, say: Progress) -> None:
    """``apt-get install`` of ``spec.packages`` in the new root (a chroot on the host: a VM never reaches the
    mirror). Its /proc is mounted and its /dev is a tmpfs with the few nodes package scripts use (never the
    host's /dev bound in: a failed build's staging directory is removed recursively). Services are never
    started (policy-rc.d)."""
    import os

    proc_dir, dev_dir = root / "proc", root / "dev"
    policy = root / "usr" / "sbin" / "policy-rc.d"
    policy.write_text("#!/bin/sh\nexit 101\n")
    policy.chmod(0o755)
    host_resolv = Path("/etc/resolv.conf")
    if host_resolv.exists():
        (root / "etc" / "resolv.conf").unlink(missing_ok=True)
        shutil.copy(host_resolv, root / "etc" / "resolv.conf")
    mounted: list[Path] = []
    try:
        _run(["mount", "-t", "proc", "proc", str(proc_dir)], "mount /proc in the new root")
        mounted.append(proc_dir)
        _run(["mount", "-t", "tmpfs", "-o", "mode=0755,size=16m", "tmpfs", str(dev_dir)], "mount /dev tmpfs")
        mounted.append(dev_dir)
        for name, major, minor in _DEVICES:
            os.mknod(dev_dir / name, 0o666 | 0o020000, os.makedev(major, minor))
        env = {"DEBIAN_FRONTEND": "noninteractive", "PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}
        say("apt-get update (in the new root)")
        _run_env(["chroot", str(root), "apt-get", "-q", "update"], "apt-get update", env)
        say(f"apt-get install {' '.join(spec.packages)}")
        t0 = time.monotonic()
        _run_env(["chroot", str(root), "apt-get", "-q", "-y", "--no-install-recommends", "install", *spec.packages],
                 "apt-get install", env)
        _run_env(["chroot", str(root), "apt-get", "clean"], "apt-get clean", env)
        say(f"packages installed in {time.monotonic() - t0:.0f} s")
    finally:
        for m in reversed(mounted):
            if subprocess.run(["umount", str(m)], capture_output=True).returncode != 0:
                subprocess.run(["umount", "-l", str(m)], capture_output=True)
        policy.unlink(missing_ok=True)


def _run_env(cmd: list[str], what: str, env: dict[str, str]) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if proc.returncode != 0:
        raise RootfsBuildError(f"{what} failed ({proc.returncode}): {(proc.stderr or proc.stdout).strip()[-2000:]}")
    return proc.stdout


def _configure(spec: RootfsSpec, root: Path) -> None:
    _run(["chroot", str(root), "useradd", "--create-home", "--uid", str(spec.uid), "--shell", "/bin/bash",
          "--groups", "sudo", spec.user], "useradd")  # fmt: skip
    _run(["chroot", str(root), "passwd", "--delete", spec.user], "passwd")
    sudoers = root / "etc" / "sudoers.d" / spec.user
    sudoers.write_text(f"{spec.user} ALL=(ALL:ALL) NOPASSWD: ALL\n")
    sudoers.chmod(0o440)
    (root / "etc" / "hostname").write_text(spec.hostname + "\n")
    (root / "etc" / "hosts").write_text(
        f"127.0.0.1\tlocalhost\n127.0.1.1\t{spec.hostname}\n::1\tlocalhost ip6-localhost ip6-loopback\n"
    )
    resolv = root / "etc" / "resolv.conf"
    resolv.unlink(missing_ok=True)
    resolv.write_text(f"nameserver {spec.nameserver}\n")
    (root / "etc" / "machine-id").write_text("")
    (root / "opt" / "aenv").mkdir(parents=True, exist_ok=True)
    # Debootstrap's download cache and package lists are dead weight in every sandbox.
    for pattern in ("var/cache/apt/archives/*.deb", "var/cache/apt/*.bin", "var/lib/apt/lists/*_Packages",
                    "var/lib/apt/lists/*_Release*", "var/log/*.log"):  # fmt: skip
        for path in root.glob(pattern):
            if path.is_file():
                path.unlink()
    shutil.rmtree(root / "debootstrap", ignore_errors=True)


def _mkfs(root: Path, image: Path, size_mib: int) -> None:
    with image.open("wb") as f:
        f.truncate(size_mib << 20)
    _run(["mkfs.ext4", "-q", "-F", "-L", "aenv-root", "-b", "4096", "-d", str(root), str(image)], "mkfs.ext4")
