"""``/files``: download (GET) and upload (POST) of whole files over plain HTTP.

Downloads stream the file, gzip-compressed when the client accepts it.
Uploads take ``multipart/form-data`` (field ``file``, the filename being the
target path when ``?path=`` is absent) or a raw ``application/octet-stream``
body, optionally ``Content-Encoding: gzip``; files are created with their
parent directories owned by the requesting user, and ``X-Metadata-<key>``
headers replace the file's ``user.e2b.<key>`` extended attributes. Errors are
JSON ``{"code": <status>, "message": ...}`` with E2B envd's statuses (the SDK
maps 400, 401, 404 and 507 to its exceptions).
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
import time
import zlib
from collections.abc import Awaitable, Callable
from typing import Any, BinaryIO

import trio

from .entry import read_metadata, write_metadata
from .errors import HttpError
from .http import Request
from .multipart import MultipartError, MultipartReader, boundary_of
from .state import EnvdState
from .users import UnknownUser, User, ensure_dirs, resolve_path

_READ_CHUNK = 256 * 1024
_WRITE_BATCH = 1024 * 1024
_METADATA_PREFIX = "x-metadata-"
_METADATA_KEY = re.compile(r"\A[A-Za-z0-9!#$%&'*+\-.^_`|~]+\Z")
_METADATA_VALUE = re.compile(r"\A[\x20-\x7e]*\Z")


def _json(body: Any) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


async def send_error(request: Request, error: HttpError) -> None:
    await request.respond(error.status, [("content-type", "application/json")], _json(error.to_json()))


class FilesApi:
    def __init__(self, state: EnvdState) -> None:
        self.state = state

    def _user(self, request: Request, operation: str) -> tuple[User, str]:
        path = request.query.get("path", "")
        username = request.query.get("username")
        self.state.check_signing(
            header_token=request.headers.get("x-access-token"),
            signature=request.query.get("signature"),
            expiration=request.query.get("signature_expiration"),
            username=username,
            path=path,
            operation=operation,
        )
        name = username or self.state.default_user
        if not name:
            raise HttpError(400, "no user specified")
        try:
            return self.state.user(name), path
        except UnknownUser:
            raise HttpError(401, f"error looking up user '{name}': user: unknown user {name}") from None

    def _resolve(self, path: str, user: User) -> str:
        try:
            return resolve_path(path, user, self.state.default_workdir)
        except ValueError as exc:
            raise HttpError(400, f"error expanding and resolving path '{path}': {exc}") from exc

    # ----- GET -----------------------------------------------------------------
    async def get(self, request: Request) -> None:
        try:
            user, path = self._user(request, "read")
            resolved = self._resolve(path, user)
            try:
                st = os.stat(resolved)
            except (FileNotFoundError, NotADirectoryError):  # a parent that is a file: no such path either
                raise HttpError(404, f"path '{resolved}' does not exist") from None
            except OSError as exc:
                raise HttpError(500, f"error checking if path exists '{resolved}': {exc}") from exc
            if stat.S_ISDIR(st.st_mode):
                raise HttpError(400, f"path '{resolved}' is a directory")
            gzip_it = choose_encoding(request.headers.get("accept-encoding", "")) == "gzip"
            if request.headers.get("range"):
                gzip_it = False
            try:
                handle: BinaryIO = await trio.to_thread.run_sync(open, resolved, "rb")
            except OSError as exc:
                raise HttpError(500, f"error opening file '{resolved}': {exc}") from exc
        except HttpError as error:
            await send_error(request, error)
            return
        try:
            import mimetypes  # lazily: it costs start-up time and only downloads need it

            ctype = mimetypes.guess_type(path)[0] or "application/octet-stream"
            headers = [
                ("content-type", ctype),
                ("vary", "Accept-Encoding"),
                ("last-modified", time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(st.st_mtime))),
            ]
            start, end = 0, st.st_size
            status = 200
            rng = _parse_range(request.headers.get("range"), st.st_size)
            if isinstance(rng, str):  # "invalid"
                await request.respond(416, [("content-range", f"bytes */{st.st_size}")])
                return
            if rng is not None:
                start, end = rng
                status = 206
                headers.append(("content-range", f"bytes {start}-{end - 1}/{st.st_size}"))
            if gzip_it:
                headers.append(("content-encoding", "gzip"))
            else:
                headers.append(("accept-ranges", "bytes"))
                headers.append(("content-length", str(end - start)))
            await request.start_response(status, headers)
            if start:
                await trio.to_thread.run_sync(handle.seek, start)
            remaining = end - start
            compressor = zlib.compressobj(6, zlib.DEFLATED, 31) if gzip_it else None
            while remaining > 0 or gzip_it:
                want = min(_READ_CHUNK, remaining) if not gzip_it else _READ_CHUNK
                data = await trio.to_thread.run_sync(handle.read, want)
                if not data:
                    break
                remaining -= len(data)
                if compressor is not None:
                    data = compressor.compress(data)
                await request.send(data)
            if compressor is not None:
                await request.send(compressor.flush())
            await request.end_response()
        finally:
            handle.close()

    # ----- POST ----------------------------------------------------------------
    async def post(self, request: Request) -> None:
        try:
            user, path = self._user(request, "write")
            metadata = _metadata(request)
            receive = _body_reader(request)
            ctype = request.headers.get("content-type", "")
            media = ctype.split(";")[0].strip().lower()
            if media == "application/octet-stream":
                if not request.query.get("path"):
                    raise HttpError(400, "path query parameter is required for raw body upload")
                target = self._resolve(path, user)
                await _write_file(target, receive, user, metadata)
                entries = [_written(target)]
            elif media.startswith("multipart/"):
                entries = await self._multipart(request, receive, ctype, user, metadata)
            else:
                raise HttpError(400, f"unsupported content type: {ctype}, expected multipart/form-data or application/octet-stream")
        except HttpError as error:
            await send_error(request, error)
            return
        await request.respond(200, [("content-type", "application/json")], _json(entries))

    async def _multipart(
        self, request: Request, receive: Callable[[], Awaitable[bytes]], ctype: str,
        user: User, metadata: dict[str, str] | None,
    ) -> list[dict[str, Any]]:
        try:
            reader = MultipartReader(receive, boundary_of(ctype))
        except MultipartError as exc:
            raise HttpError(500, f"error parsing multipart form: {exc}") from exc
        entries: list[dict[str, Any]] = []
        query_path = request.query.get("path")
        while True:
            try:
                part = await reader.next_part()
            except MultipartError as exc:
                raise HttpError(500, f"error reading form: {exc}") from exc
            if part is None:
                return entries
            if part.name != "file":
                continue
            raw = query_path if query_path else (part.filename or "")
            target = self._resolve(raw, user)
            if any(e["path"] == target for e in entries):
                others = [e["path"] for e in entries if e["path"] != target]
                message = (f"you cannot upload multiple files to the same path '{target}' in one upload "
                           "request, only the first specified file was uploaded")
                if len(others) > 1:
                    message += f", also the following files were uploaded: {', '.join(others)}"
                raise HttpError(400, message)

            async def part_chunks() -> bytes:
                try:
                    return await part.read_chunk()
                except MultipartError as exc:
                    raise HttpError(500, f"error reading form: {exc}") from exc

            await _write_file(target, part_chunks, user, metadata)
            entries.append(_written(target))


def _written(path: str) -> dict[str, Any]:
    entry: dict[str, Any] = {"name": os.path.basename(path), "type": "file", "path": path}
    metadata = read_metadata(path)
    if metadata:
        entry["metadata"] = metadata
    return entry


def _metadata(request: Request) -> dict[str, str] | None:
    metadata: dict[str, str] = {}
    for name, value in request.header_list:
        if name.startswith(_METADATA_PREFIX):
            key = name[len(_METADATA_PREFIX):].lower()
            if not key or key in metadata:
                continue
            if not _METADATA_KEY.match(key):
                raise HttpError(400, f"invalid metadata: invalid key {key!r}")
            if not _METADATA_VALUE.match(value):
                raise HttpError(400, f"invalid metadata: invalid value for key {key!r}")
            metadata[key] = value
    return metadata or None


def _body_reader(request: Request) -> Callable[[], Awaitable[bytes]]:
    encoding = request.headers.get("content-encoding", "").strip().lower()
    if encoding in ("", "identity"):
        return request.receive_some
    if encoding != "gzip":
        raise HttpError(400, f"error decompressing request body: unsupported Content-Encoding: {encoding}")
    decompressor = zlib.decompressobj(31)

    async def receive() -> bytes:
        while True:
            if decompressor.eof:
                return b""
            chunk = await request.receive_some()
            if not chunk:
                tail = decompressor.flush()
                if not decompressor.eof:
                    raise HttpError(400, "error decompressing request body: unexpected EOF")
                return tail
            try:
                data = decompressor.decompress(chunk)
            except zlib.error as exc:
                raise HttpError(400, f"error decompressing request body: {exc}") from exc
            if data:
                return data

    return receive


def choose_encoding(accept: str) -> str:
    """"gzip" or "identity" for an Accept-Encoding header, as E2B's envd picks it.

    Highest quality first; identity stays acceptable unless refused with q=0;
    HttpError 400 when nothing acceptable is left.
    """
    if not accept.strip():
        return "identity"
    offers: list[tuple[str, float]] = []
    for item in accept.split(","):
        coding, _, params = item.strip().partition(";")
        q = 1.0
        for param in params.split(";"):
            param = param.strip()
            if param.lower().startswith("q="):
                try:
                    q = float(param[2:])
                except ValueError:
                    pass
        offers.append((coding.strip().lower(), q))
    offers.sort(key=lambda offer: -offer[1])
    identity_refused = any(coding == "identity" and q == 0 for coding, q in offers)
    for coding, q in offers:
        if q == 0:
            continue
        if coding == "identity":
            return "identity"
        if coding == "*":
            return "gzip" if identity_refused else "identity"
        if coding == "gzip":
            return "gzip"
    if not identity_refused:
        return "identity"
    raise HttpError(400, "error parsing Accept-Encoding: no acceptable encoding found, supported: [gzip]")


def _parse_range(header: str | None, size: int) -> tuple[int, int] | str | None:
    """A single ``bytes=a-b`` range as [start, end); None if absent, "invalid" if unsatisfiable."""
    if not header:
        return None
    m = re.fullmatch(r"\s*bytes=(\d*)-(\d*)\s*", header)
    if not m or (m.group(1) == "" and m.group(2) == ""):
        return None  # multi-range or garbage: serve the whole file
    if m.group(1) == "":
        length = int(m.group(2))
        if length == 0:
            return "invalid"
        return max(0, size - length), size
    start = int(m.group(1))
    end = int(m.group(2)) + 1 if m.group(2) else size
    if start >= size:
        return "invalid"
    return start, min(end, size)


async def _write_file(
    path: str, receive: Callable[[], Awaitable[bytes]], user: User, metadata: dict[str, str] | None,
) -> None:
    """Create/truncate ``path`` owned by ``user`` and fill it from ``receive``."""

    def open_target() -> BinaryIO:
        try:
            ensure_dirs(os.path.dirname(path), user.uid, user.gid)
        except NotADirectoryError as exc:  # a parent is a file: the client's mistake, not the guest's
            raise HttpError(400, f"error ensuring directories: {exc}") from exc
        except OSError as exc:
            raise HttpError(500, f"error ensuring directories: {exc}") from exc
        try:
            st = os.stat(path)
        except FileNotFoundError:
            st = None
        except OSError as exc:
            raise HttpError(500, f"error getting file info: {exc}") from exc
        if st is not None and stat.S_ISDIR(st.st_mode):
            raise HttpError(400, f"path is a directory: {path}")
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise HttpError(507, f"not enough inodes available: {exc}") from exc
            raise HttpError(500, f"error opening file: {exc}") from exc
        try:
            os.fchown(fd, user.uid, user.gid)
        except OSError as exc:
            os.close(fd)
            raise HttpError(500, f"error changing file ownership: {exc}") from exc
        return os.fdopen(fd, "wb", buffering=0)

    handle = await trio.to_thread.run_sync(open_target)

    def write_all(data: bytes) -> None:
        view = memoryview(data)
        while view:
            written = handle.write(view)
            view = view[written:]

    try:
        pending: list[bytes] = []
        size = 0
        while True:
            chunk = await receive()
            if chunk:
                pending.append(chunk)
                size += len(chunk)
            if size >= _WRITE_BATCH or (not chunk and pending):
                data = b"".join(pending)
                pending.clear()
                size = 0
                try:
                    await trio.to_thread.run_sync(write_all, data)
                except OSError as exc:
                    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                        raise HttpError(507, "not enough disk space available") from exc
                    raise HttpError(500, f"error writing file: {exc}") from exc
            if not chunk:
                break
        try:
            await trio.to_thread.run_sync(write_metadata, path, metadata)
        except OSError as exc:
            if exc.errno in (errno.ENOTSUP, errno.EOPNOTSUPP):
                pass  # e.g. /proc, /sys: the body is written; metadata is not kept
            elif exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise HttpError(507, f"not enough space for file metadata: {exc}") from exc
            else:
                raise HttpError(500, f"error writing file metadata: {exc}") from exc
    finally:
        handle.close()
