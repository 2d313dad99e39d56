"""The ``filesystem.Filesystem`` Connect service.

Stat, MakeDir, Move, ListDir, Remove, and directory watching both ways E2B
offers it: the ``WatchDir`` stream (async SDKs) and the polled watchers
(``CreateWatcher`` / ``GetWatcherEvents`` / ``RemoveWatcher``, sync SDKs).
Polled watchers live in the service's nursery until removed, like the
processes they outlive the request that made them.
"""

from __future__ import annotations

import os
import stat
from typing import Any

import trio

from . import inotify
from .connect import CallContext, Message, Method, ServerStream
from .entry import DIRECTORY, entry_info
from .errors import ConnectError
from .process_service import request_user
from .state import EnvdState
from .users import User, ensure_dirs, resolve_path

# Magic numbers of network filesystems WatchDir refuses (unless allowed).
_NETWORK_FS = {0x6969, 0xFF534D42, 0x517B, 0xFE534D42, 0x65735546}


def _resolve(path: str, user: User, state: EnvdState) -> str:
    try:
        return resolve_path(path, user, state.default_workdir)
    except ValueError as exc:
        raise ConnectError("invalid_argument", str(exc)) from exc


def _event_types(mask: int) -> list[str]:
    """fsnotify's op order: Create, Rename, Chmod, Write, Remove."""
    types = []
    if mask & (inotify.IN_CREATE | inotify.IN_MOVED_TO):
        types.append("EVENT_TYPE_CREATE")
    if mask & (inotify.IN_MOVED_FROM | inotify.IN_MOVE_SELF):
        types.append("EVENT_TYPE_RENAME")
    if mask & inotify.IN_ATTRIB:
        types.append("EVENT_TYPE_CHMOD")
    if mask & inotify.IN_MODIFY:
        types.append("EVENT_TYPE_WRITE")
    if mask & (inotify.IN_DELETE | inotify.IN_DELETE_SELF):
        types.append("EVENT_TYPE_REMOVE")
    return types


def _fs_events(root: str, event: inotify.Event, include_entry: bool) -> list[dict[str, Any]]:
    name = os.path.relpath(event.path, root)
    out = []
    for kind in _event_types(event.mask):
        fs_event: dict[str, Any] = {"name": name, "type": kind}
        if include_entry and kind not in ("EVENT_TYPE_REMOVE", "EVENT_TYPE_RENAME"):
            try:
                fs_event["entry"] = entry_info(event.path)
            except ConnectError:
                pass
        out.append(fs_event)
    return out


def _open_watch(path: str, recursive: bool, allow_network: bool) -> inotify.Inotify:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ConnectError("not_found", f"path {path} not found: stat {path}: no such file or directory") from None
    except OSError as exc:
        raise ConnectError("internal", f"error statting path {path}: {exc}") from exc
    if not stat.S_ISDIR(st.st_mode):
        raise ConnectError("invalid_argument", f"path {path} not a directory")
    if not allow_network and _fs_magic(path) in _NETWORK_FS:
        raise ConnectError("invalid_argument", f"cannot watch path on network filesystem: {path}")
    try:
        watch = inotify.Inotify()
    except OSError as exc:
        raise ConnectError("internal", f"error creating watcher: {exc}") from exc
    try:
        watch.add_watch(path, recursive=recursive)
    except OSError as exc:
        watch.close()
        raise ConnectError("internal", f"error adding path {path} to watcher: {exc}") from exc
    return watch


def _fs_magic(path: str) -> int:
    """f_type of statfs(2), which os.statvfs does not expose."""
    import ctypes

    buf = ctypes.create_string_buffer(256)
    libc = inotify._lib()
    if libc.statfs(os.fsencode(path), buf) != 0:
        return 0
    return int.from_bytes(buf.raw[:8], "little")


class _PolledWatcher:
    def __init__(self, root: str, watch: inotify.Inotify, include_entry: bool) -> None:
        self.root = root
        self.watch = watch
        self.include_entry = include_entry
        self.events: list[dict[str, Any]] = []
        self.error: ConnectError | None = None
        self.scope = trio.CancelScope()

    async def run(self) -> None:
        with self.scope, self.watch:
            try:
                while True:
                    for event in await self.watch.read():
                        self.events.extend(_fs_events(self.root, event, self.include_entry))
            except trio.ClosedResourceError:
                return  # removed: closed under our feet
            except OSError as exc:
                self.error = ConnectError("internal", f"watcher error: {exc}")

    def close(self) -> None:
        self.scope.cancel()
        self.watch.close()


class FilesystemService:
    def __init__(self, state: EnvdState, nursery: trio.Nursery) -> None:
        self.state = state
        self._nursery = nursery
        self._watchers: dict[str, _PolledWatcher] = {}

    def methods(self) -> dict[str, Method]:
        prefix = "/filesystem.Filesystem/"
        return {
            prefix + "Stat": Method("unary", self.stat),
            prefix + "MakeDir": Method("unary", self.make_dir),
            prefix + "Move": Method("unary", self.move),
            prefix + "ListDir": Method("unary", self.list_dir),
            prefix + "Remove": Method("unary", self.remove),
            prefix + "WatchDir": Method("server_stream", self.watch_dir),
            prefix + "CreateWatcher": Method("unary", self.create_watcher),
            prefix + "GetWatcherEvents": Method("unary", self.get_watcher_events),
            prefix + "RemoveWatcher": Method("unary", self.remove_watcher),
        }

    def close(self) -> None:
        for watcher in self._watchers.values():
            watcher.close()
        self._watchers.clear()

    async def stat(self, ctx: CallContext, msg: Message) -> Message:
        user = request_user(ctx, self.state)
        path = _resolve(msg.get("path", ""), user, self.state)
        return {"entry": await trio.to_thread.run_sync(entry_info, path)}

    async def make_dir(self, ctx: CallContext, msg: Message) -> Message:
        user = request_user(ctx, self.state)
        path = _resolve(msg.get("path", ""), user, self.state)

        def work() -> Message:
            try:
                st = os.stat(path)
            except FileNotFoundError:
                st = None
            except OSError as exc:
                raise ConnectError("internal", f"error getting file info: {exc}") from exc
            if st is not None:
                if stat.S_ISDIR(st.st_mode):
                    raise ConnectError("already_exists", f"directory already exists: {path}")
                raise ConnectError("invalid_argument", f"path already exists but it is not a directory: {path}")
            try:
                ensure_dirs(path, user.uid, user.gid)
            except OSError as exc:
                raise ConnectError("internal", f"failed to create directory: {exc}") from exc
            return {"entry": {"name": os.path.basename(path), "type": DIRECTORY, "path": path}}

        return await trio.to_thread.run_sync(work)

    async def move(self, ctx: CallContext, msg: Message) -> Message:
        user = request_user(ctx, self.state)
        source = _resolve(msg.get("source", ""), user, self.state)
        destination = _resolve(msg.get("destination", ""), user, self.state)

        def work() -> Message:
            if not os.path.lexists(source):
                raise ConnectError("not_found", f"source file not found: {source}")
            try:
                ensure_dirs(os.path.dirname(destination), user.uid, user.gid)
            except OSError as exc:
                raise ConnectError("internal", str(exc)) from exc
            try:
                os.rename(source, destination)
            except FileNotFoundError as exc:
                raise ConnectError("not_found", f"error renaming: {exc}") from exc
            except OSError as exc:
                raise ConnectError("internal", f"error renaming: {exc}") from exc
            return {"entry": entry_info(destination)}

        return await trio.to_thread.run_sync(work)

    async def list_dir(self, ctx: CallContext, msg: Message) -> Message:
        user = request_user(ctx, self.state)
        path = _resolve(msg.get("path", ""), user, self.state)
        try:
            depth = int(msg.get("depth", 0) or 0)
        except (TypeError, ValueError):
            raise ConnectError("invalid_argument", "depth: invalid integer") from None
        depth = depth or 1
        return {"entries": await trio.to_thread.run_sync(_list_dir, path, depth)}

    async def remove(self, ctx: CallContext, msg: Message) -> Message:
        user = request_user(ctx, self.state)
        path = _resolve(msg.get("path", ""), user, self.state)

        def work() -> None:
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                return
            try:
                if stat.S_ISDIR(st.st_mode):
                    import shutil

                    shutil.rmtree(path)
                else:
                    os.unlink(path)
            except FileNotFoundError:
                return
            except OSError as exc:
                raise ConnectError("internal", f"error removing file or directory: {exc}") from exc

        await trio.to_thread.run_sync(work)
        return {}

    # ----- watching -------------------------------------------------------
    async def watch_dir(self, ctx: CallContext, msg: Message, stream: ServerStream) -> None:
        user = request_user(ctx, self.state)
        root = _resolve(msg.get("path", ""), user, self.state)
        include_entry = bool(msg.get("includeEntry"))
        watch = _open_watch(root, bool(msg.get("recursive")), bool(msg.get("allowNetworkMounts")))
        interval = ctx.keepalive_interval()
        with watch:
            await stream.send({"start": {}})
            while True:
                batch = None
                with trio.move_on_after(interval if interval else float("inf")):
                    try:
                        batch = await watch.read()
                    except OSError as exc:
                        raise ConnectError("internal", f"watcher error: {exc}") from exc
                if batch is None:
                    await stream.send({"keepalive": {}})
                    continue
                for event in batch:
                    for fs_event in _fs_events(root, event, include_entry):
                        await stream.send({"filesystem": fs_event})

    async def create_watcher(self, ctx: CallContext, msg: Message) -> Message:
        user = request_user(ctx, self.state)
        root = _resolve(msg.get("path", ""), user, self.state)
        watch = _open_watch(root, bool(msg.get("recursive")), bool(msg.get("allowNetworkMounts")))
        watcher_id = "w" + os.urandom(10).hex()
        watcher = _PolledWatcher(root, watch, bool(msg.get("includeEntry")))
        self._watchers[watcher_id] = watcher
        self._nursery.start_soon(watcher.run)
        return {"watcherId": watcher_id}

    def _watcher(self, msg: Message) -> tuple[str, _PolledWatcher]:
        watcher_id = msg.get("watcherId", "")
        watcher = self._watchers.get(watcher_id)
        if watcher is None:
            raise ConnectError("not_found", f"watcher with id {watcher_id} not found")
        return watcher_id, watcher

    async def get_watcher_events(self, ctx: CallContext, msg: Message) -> Message:
        _, watcher = self._watcher(msg)
        await trio.lowlevel.checkpoint()  # let the watcher task take queued events
        if watcher.error is not None:
            raise watcher.error
        events, watcher.events = watcher.events, []
        return {"events": events}

    async def remove_watcher(self, ctx: CallContext, msg: Message) -> Message:
        watcher_id, watcher = self._watcher(msg)
        del self._watchers[watcher_id]
        watcher.close()
        return {}


def _list_dir(path: str, depth: int) -> list[dict[str, Any]]:
    try:
        resolved = os.path.realpath(path, strict=True)
    except FileNotFoundError as exc:
        raise ConnectError("not_found", f"directory not found: {exc}") from exc
    except OSError as exc:
        if "loop" in str(exc).lower():
            raise ConnectError("invalid_argument", f"cyclic symlink or chain >255 links at {path!r}") from exc
        raise ConnectError("internal", f"error resolving symlink: {exc}") from exc
    if not os.path.isdir(resolved):
        raise ConnectError("invalid_argument", f"path is not a directory: {path}")
    entries: list[dict[str, Any]] = []

    def walk(real_dir: str, shown_dir: str, level: int) -> None:
        try:
            with os.scandir(real_dir) as it:
                children = list(it)
        except OSError as exc:
            if level == 1:
                raise ConnectError("internal", f"error reading directory: {exc}") from exc
            return
        for child in children:
            shown = os.path.join(shown_dir, child.name)
            try:
                entries.append(entry_info(shown, child.name))
            except ConnectError:
                continue
            if level < depth and child.is_dir(follow_symlinks=False):
                walk(child.path, shown, level + 1)

    walk(resolved, path, 1)
    entries.sort(key=lambda e: (e.get("type") != DIRECTORY, e["name"].lower()))
    return entries
