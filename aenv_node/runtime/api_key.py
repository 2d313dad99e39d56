"""The node's API key: where it lives, how it is rotated, and how a running node picks up a rotated one.

The key is ``api.api_key`` from the configuration (fixed for the process's life), else the file
``<state_dir>/secrets/api-key`` (0600, generated on first start). ``aenv-node key rotate`` writes a new key
into that file (atomically: a reader sees the old key or the new one, whole); a running node's
``ApiKeyWatcher`` notices the new file within ``RELOAD_INTERVAL_S`` and from then on accepts only the new key.
No restart, no signal to deliver: the file is the one place the key is kept.
"""

from __future__ import annotations

import logging
import os
import secrets
from pathlib import Path
from collections.abc import Callable
from typing import Optional, Protocol

import trio

from ..config import Config

__all__ = ["ApiKeyFromConfig", "ApiKeyWatcher", "ensure_api_key", "key_reader", "rotate_api_key", "RELOAD_INTERVAL_S"]

log = logging.getLogger(__name__)

#: how often a running node looks at the key file (a stat: nothing is read unless it changed)
RELOAD_INTERVAL_S = 1.0


class ApiKeyFromConfig(Exception):
    """The key is set in the configuration (``api.api_key``): there is no file to rotate."""


def _new_key() -> str:
    return "aenv_" + secrets.token_hex(20)


def _write(path: Path, key: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, (key + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def ensure_api_key(cfg: Config) -> tuple[str, Path | None]:
    """The API key: from config, else read or generated at <state>/secrets/api-key (0600).

    Returns the key and the file it lives in (None when it came from config).
    """
    if cfg.api.api_key:
        return cfg.api.api_key, None
    path = cfg.api_key_path
    path.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    try:
        key = path.read_text().strip()
        if key:
            if path.stat().st_mode & 0o077:
                os.chmod(path, 0o600)
            return key, path
    except FileNotFoundError:
        pass
    key = _new_key()
    _write(path, key)
    return key, path


def key_reader(cfg: Config) -> Callable[[], str]:
    """The node's API key as it is now, for a process that only uses it (the data plane, calling peers): the
    configured one, else the key file's, read again when the file changes (``aenv-node key rotate``); "" while
    there is none."""
    if cfg.api.api_key:
        key = cfg.api.api_key
        return lambda: key
    seen: dict[str, tuple[tuple[int, int], str]] = {}

    def read() -> str:
        path = cfg.api_key_path
        try:
            st = path.stat()
            stamp = (st.st_ino, st.st_mtime_ns)
            if "key" not in seen or seen["key"][0] != stamp:
                seen["key"] = (stamp, path.read_text().strip())
        except FileNotFoundError:
            return ""
        return seen["key"][1]

    return read


def rotate_api_key(cfg: Config) -> str:
    """Write a new key into the key file; a running node accepts only it within ``RELOAD_INTERVAL_S``."""
    if cfg.api.api_key:
        raise ApiKeyFromConfig("the API key is set in the configuration (api.api_key): change it there and "
                               "restart the node")
    ensure_api_key(cfg)  # the directory, with its mode
    key = _new_key()
    _write(cfg.api_key_path, key)
    return key


class KeyHolder(Protocol):
    """What the watcher updates: the node (``Node.api_key``)."""

    api_key: str


class ApiKeyWatcher:
    """A node service: reloads the key file when it changes (by inode and modification time) into
    ``holder.api_key``; an empty or unreadable file keeps the key in use (logged)."""

    name = "api-key"

    def __init__(self, holder: KeyHolder, path: Path) -> None:
        self.holder = holder
        self.path = path
        self._seen = self._stamp()

    def _stamp(self) -> Optional[tuple[int, int]]:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_ino, st.st_mtime_ns

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            await trio.sleep(RELOAD_INTERVAL_S)
            stamp = await trio.to_thread.run_sync(self._stamp)
            if stamp is None or stamp == self._seen:
                continue
            self._seen = stamp
            try:
                key = (await trio.to_thread.run_sync(self.path.read_text)).strip()
            except OSError as exc:
                log.warning("reading the rotated API key in %s failed: %s; the key in use stays", self.path, exc)
                continue
            if not key:
                log.warning("the API key file %s is empty: the key in use stays", self.path)
                continue
            if key != self.holder.api_key:
                self.holder.api_key = key
                log.info("the API key was rotated (%s): only the new key is accepted", self.path)
