"""Provisioning: what any image needs to be a sandbox, added as one layer of its own over the image's layers.

The sandbox contract (DESIGN.md "envd"): envd runs from the guest kit's tools drive mounted at ``/opt/aenv``,
commands run as ``user`` (home ``/home/user``) or ``root`` through ``/bin/sh``, and the node owns the guest's
``/etc/hosts`` and ``/etc/resolv.conf``. An image brings none of that for sure, so a build adds it here:

- ``/bin/sh`` must exist (followed through symlinks inside the image): without a shell no command or build
  step can run, and the build says so (:class:`ImageHasNoShell`);
- a ``user`` account when the image has none: uid 1000 when that is free (E2B's), else the first free uid above;
  its group, a home it owns, an empty password in ``/etc/shadow`` when the image uses one, and passwordless
  sudo when the image has ``sudo``;
- ``/etc/hosts``, ``/etc/resolv.conf`` and ``/etc/hostname`` written by the node (a symlink there, e.g. to
  systemd-resolved's stub, is replaced by a file);
- the mount points the guest's init uses (``/dev``, ``/proc``, ``/sys``, ``/run``, ``/tmp``, ``/opt/aenv``),
  which an image made FROM scratch lacks.

The image's own layers are never touched: the result is a separate layer (cached by the image's top chain
and :data:`PROVISION_VERSION`). Every change is made with Python on the mounted filesystem, never by running
the image's programs on the host (they are untrusted and built for another root). Paths are resolved inside
the image's root as a chroot would (:func:`resolve_inside`): an absolute symlink such as ``/etc -> /host``
stays in the image.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from .errors import ImageHasNoShell, TemplateBuildError

__all__ = ["PROVISION_VERSION", "Provisioned", "provision_root", "resolve_inside"]

#: Part of the provisioning layer's cache key: bump it when what this module writes changes.
PROVISION_VERSION = 2

USER_NAME = "user"
PREFERRED_UID = 1000
HOSTNAME = "sandbox"
NAMESERVER = "8.8.8.8"
HOSTS = f"127.0.0.1\tlocalhost\n127.0.1.1\t{HOSTNAME}\n::1\tlocalhost ip6-localhost ip6-loopback\n"
_MAX_LINKS = 40
#: Where the guest's init mounts things: an image made FROM scratch may have none of them (a container runtime
#: makes them; here the guest kernel needs them in the filesystem).
_MOUNT_POINTS = (("/dev", 0o755), ("/proc", 0o555), ("/sys", 0o555), ("/run", 0o755), ("/tmp", 0o1777),
                 ("/opt/aenv", 0o755))


def resolve_inside(root: Path, path: str, *, follow_last: bool = True) -> Path:
    """``path`` (absolute inside the image) as a host path under ``root``, symlinks followed as if ``root``
    were ``/``: an absolute target restarts at ``root``, ``..`` stops at it. A loop is an error."""
    parts = list(PurePosixPath("/" + path.lstrip("/")).parts[1:])
    resolved: list[str] = []
    links = 0
    while parts:
        name = parts.pop(0)
        if name in ("", "."):
            continue
        if name == "..":
            if resolved:
                resolved.pop()
            continue
        candidate = root.joinpath(*resolved, name)
        if (parts or follow_last) and candidate.is_symlink():
            links += 1
            if links > _MAX_LINKS:
                raise TemplateBuildError(f"too many levels of symbolic links resolving {path} in the image")
            target = os.readlink(candidate)
            if target.startswith("/"):
                resolved = []
            parts = list(PurePosixPath(target).parts[1 if target.startswith("/") else 0:]) + parts
            continue
        resolved.append(name)
    return root.joinpath(*resolved)


@dataclass(frozen=True)
class Provisioned:
    """What provisioning found or made (recorded in the build's log)."""

    user: str
    uid: int
    gid: int
    created_user: bool
    sudo: bool


def _read(root: Path, path: str) -> str:
    p = resolve_inside(root, path)
    try:
        return p.read_text(encoding="utf-8", errors="surrogateescape")
    except FileNotFoundError:
        return ""
    except IsADirectoryError:
        raise TemplateBuildError(f"{path} in the image is a directory") from None


def _write(root: Path, path: str, text: str, mode: int = 0o644, *, uid: int = 0, gid: int = 0) -> None:
    """Write a regular file at ``path`` (its parents created), replacing a symlink there rather than
    writing through it."""
    parent = resolve_inside(root, str(PurePosixPath(path).parent))
    parent.mkdir(parents=True, exist_ok=True)
    target = parent / PurePosixPath(path).name
    if target.is_symlink():
        target.unlink()
    elif target.is_dir():
        raise TemplateBuildError(f"{path} in the image is a directory")
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
    try:
        os.write(fd, text.encode("utf-8", errors="surrogateescape"))
        os.fchown(fd, uid, gid)
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def _append(root: Path, path: str, line: str, mode: int) -> None:
    text = _read(root, path)
    if text and not text.endswith("\n"):
        text += "\n"
    existing = resolve_inside(root, path)
    keep_mode = stat.S_IMODE(existing.stat().st_mode) if existing.exists() else mode
    keep_gid = existing.stat().st_gid if existing.exists() else 0
    _write(root, path, text + line + "\n", keep_mode, gid=keep_gid)


def _entries(text: str) -> list[list[str]]:
    return [line.split(":") for line in text.splitlines() if line and not line.startswith("#")]


def _has_shell(root: Path) -> bool:
    sh = resolve_inside(root, "/bin/sh")
    return sh.is_file() and os.access(sh, os.X_OK)


def provision_root(root: Path) -> Provisioned:
    """Provision the mounted image filesystem at ``root`` (see the module docstring). Blocking."""
    if not _has_shell(root):
        raise ImageHasNoShell("the image has no /bin/sh: sandboxes run commands and build steps through a shell "
                              "(build FROM an image with one, e.g. a debian, ubuntu, alpine or python image)")
    passwd = _entries(_read(root, "/etc/passwd"))
    groups = _entries(_read(root, "/etc/group"))
    sudo = any(resolve_inside(root, p).is_file() for p in ("/usr/bin/sudo", "/bin/sudo", "/usr/sbin/sudo"))
    existing = [e for e in passwd if e[0] == USER_NAME and len(e) >= 7]
    if existing:
        uid, gid, home = int(existing[0][2]), int(existing[0][3]), existing[0][5]
        created = False
    else:
        used_uids = {int(e[2]) for e in passwd if len(e) >= 3 and e[2].isdigit()}
        used_gids = {int(e[2]) for e in groups if len(e) >= 3 and e[2].isdigit()}
        uid = PREFERRED_UID
        while uid in used_uids or uid in used_gids:
            uid += 1
        gid, home = uid, f"/home/{USER_NAME}"
        shell = "/bin/bash" if resolve_inside(root, "/bin/bash").is_file() else "/bin/sh"
        if not any(e[0] == USER_NAME for e in groups):
            _append(root, "/etc/group", f"{USER_NAME}:x:{gid}:", 0o644)
        _append(root, "/etc/passwd", f"{USER_NAME}:x:{uid}:{gid}::{home}:{shell}", 0o644)
        if resolve_inside(root, "/etc/shadow").exists():
            _append(root, "/etc/shadow", f"{USER_NAME}::19000:0:99999:7:::", 0o640)
        created = True
    home_dir = resolve_inside(root, home)
    if not home_dir.is_dir():
        home_dir.mkdir(parents=True, mode=0o750)
        os.chown(home_dir, uid, gid)
    if sudo:
        _write(root, f"/etc/sudoers.d/{USER_NAME}", f"{USER_NAME} ALL=(ALL:ALL) NOPASSWD: ALL\n", 0o440)
    _write(root, "/etc/hosts", HOSTS)
    _write(root, "/etc/hostname", HOSTNAME + "\n")
    _write(root, "/etc/resolv.conf", f"nameserver {NAMESERVER}\n")
    for path, mode in _MOUNT_POINTS:
        target = resolve_inside(root, path)
        if not target.exists():
            target.mkdir(parents=True)
            target.chmod(mode)
    return Provisioned(USER_NAME, uid, gid, created, sudo)
