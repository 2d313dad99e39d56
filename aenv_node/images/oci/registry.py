"""The Registry HTTP API v2 client of a pull: manifests resolved to the node's platform, blobs opened for download.

It is a thin layer on ``httpx.AsyncClient`` (which runs under Trio): what it adds is the registry's protocol.

- Transport policy: HTTPS (verified against the system's CAs plus an optional ``ca_bundle``) for every registry
  except those listed in ``images.insecure_registries``, which are spoken to over plain HTTP. A registry that is
  not listed but answers a TLS handshake with plain HTTP is refused with :class:`InsecureRegistryRefused`
  naming that key; no plain-HTTP request is ever sent to find out.
- Manifests are asked for with an ``Accept`` of the four manifest types the node understands; an index or
  manifest list is resolved to the entry for the node's platform (``linux/amd64`` unless told otherwise).
  Every manifest is hashed on arrival: one fetched by digest must hash to it, and the digest of the image
  manifest finally chosen is what the pull records, so a tag moved later cannot change what was pulled.
- Errors become the package's typed errors (:mod:`.errors`), each a one-line message naming the reference.
"""

from __future__ import annotations

import contextlib
import hashlib
import ssl
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import httpx

from .auth import RegistryAuth, TokenCache, error_message
from .errors import (
    DigestMismatch,
    ImageNotFound,
    InsecureRegistryRefused,
    ManifestInvalid,
    RegistryAuthError,
    RegistryError,
    RegistryUnreachable,
)
from .manifest import (
    ACCEPT_MANIFESTS,
    INDEX_TYPES,
    ImageManifest,
    Platform,
    choose_platform,
    media_type_of,
    parse_image_manifest,
    parse_index,
)
from .reference import ImageReference, normalize_registry

__all__ = ["MANIFEST_MAX", "RegistryClient", "ResolvedManifest"]

MANIFEST_MAX = 4 << 20  # what distribution accepts on push; anything bigger is not a manifest
_INDEX_DEPTH_MAX = 2  # an index may point at an index (rare), not further
_NOT_TLS_REASONS = ("WRONG_VERSION_NUMBER", "HTTP_REQUEST", "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG",
                    "UNKNOWN_PROTOCOL")
_NOT_FOUND_CODES = {"NAME_UNKNOWN", "MANIFEST_UNKNOWN", "NOT_FOUND"}


@dataclass(frozen=True)
class ResolvedManifest:
    """The image manifest chosen for a reference and platform, with the digests that pin it."""

    reference: ImageReference  # qualified, as asked (tag or digest)
    digest: str  # of the image manifest (the platform's, when the reference named an index)
    media_type: str
    manifest: ImageManifest
    index_digest: str | None  # of the index it was chosen from, if any


def _ssl_error(exc: BaseException) -> ssl.SSLError | None:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, ssl.SSLError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


class RegistryClient:
    """One pull's connection to registries: an ``httpx.AsyncClient`` plus its token cache and credentials.

    Use as ``async with RegistryClient(...) as client``. ``credentials`` (username, password) are offered to
    whichever registry challenges for them; they live only as long as this object.
    """

    def __init__(
        self,
        *,
        insecure_registries: Sequence[str] = (),
        credentials: tuple[str, str] | None = None,
        ca_bundle: Path | None = None,
        timeout: float = 60.0,
    ) -> None:
        self._insecure = frozenset(normalize_registry(r) for r in insecure_registries)
        self._credentials = credentials
        self._tokens = TokenCache()
        context = ssl.create_default_context()
        if ca_bundle is not None:
            context.load_verify_locations(cafile=str(ca_bundle))
        self._ca_bundle = ca_bundle
        self._http = httpx.AsyncClient(
            verify=context,
            follow_redirects=True,
            timeout=httpx.Timeout(timeout, connect=min(timeout, 15.0)),
            headers={"User-Agent": "aenv-node"},
        )

    async def __aenter__(self) -> RegistryClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    # -- plumbing -------------------------------------------------------------------------------------------

    def _base(self, ref: ImageReference) -> str:
        scheme = "http" if ref.registry in self._insecure else "https"
        return f"{scheme}://{ref.endpoint}/v2/{ref.repository}"

    def _auth(self, ref: ImageReference, subject: str) -> RegistryAuth:
        registry_insecure = ref.registry in self._insecure

        def allow_plain_http(netloc: str) -> bool:
            return registry_insecure or netloc in self._insecure

        return RegistryAuth(
            registry=ref.endpoint,
            scope=f"repository:{ref.repository}:pull",
            credentials=self._credentials,
            cache=self._tokens,
            allow_plain_http=allow_plain_http,
            subject=subject,
        )

    @contextlib.contextmanager
    def _transport_errors(self, ref: ImageReference, what: str) -> Iterator[None]:
        """httpx's transport errors as :class:`RegistryUnreachable` / :class:`InsecureRegistryRefused`."""
        try:
            yield
        except httpx.TimeoutException as e:
            raise RegistryUnreachable(f"{what}: registry {ref.registry} timed out ({type(e).__name__})") from e
        except httpx.TransportError as e:
            tls = _ssl_error(e)
            if tls is not None and ref.registry not in self._insecure:
                if isinstance(tls, ssl.SSLCertVerificationError):
                    hint = "" if self._ca_bundle is None else f" (CA bundle {self._ca_bundle} included)"
                    raise RegistryUnreachable(
                        f"{what}: TLS certificate of registry {ref.registry} not trusted{hint}: {tls.verify_message}"
                    ) from e
                if any(reason in str(tls) for reason in _NOT_TLS_REASONS):
                    raise InsecureRegistryRefused(
                        f"{what}: registry {ref.registry} does not speak TLS (it seems to serve plain HTTP); add "
                        f"{ref.registry} to images.insecure_registries to pull from it over plain HTTP"
                    ) from e
                raise RegistryUnreachable(f"{what}: TLS handshake with registry {ref.registry} failed: {tls}") from e
            detail = str(e) or type(e).__name__
            raise RegistryUnreachable(f"{what}: registry {ref.registry} unreachable: {detail}") from e

    def _status_error(self, ref: ImageReference, response: httpx.Response, what: str) -> Exception:
        """The typed error for a non-success answer (the body must have been read)."""
        message = error_message(response)
        codes: set[str] = set()
        try:
            errors = response.json().get("errors") or []
            codes = {str(e.get("code")) for e in errors if isinstance(e, dict)}
        except (ValueError, AttributeError, httpx.ResponseNotRead):
            pass
        if response.status_code == 404 or codes & _NOT_FOUND_CODES:
            return ImageNotFound(f"{what}: not found on {ref.registry} ({message})")
        if response.status_code in (401, 403):
            return RegistryAuthError(f"{what}: registry {ref.registry} denied access ({message})")
        return RegistryError(f"{what}: registry {ref.registry} answered {response.status_code}: {message}")

    # -- manifests ------------------------------------------------------------------------------------------

    async def _get_manifest(self, ref: ImageReference, reference: str, what: str) -> tuple[bytes, str, str]:
        """(bytes, media type, sha256 digest) of one manifest or index, verified when ``reference`` is a digest."""
        with self._transport_errors(ref, what):
            async with self._http.stream(
                "GET", f"{self._base(ref)}/manifests/{reference}", headers={"Accept": ACCEPT_MANIFESTS},
                auth=self._auth(ref, what),
            ) as response:
                if response.status_code != 200:
                    await response.aread()
                    raise self._status_error(ref, response, what)
                declared = response.headers.get("content-length")
                if declared is not None and declared.isdigit() and int(declared) > MANIFEST_MAX:
                    raise ManifestInvalid(f"{what}: manifest of {declared} bytes is larger than {MANIFEST_MAX}")
                body = bytearray()
                async for chunk in response.aiter_bytes():
                    body += chunk
                    if len(body) > MANIFEST_MAX:
                        raise ManifestInvalid(f"{what}: manifest larger than {MANIFEST_MAX} bytes")
                header_type = response.headers.get("content-type", "")
                header_digest = response.headers.get("docker-content-digest", "")
        data = bytes(body)
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        if reference.startswith("sha256:") and digest != reference:
            raise DigestMismatch(f"{what}: manifest fetched by digest hashes to {digest}")
        if header_digest.startswith("sha256:") and header_digest != digest:
            raise DigestMismatch(f"{what}: manifest hashes to {digest}, registry says {header_digest}")
        return data, media_type_of(data, header_type, what), digest

    async def resolve(self, ref: ImageReference, platform: Platform) -> ResolvedManifest:
        """The image manifest ``ref`` names for ``platform`` (through an index if it names one)."""
        what = str(ref)
        data, media_type, digest = await self._get_manifest(ref, ref.manifest_ref, what)
        index_digest: str | None = None
        depth = 0
        while media_type in INDEX_TYPES:
            depth += 1
            if depth > _INDEX_DEPTH_MAX:
                raise ManifestInvalid(f"{what}: indexes nested deeper than {_INDEX_DEPTH_MAX}")
            entry = choose_platform(parse_index(data, what), platform, what)
            index_digest = index_digest or digest
            what = f"{ref.with_digest(entry.digest)} ({platform} in {ref})"
            data, media_type, digest = await self._get_manifest(ref, entry.digest, what)
        return ResolvedManifest(
            reference=ref,
            digest=digest,
            media_type=media_type,
            manifest=parse_image_manifest(data, what),
            index_digest=index_digest,
        )

    # -- blobs ----------------------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def open_blob(self, ref: ImageReference, digest: str, *, offset: int = 0) -> AsyncIterator[httpx.Response]:
        """A streamed GET of a blob (``Range: bytes=<offset>-`` when resuming), redirects followed.

        Yields the response for 200, 206 and 416 (the caller decides what a resumed answer means); every other
        status raises. Transport errors inside the ``async with`` body (a connection cut mid-stream) are
        mapped to :class:`RegistryUnreachable` too.
        """
        headers = {"Range": f"bytes={offset}-"} if offset > 0 else {}
        what = f"blob {digest} of {ref.name}"
        with self._transport_errors(ref, what):
            async with self._http.stream(
                "GET", f"{self._base(ref)}/blobs/{digest}", headers=headers, auth=self._auth(ref, what)
            ) as response:
                if response.status_code not in (200, 206, 416):
                    await response.aread()
                    error = self._status_error(ref, response, what)
                    if isinstance(error, ImageNotFound):  # the manifest exists, so this is the registry's fault
                        error = RegistryError(f"{what}: listed in the manifest but missing on {ref.registry}")
                    raise error
                yield response
