"""EntryInfo in proto3 JSON, as E2B's envd describes a file.

Details that clients see and that follow Go, not Python: ``permissions`` is
Go's ``FileMode.String()`` ("-rw-r--r--", "drwxr-xr-x", "Lrwxrwxrwx"); a
symlink reports its target's type and mode; ``size`` is an int64 and so a JSON
string; ``metadata`` holds the ``user.e2b.*`` extended attributes.
"""

from __future__ import annotations

import grp
import os
import pwd
import stat
import time
from typing import Any

from .errors import ConnectError

FILE = "FILE_TYPE_FILE"
DIRECTORY = "FILE_TYPE_DIRECTORY"
UNSPECIFIED = "FILE_TYPE_UNSPECIFIED"
XATTR_PREFIX = "user.e2b."


def file_type(mode: int) -> str:
    if stat.S_ISREG(mode):
        return FILE
    if stat.S_ISDIR(mode):
        return DIRECTORY
    return UNSPECIFIED


def go_mode_string(mode: int) -> str:
    """Go's os.FileMode.String() for a stat st_mode."""
    kinds = ""
    if stat.S_ISDIR(mode):
        kinds += "d"
    if stat.S_ISLNK(mode):
        kinds += "L"
    if stat.S_ISBLK(mode) or stat.S_ISCHR(mode):
        kinds += "D"
    if stat.S_ISFIFO(mode):
        kinds += "p"
    if stat.S_ISSOCK(mode):
        kinds += "S"
    if mode & stat.S_ISUID:
        kinds += "u"
    if mode & stat.S_ISGID:
        kinds += "g"
    if stat.S_ISCHR(mode):
        kinds += "c"
    if mode & stat.S_ISVTX:
        kinds += "t"
    if not kinds:
        kinds = "-"
    perms = "".join(
        ch if mode & (1 << (8 - i)) else "-" for i, ch in enumerate("rwxrwxrwx")
    )
    return kinds + perms


def rfc3339_ns(ns: int) -> str:
    """A protobuf Timestamp in JSON: RFC 3339, UTC, 0/3/6/9 fraction digits."""
    seconds, nanos = divmod(ns, 1_000_000_000)
    base = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds))
    if nanos == 0:
        return base + "Z"
    if nanos % 1_000_000 == 0:
        return f"{base}.{nanos // 1_000_000:03d}Z"
    if nanos % 1_000 == 0:
        return f"{base}.{nanos // 1_000:06d}Z"
    return f"{base}.{nanos:09d}Z"


# Only names found are cached: a uid without a name yet may get one later.
_owner_cache: dict[int, str] = {}
_group_cache: dict[int, str] = {}


def _owner(uid: int) -> str:
    name = _owner_cache.get(uid)
    if name is None:
        try:
            name = _owner_cache[uid] = pwd.getpwuid(uid).pw_name
        except KeyError:
            return str(uid)
    return name


def _group(gid: int) -> str:
    name = _group_cache.get(gid)
    if name is None:
        try:
            name = _group_cache[gid] = grp.getgrgid(gid).gr_name
        except KeyError:
            return str(gid)
    return name


def read_metadata(path: str) -> dict[str, str]:
    """The ``user.e2b.*`` xattrs of ``path`` (prefix stripped); {} if none or unsupported."""
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError:
        return {}
    metadata: dict[str, str] = {}
    for name in names:
        if name.startswith(XATTR_PREFIX):
            try:
                metadata[name[len(XATTR_PREFIX):]] = os.getxattr(path, name, follow_symlinks=False).decode("utf-8", "replace")
            except OSError:
                continue
    return metadata


def write_metadata(path: str, metadata: dict[str, str] | None) -> None:
    """Replace the ``user.e2b.*`` xattrs of ``path`` with ``metadata``."""
    wanted = {XATTR_PREFIX + k: v for k, v in (metadata or {}).items()}
    try:
        existing = [n for n in os.listxattr(path) if n.startswith(XATTR_PREFIX)]
    except OSError as exc:
        if not wanted:
            return
        raise exc
    for name in existing:
        if name not in wanted:
            os.removexattr(path, name)
    for name, value in wanted.items():
        os.setxattr(path, name, value.encode("utf-8"))


def entry_info(path: str, name: str | None = None) -> dict[str, Any]:
    """The EntryInfo of ``path`` (not following a final symlink for the entry itself)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError as exc:
        raise ConnectError("not_found", f"file not found: lstat {path}: no such file or directory") from exc
    except OSError as exc:
        raise ConnectError("internal", f"error getting file info: lstat {path}: {exc.strerror}") from exc
    info: dict[str, Any] = {
        "name": name if name is not None else (os.path.basename(path) or "/"),
        "path": path,
        "size": str(st.st_size),
        "permissions": go_mode_string(st.st_mode),
        "owner": _owner(st.st_uid),
        "group": _group(st.st_gid),
        "modifiedTime": rfc3339_ns(st.st_mtime_ns),
    }
    if stat.S_ISLNK(st.st_mode):
        info["isSymlink"] = True
        try:
            target = os.path.realpath(path, strict=True)
        except (OSError, RuntimeError):
            target = None
        if target is not None:
            info["symlinkTarget"] = target
            try:
                tst = os.stat(target)
                info["type"] = file_type(tst.st_mode)
                info["mode"] = stat.S_IMODE(tst.st_mode) & 0o777
            except OSError:
                info["type"] = UNSPECIFIED
                info["mode"] = 0
        else:
            info["type"] = UNSPECIFIED
            info["mode"] = 0
    else:
        info["type"] = file_type(st.st_mode)
        info["mode"] = st.st_mode & 0o777
    metadata = read_metadata(path)
    if metadata:
        info["metadata"] = metadata
    return info
