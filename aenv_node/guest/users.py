"""Users and paths as envd sees them: who a request runs as, and where.

Requests name a user (``Authorization: Basic base64("<user>:")`` for RPCs,
``?username=`` for ``/files``) or fall back to the default user set by
``/init``. Relative paths are resolved against that user's home (or the
default workdir), ``~`` expands to the home, and every path is cleaned to an
absolute one, as E2B's envd does.
"""

from __future__ import annotations

import base64
import binascii
import os
import pwd
import stat
from dataclasses import dataclass


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int
    home: str

    def groups(self) -> list[int]:
        try:
            return os.getgrouplist(self.name, self.gid)
        except OSError:
            return [self.gid]


class UnknownUser(LookupError):
    """No account of that name in the guest's passwd database."""


def lookup_user(name: str) -> User:
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        raise UnknownUser(f"unknown user {name!r}") from None
    return User(name=entry.pw_name, uid=entry.pw_uid, gid=entry.pw_gid, home=entry.pw_dir)


def basic_auth_username(header: str | None) -> str | None:
    """The user name of an ``Authorization: Basic`` header, or None without one."""
    if not header:
        return None
    scheme, _, value = header.strip().partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        decoded = base64.b64decode(value.strip(), validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        return None
    name, sep, _password = decoded.partition(":")
    if not sep:
        return None
    return name


def resolve_path(path: str, user: User, default_workdir: str | None) -> str:
    """Expand ``~``, anchor relative paths at the home, clean; ValueError if unusable."""
    if path == "" and default_workdir:
        path = default_workdir
    if path.startswith("~"):
        if len(path) > 1 and path[1] not in "/\\":
            raise ValueError(
                f"failed to expand path '{path}' for user '{user.name}': "
                "cannot expand user-specific home dir"
            )
        path = user.home + "/" + path[1:]
    if not path.startswith("/"):
        path = user.home + "/" + path
    if "\x00" in path:
        raise ValueError(f"path contains invalid characters: {path}")
    cleaned = os.path.normpath(path)
    if cleaned.startswith("//"):
        cleaned = "/" + cleaned.lstrip("/")
    return cleaned


def ensure_dirs(path: str, uid: int, gid: int) -> None:
    """Create ``path`` and missing parents, each owned by uid:gid (like EnsureDirs)."""
    parts: list[str] = []
    current = path
    while current not in ("/", ""):
        parts.append(current)
        current = os.path.dirname(current)
    for sub in reversed(parts):
        try:
            st = os.stat(sub)
        except FileNotFoundError:
            os.mkdir(sub, 0o755)
            os.chown(sub, uid, gid)
            continue
        if not stat.S_ISDIR(st.st_mode):
            raise NotADirectoryError(f"path is a file: {sub}")
