"""``s3``: a repository in an S3-compatible object store (AWS S3, MinIO, Ceph RGW, ...), through boto3.

Keys are ``<prefix>layers/sha256/ab/<hex>`` (and ``<hex>.chunks``, its per-chunk checksum record, chunksums.py,
PUT before the layer is) and ``<prefix>manifests/<id>.json`` (the same layout as posix_fs),
plus ``<prefix>reuse/sha256/<hex>/<unique>``: empty marks recording that a publish reused a layer, which
garbage collection (gc.py) reads as the layer's age and removes once old (see ``touch_layer``).

Atomicity comes from S3 itself: an object becomes visible only when its PUT completes, or when
``CompleteMultipartUpload`` succeeds for a multipart upload.  Layers larger than ``multipart_threshold`` are
sent as a multipart upload (parts of ``part_size``, ``upload_concurrency`` in flight); the SHA-256 is computed
while the parts are read, and the upload is completed only if it matches the digest.  On any failure (digest
mismatch, an error from S3, cancellation) the upload is aborted, so no half-written layer and no pending
multipart upload remain; ``sweep_incomplete`` removes the leftovers of a process that died mid-upload.

Retries are botocore's own (``retries={"mode": "standard"|"adaptive", "max_attempts": N}``: exponential backoff
with jitter on throttling, 5xx and connection errors), so there is no hand-written retry loop here.  A boto3
low-level client is thread-safe, so one client is shared by every thread; ``max_pool_connections`` bounds the
connections it keeps.  All calls block: async callers use ``trio.to_thread.run_sync``.

Sandbox ownership records (base.py) change by conditional requests: ``PutObject`` with ``If-None-Match: *``
creates a record only if there is none, with ``If-Match: <etag>`` replaces exactly the version read, and
``DeleteObject`` with ``If-Match`` deletes exactly that version; a lost race is HTTP 412 (or 409 when two
conditional writes overlap on AWS).  Not every S3-compatible server honours these headers (AWS S3 does, as do
MinIO and moto; s3rver ignores them and answers 200), and a server that ignores them would let two nodes claim
the same sandbox.  So before the first ownership write the backend **probes** the server (a scratch object
under ``manifests/``: a second create must fail, a replace with a wrong ETag must fail) and, if the server
ignores the preconditions, raises ``OwnershipUnsupported`` for every ownership write.  If conditional PUT works
but conditional DELETE does not, a delete first fences the record with a conditional PUT (state
``deleting``), then deletes it: a concurrent claim either lands before the fence (the fence fails) or sees the
fence (a conflict).  ``conditional_writes=True`` skips the probe (a server known to honour them), ``False``
refuses ownership writes outright.
"""

from __future__ import annotations

import concurrent.futures
import datetime as dt
import hashlib
import os
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any, Callable, Iterator, Literal, Optional, TypeVar

import boto3
import botocore.config
import botocore.exceptions

from .base import (
    READ_CHUNK,
    ObjectInfo,
    Repository,
    check_digest,
    iter_file,
    layer_key,
    manifest_key,
    verify_digest,
)
from .chunksums import ChunkHasher, chunksums_key
from .errors import (
    LayerNotFound,
    ManifestNotFound,
    OwnershipChanged,
    OwnershipUnsupported,
    RepositoryError,
    RepositoryUnavailable,
)
from .ownership import RECORD_PREFIX, Ownership

if TYPE_CHECKING:  # boto3-stubs (the test extra): types only, nothing at run time
    from mypy_boto3_s3.type_defs import HeadObjectOutputTypeDef, MultipartUploadTypeDef

__all__ = ["S3Repository", "MIN_PART_SIZE"]

T = TypeVar("T")

#: S3's smallest allowed part (all but the last part of a multipart upload).
MIN_PART_SIZE = 5 * 1024 * 1024
_NOT_FOUND = {"404", "NoSuchKey", "NotFound", "NoSuchUpload"}
#: What a failed precondition looks like (412; AWS answers 409 when two conditional writes overlap).
_PRECONDITION = {"PreconditionFailed", "412", "ConditionalRequestConflict", "409"}


class S3Repository(Repository):
    """A repository in one S3 bucket under ``prefix``.

    ``endpoint_url``, ``bucket`` and ``region`` are explicit (no guessing from the environment).  Credentials may
    be given explicitly; if not, boto3's standard chain applies (environment, shared config, instance role).
    """

    kind = "s3"

    def __init__(
        self,
        *,
        bucket: str,
        region: str,
        endpoint_url: str | None = None,
        prefix: str = "",
        access_key_id: str | None = None,
        secret_access_key: str | None = None,
        session_token: str | None = None,
        multipart_threshold: int = 64 * 1024 * 1024,
        part_size: int = 16 * 1024 * 1024,
        upload_concurrency: int = 4,
        retry_mode: Literal["standard", "adaptive", "legacy"] = "standard",
        max_attempts: int = 5,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float = 60.0,
        max_pool_connections: int = 32,
        addressing_style: Literal["path", "virtual", "auto"] = "path",
        conditional_writes: Optional[bool] = None,
    ) -> None:
        if not bucket:
            raise ValueError("s3 repository: bucket is required")
        if not region:
            raise ValueError("s3 repository: region is required (e.g. 'us-east-1')")
        if part_size < MIN_PART_SIZE:
            raise ValueError(f"s3 part_size must be >= {MIN_PART_SIZE} bytes (S3's minimum), got {part_size}")
        if multipart_threshold < part_size:
            raise ValueError("s3 multipart_threshold must be >= part_size")
        if retry_mode not in ("standard", "adaptive", "legacy"):
            raise ValueError(f"s3 retry_mode must be standard or adaptive, got {retry_mode!r}")
        if prefix and not prefix.endswith("/"):
            prefix += "/"
        self.bucket = bucket
        self.region = region
        self.endpoint_url = endpoint_url or None
        self.prefix = prefix
        self.multipart_threshold = multipart_threshold
        self.part_size = part_size
        self.upload_concurrency = max(1, upload_concurrency)
        #: Does the server honour If-None-Match / If-Match on PutObject (None: probe before the first use)?
        self.conditional_writes = conditional_writes
        #: ... and If-Match on DeleteObject (known after the probe; if not, deletes are fenced first)?
        self.conditional_deletes: Optional[bool] = True if conditional_writes else None
        self._probe_lock = threading.Lock()
        config = botocore.config.Config(
            region_name=region,
            retries={"mode": retry_mode, "max_attempts": max_attempts},
            connect_timeout=connect_timeout_s,
            read_timeout=read_timeout_s,
            max_pool_connections=max_pool_connections,
            s3={"addressing_style": addressing_style},
        )
        session = boto3.session.Session(
            aws_access_key_id=access_key_id,
            aws_secret_access_key=secret_access_key,
            aws_session_token=session_token,
            region_name=region,
        )
        #: The boto3 client (thread-safe).  Exposed for tools and tests (e.g. to list multipart uploads).
        self.client = session.client("s3", endpoint_url=self.endpoint_url, config=config)

    def __repr__(self) -> str:
        return f"S3Repository(endpoint={self.endpoint_url!r}, bucket={self.bucket!r}, prefix={self.prefix!r})"

    # -- helpers ------------------------------------------------------------------------------------------
    def _where(self, key: str = "") -> str:
        return f"s3://{self.bucket}/{key or self.prefix}" + (f" at {self.endpoint_url}" if self.endpoint_url else "")

    def _call(self, what: str, fn: Callable[..., T], **kw: Any) -> T:
        """Call the client, turning botocore errors into repository errors (retries already happened)."""
        try:
            return fn(Bucket=self.bucket, **kw)
        except botocore.exceptions.ClientError as e:
            code = str(e.response.get("Error", {}).get("Code", ""))
            if code in _NOT_FOUND or code == "InvalidRange":  # the caller decides what these mean
                raise
            status = int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
            if status >= 500 or code in ("NoSuchBucket", "AccessDenied", "InvalidAccessKeyId",
                                         "SignatureDoesNotMatch", "SlowDown"):
                # the server erred (still, after botocore's retries) or refuses us: not this request's fault
                raise RepositoryUnavailable(f"{what} in {self._where(kw.get('Key', ''))}: {code}: {e}") from e
            raise RepositoryError(f"{what} in {self._where(kw.get('Key', ''))} failed: {e}") from e
        except botocore.exceptions.BotoCoreError as e:
            raise RepositoryUnavailable(f"{what}: cannot reach {self._where()}: {e}") from e

    @staticmethod
    def _is_not_found(e: botocore.exceptions.ClientError) -> bool:
        return str(e.response.get("Error", {}).get("Code", "")) in _NOT_FOUND

    def _layer_key(self, digest: str) -> str:
        return self.prefix + layer_key(digest)

    def _head(self, key: str) -> HeadObjectOutputTypeDef | None:
        try:
            return self._call("head", self.client.head_object, Key=key)
        except botocore.exceptions.ClientError as e:
            if self._is_not_found(e):
                return None
            raise

    def ensure_bucket(self) -> None:
        """Create the bucket if it does not exist (development set-ups; production buckets are provisioned)."""
        try:
            self._call("head bucket", self.client.head_bucket)
            return
        except (botocore.exceptions.ClientError, RepositoryUnavailable):
            pass
        kw: dict[str, Any] = {}
        if self.region != "us-east-1":
            kw["CreateBucketConfiguration"] = {"LocationConstraint": self.region}
        self._call("create bucket", self.client.create_bucket, **kw)

    # -- layers -------------------------------------------------------------------------------------------
    def put_layer(self, digest: str, path: str | os.PathLike[str]) -> str:
        check_digest(digest)
        key = self._layer_key(digest)
        if self.touch_layer(digest):
            return layer_key(digest)
        h = hashlib.sha256()
        sums = ChunkHasher()
        chunks = iter_file(path, READ_CHUNK)
        head = bytearray()
        exhausted = True
        for b in chunks:
            h.update(b)
            sums.update(b)
            head += b
            if len(head) > self.multipart_threshold:
                exhausted = False
                break
        source = os.fspath(path)
        if exhausted:
            verify_digest(digest, h, source)
            self._put_chunksums(sums, digest)
            self._call("put layer", self.client.put_object, Key=key, Body=bytes(head))
        else:
            self._multipart(key, digest, source, head, chunks, h, sums)
        return layer_key(digest)

    def _put_chunksums(self, sums: ChunkHasher, digest: str) -> None:
        """PUT the layer's checksum record (one PUT: visible whole or not at all) before the layer itself."""
        self._call("put checksum record", self.client.put_object, Key=self.prefix + chunksums_key(digest),
                   Body=sums.record(digest).encode())

    def _get_chunksums_bytes(self, digest: str) -> Optional[bytes]:
        key = self.prefix + chunksums_key(digest)
        try:
            r = self._call("read checksum record", self.client.get_object, Key=key)
        except botocore.exceptions.ClientError as e:
            if self._is_not_found(e):
                return None
            raise
        with r["Body"] as body:
            return body.read()

    def _multipart(self, key: str, digest: str, source: str, head: bytearray, rest: Iterator[bytes],
                   h: hashlib._Hash, sums: ChunkHasher) -> None:
        upload_id = self._call("start multipart upload", self.client.create_multipart_upload, Key=key)["UploadId"]
        try:
            parts: dict[int, str] = {}

            def send(number: int, data: bytes) -> None:
                r = self._call(
                    "upload part", self.client.upload_part, Key=key, UploadId=upload_id, PartNumber=number, Body=data
                )
                parts[number] = r["ETag"]

            def blocks() -> Iterator[bytes]:
                buf = head
                for b in rest:
                    h.update(b)
                    sums.update(b)
                    buf += b
                    while len(buf) >= self.part_size:
                        yield bytes(buf[: self.part_size])
                        del buf[: self.part_size]
                if buf:
                    yield bytes(buf)

            # The pool is owned and joined here: at most `upload_concurrency` parts in flight (bounded memory).
            with concurrent.futures.ThreadPoolExecutor(self.upload_concurrency, thread_name_prefix="s3-part") as pool:
                pending: set[concurrent.futures.Future[None]] = set()
                try:
                    for number, data in enumerate(blocks(), start=1):
                        if len(pending) >= self.upload_concurrency:
                            done, pending = concurrent.futures.wait(
                                pending, return_when=concurrent.futures.FIRST_COMPLETED
                            )
                            for f in done:
                                f.result()
                        pending.add(pool.submit(send, number, data))
                    for f in concurrent.futures.as_completed(pending):
                        f.result()
                finally:
                    for f in pending:
                        f.cancel()
            verify_digest(digest, h, source)
            self._put_chunksums(sums, digest)
            self._call(
                "complete multipart upload",
                self.client.complete_multipart_upload,
                Key=key,
                UploadId=upload_id,
                MultipartUpload={"Parts": [{"PartNumber": n, "ETag": parts[n]} for n in sorted(parts)]},
            )
        except BaseException:
            try:
                self._call("abort multipart upload", self.client.abort_multipart_upload, Key=key, UploadId=upload_id)
            except Exception:  # the original error matters more; sweep_incomplete() removes it later
                pass
            raise

    def read_range(self, digest: str, offset: int, length: int) -> bytes:
        if offset < 0 or length < 0:
            raise ValueError(f"bad range offset={offset} length={length}")
        key = self._layer_key(digest)
        if length == 0:
            if self._head(key) is None:
                raise LayerNotFound(digest, self._where(key))
            return b""
        try:
            r = self._call("read", self.client.get_object, Key=key, Range=f"bytes={offset}-{offset + length - 1}")
        except botocore.exceptions.ClientError as e:
            code = str(e.response.get("Error", {}).get("Code", ""))
            if code == "InvalidRange":  # offset at/after the end
                if self._head(key) is None:
                    raise LayerNotFound(digest, self._where(key)) from None
                return b""
            if self._is_not_found(e):
                raise LayerNotFound(digest, self._where(key)) from None
            raise
        try:
            data = r["Body"].read()
        except botocore.exceptions.BotoCoreError as e:
            raise RepositoryUnavailable(f"reading {self._where(key)}: {e}") from e
        finally:
            r["Body"].close()
        return data[:length]

    def layer_size(self, digest: str) -> int:
        key = self._layer_key(digest)
        head = self._head(key)
        if head is None:
            raise LayerNotFound(digest, self._where(key))
        return int(head["ContentLength"])

    def has_layer(self, digest: str) -> bool:
        return self._head(self._layer_key(digest)) is not None

    def delete_layer(self, digest: str) -> None:
        self._call("delete layer", self.client.delete_object, Key=self._layer_key(digest))
        self._call("delete checksum record", self.client.delete_object, Key=self.prefix + chunksums_key(digest))

    def _list(self, sub: str) -> list[str]:
        return [rel for rel, _ in self._list_objects(sub)]

    def _list_objects(self, sub: str) -> list[tuple[str, ObjectInfo]]:
        """(key relative to ``prefix + sub``, LastModified and Size) of every object under it."""
        pfx = self.prefix + sub
        out: list[tuple[str, ObjectInfo]] = []
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=pfx)
        try:
            for page in pages:
                out.extend((o["Key"][len(pfx) :], ObjectInfo(o["LastModified"].timestamp(), int(o["Size"])))
                           for o in page.get("Contents", ()))
        except botocore.exceptions.BotoCoreError as e:
            raise RepositoryUnavailable(f"listing {self._where(pfx)}: {e}") from e
        except botocore.exceptions.ClientError as e:
            raise RepositoryError(f"listing {self._where(pfx)}: {e}") from e
        return out

    # -- object ages (gc.py) ------------------------------------------------------------------------------
    # A reuse is recorded as a *reuse mark*: an empty object ``<prefix>reuse/sha256/<hex>/<unique>`` whose
    # LastModified is the time of the reuse; a layer's age is that of its newest write or mark.  Why not
    # refresh the layer object itself (CopyObject onto itself with MetadataDirective=REPLACE)?  That copies
    # the object's bytes server-side: layers are up to gigabytes (a template's RAM image is reused by every
    # publish of every sandbox made from it), a copy takes seconds per GiB and CopyObject stops at 5 GiB.
    # A mark is one empty PUT whatever the layer's size.  Each mark has a unique key, so the collection can
    # remove old marks without racing a new reuse (which writes a new key, never overwrites the old one).
    def _mark_prefix(self, digest: str) -> str:
        return f"reuse/sha256/{check_digest(digest)}/"

    def touch_layer(self, digest: str) -> bool:
        key = self._layer_key(digest)
        if self._head(key) is None:
            return False  # absent: no mark (the caller uploads it, and a new layer is young anyway)
        mark = f"{self.prefix}{self._mark_prefix(digest)}{time.time_ns():020d}-{uuid.uuid4().hex[:8]}"
        self._call("mark layer reuse", self.client.put_object, Key=mark, Body=b"")
        # present after the mark: a collection that re-checks from now on sees the mark; one that deleted
        # the layer before this check makes this return False, and the caller uploads it again
        return self._head(key) is not None

    def _marks(self, sub: str = "") -> dict[str, list[tuple[str, ObjectInfo]]]:
        """Reuse marks by layer hex: [(key relative to the prefix, info)]."""
        out: dict[str, list[tuple[str, ObjectInfo]]] = {}
        for rel, info in self._list_objects("reuse/sha256/" + sub):
            full = "reuse/sha256/" + sub + rel
            parts = full.split("/")
            if len(parts) == 4 and len(parts[2]) == 64:
                out.setdefault(parts[2], []).append((full, info))
        return out

    @staticmethod
    def _aged(info: ObjectInfo, marks: list[tuple[str, ObjectInfo]]) -> ObjectInfo:
        newest = max([info.mtime] + [m.mtime for _, m in marks])
        return ObjectInfo(newest, info.size)

    def layer_infos(self) -> dict[str, ObjectInfo]:
        marks = self._marks()
        out: dict[str, ObjectInfo] = {}
        for rel, info in self._list_objects("layers/sha256/"):
            name = rel.rsplit("/", 1)[-1]
            if len(name) == 64:
                out["sha256:" + name] = self._aged(info, marks.get(name, []))
        return out

    def layer_info(self, digest: str) -> Optional[ObjectInfo]:
        head = self._head(self._layer_key(digest))
        if head is None:
            return None
        hexd = check_digest(digest)
        marks = self._marks(hexd + "/").get(hexd, [])
        return self._aged(ObjectInfo(head["LastModified"].timestamp(), int(head["ContentLength"])), marks)

    def manifest_infos(self) -> dict[str, ObjectInfo]:
        return {rel[: -len(".json")]: info for rel, info in self._list_objects("manifests/")
                if rel.endswith(".json") and "/" not in rel and not rel.startswith(".")}

    def manifest_info(self, manifest_id: str) -> Optional[ObjectInfo]:
        head = self._head(self.prefix + manifest_key(manifest_id))
        if head is None:
            return None
        return ObjectInfo(head["LastModified"].timestamp(), int(head["ContentLength"]))

    def sweep_reuse_marks(self, older_than: float, *, dry_run: bool = False) -> int:
        old = [key for marks in self._marks().values() for key, info in marks if info.mtime < older_than]
        if not dry_run:
            for i in range(0, len(old), 1000):  # DeleteObjects takes up to 1000 keys
                self._call("delete reuse marks", self.client.delete_objects,
                           Delete={"Objects": [{"Key": self.prefix + k} for k in old[i:i + 1000]], "Quiet": True})
        return len(old)

    def list_layers(self) -> list[str]:
        out = []
        for rel in self._list("layers/sha256/"):
            name = rel.rsplit("/", 1)[-1]
            if len(name) == 64:
                out.append("sha256:" + name)
        return sorted(out)

    # -- manifests ----------------------------------------------------------------------------------------
    def _put_manifest_bytes(self, manifest_id: str, data: bytes) -> None:
        self._call(
            "put manifest",
            self.client.put_object,
            Key=self.prefix + manifest_key(manifest_id),
            Body=data,
            ContentType="application/json",
        )

    def _get_manifest_bytes(self, manifest_id: str) -> bytes:
        key = self.prefix + manifest_key(manifest_id)
        try:
            r = self._call("get manifest", self.client.get_object, Key=key)
        except botocore.exceptions.ClientError as e:
            if self._is_not_found(e):
                raise ManifestNotFound(manifest_id, self._where(key)) from None
            raise
        with r["Body"] as body:
            return body.read()

    def has_manifest(self, manifest_id: str) -> bool:
        return self._head(self.prefix + manifest_key(manifest_id)) is not None

    def list_manifests(self) -> list[str]:
        return sorted(r[: -len(".json")] for r in self._list("manifests/") if r.endswith(".json") and "/" not in r)

    def delete_manifest(self, manifest_id: str) -> None:
        self._call("delete manifest", self.client.delete_object, Key=self.prefix + manifest_key(manifest_id))

    # -- compare-and-swap of ownership records -------------------------------------------------------------
    @staticmethod
    def _code(e: botocore.exceptions.ClientError) -> str:
        return str(e.response.get("Error", {}).get("Code", ""))

    def _get_versioned(self, manifest_id: str) -> Optional[tuple[bytes, str]]:
        key = self.prefix + manifest_key(manifest_id)
        try:
            r = self._call("get manifest", self.client.get_object, Key=key)
        except botocore.exceptions.ClientError as e:
            if self._is_not_found(e):
                return None
            raise
        with r["Body"] as body:
            return body.read(), str(r["ETag"])

    def _conditional(self, what: str, fn: Callable[..., T], sandbox_id: str, **kw: Any) -> T:
        try:
            return self._call(what, fn, **kw)
        except botocore.exceptions.ClientError as e:
            if self._is_not_found(e):
                raise OwnershipChanged(sandbox_id, "it was removed meanwhile") from None
            raise
        except RepositoryError as e:
            cause = e.__cause__
            if isinstance(cause, botocore.exceptions.ClientError) and self._code(cause) in _PRECONDITION:
                raise OwnershipChanged(sandbox_id, f"{what}: {self._code(cause)}") from None
            raise

    def _put_if(self, manifest_id: str, data: bytes, expect_token: Optional[str]) -> str:
        self.require_conditional_writes()
        cond = {"IfNoneMatch": "*"} if expect_token is None else {"IfMatch": expect_token}
        r = self._conditional("put ownership record", self.client.put_object,
                              manifest_id.removeprefix(RECORD_PREFIX), Key=self.prefix + manifest_key(manifest_id),
                              Body=data, ContentType="application/json", **cond)
        return str(r["ETag"])

    def _delete_if(self, manifest_id: str, expect_token: str) -> None:
        self.require_conditional_writes()
        key = self.prefix + manifest_key(manifest_id)
        sid = manifest_id.removeprefix(RECORD_PREFIX)
        if not self.conditional_deletes:
            # fence: from here on nobody else can claim it (and our delete removes only our fence)
            got = self._get_versioned(manifest_id)
            if got is None or got[1] != expect_token:
                raise OwnershipChanged(sid, "it changed before the delete")
            fence = Ownership.parse(sid, *got).fenced()
            expect_token = self._put_if(manifest_id, fence.encode(), expect_token)
            self._call("delete ownership record", self.client.delete_object, Key=key)
            return
        self._conditional("delete ownership record", self.client.delete_object, sid, Key=key, IfMatch=expect_token)

    def require_conditional_writes(self) -> None:
        """Raise ``OwnershipUnsupported`` unless the server honours conditional PUTs (probed once)."""
        with self._probe_lock:
            if self.conditional_writes is None:
                self.conditional_writes, self.conditional_deletes = self._probe()
        if not self.conditional_writes:
            raise OwnershipUnsupported(
                f"the S3 server at {self.endpoint_url or 'AWS'} (bucket {self.bucket}) ignores conditional writes "
                "(PutObject If-None-Match / If-Match): sandbox ownership cannot be enforced on it, so two nodes "
                "could run the same sandbox. Use a server that honours them (AWS S3, MinIO, Ceph RGW >= 19) or a "
                "posix_fs repository")

    def _probe(self) -> tuple[bool, bool]:
        """(conditional PUT honoured, conditional DELETE honoured), found with a scratch object."""
        key = f"{self.prefix}manifests/.cas-probe-{uuid.uuid4().hex}"

        def put(body: bytes, **cond: Any) -> bool:
            try:
                self._call("probe conditional write", self.client.put_object, Key=key, Body=body, **cond)
                return True
            except botocore.exceptions.ClientError as e:
                if self._is_not_found(e):
                    return False
                raise
            except RepositoryError as e:
                cause = e.__cause__
                if isinstance(cause, botocore.exceptions.ClientError) and \
                        (self._code(cause) in _PRECONDITION or self._code(cause) in ("NotImplemented", "InvalidArgument")):
                    return False
                raise

        try:
            if not put(b"1", IfNoneMatch="*"):
                return False, False
            puts = not put(b"2", IfNoneMatch="*") and not put(b"3", IfMatch='"00000000000000000000000000000000"')
            deletes = False
            if puts:
                try:
                    self._call("probe conditional delete", self.client.delete_object, Key=key,
                               IfMatch='"00000000000000000000000000000000"')
                except RepositoryError as e:
                    cause = e.__cause__
                    deletes = isinstance(cause, botocore.exceptions.ClientError) and \
                        self._code(cause) in _PRECONDITION
                deletes = deletes and self._head(key) is not None
            return puts, deletes
        finally:
            try:
                self._call("remove probe", self.client.delete_object, Key=key)
            except Exception:
                pass

    # -- housekeeping -------------------------------------------------------------------------------------
    def pending_uploads(self) -> list[MultipartUploadTypeDef]:
        """Multipart uploads started under this prefix and neither completed nor aborted."""
        out: list[MultipartUploadTypeDef] = []
        pages = self.client.get_paginator("list_multipart_uploads").paginate(Bucket=self.bucket, Prefix=self.prefix)
        try:
            for page in pages:
                out.extend(page.get("Uploads", ()))
        except botocore.exceptions.BotoCoreError as e:
            raise RepositoryUnavailable(f"listing uploads in {self._where()}: {e}") from e
        return out

    def sweep_incomplete(self, older_than_s: float = 3600.0) -> int:
        cutoff = dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=older_than_s)
        removed = 0
        for u in self.pending_uploads():
            initiated = u.get("Initiated")
            if initiated is not None and initiated > cutoff:
                continue
            try:
                self._call("abort upload", self.client.abort_multipart_upload, Key=u["Key"], UploadId=u["UploadId"])
                removed += 1
            except botocore.exceptions.ClientError as e:
                if not self._is_not_found(e):
                    raise
        return removed

    def close(self) -> None:
        self.client.close()
