"""Registry HTTP API v2 authentication, as an ``httpx.Auth`` flow (httpx has no registry auth of its own).

The flow is the one Docker's and containerd's clients follow:

1. Send the request anonymously (or with what an earlier request of this pull obtained for the same registry
   and scope).
2. On ``401``, read ``WWW-Authenticate``. ``Basic realm=...``: resend with the pull's username and password.
   ``Bearer realm=...,service=...,scope=...``: GET a token from the realm (``?service=&scope=``, with the
   username and password as Basic credentials when the pull has them, anonymously otherwise), take ``token``
   or ``access_token`` from its JSON, resend with ``Authorization: Bearer <token>``.
3. Resend once only: a second ``401`` means the credentials are wrong (or missing) and becomes a
   :class:`RegistryAuthError` carrying the registry's (or token server's) own message.

What a 401 sends back has a grammar (RFC 7235 challenges: ``scheme k=v, k="quoted", ...``, possibly several
challenges in one header), parsed here by hand because neither httpx nor the standard library exposes a parser.

Tokens and Basic headers are cached per (registry, scope) in a :class:`TokenCache` that lives for one pull, so a
pull asks the token server once per repository, and an expired token simply costs one more 401 round. The
credentials themselves are held only by the flow objects of that pull and are never written anywhere.

Redirects (registries send blob downloads to object storage) are followed by httpx, which drops the
``Authorization`` header whenever the redirect leaves the registry's origin, so credentials never reach
another host. A token realm on plain HTTP is refused unless the caller's ``allow_plain_http`` accepts its host
(the registry client allows it for realms of registries listed in ``images.insecure_registries``).
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import AsyncGenerator, Callable, Generator
from dataclasses import dataclass, field

import httpx

from .errors import ImageNotFound, InsecureRegistryRefused, RegistryAuthError, RegistryUnreachable

__all__ = ["Challenge", "RegistryAuth", "TokenCache", "error_message", "parse_www_authenticate"]

_TOKEN = r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
_AUTH_PARAM_RE = re.compile(rf'\s*({_TOKEN})\s*=\s*(?:"((?:[^"\\]|\\.)*)"|({_TOKEN}|[^,\s]*))\s*(?:,|$)')
_SCHEME_RE = re.compile(rf"\s*,?\s*({_TOKEN})(?:\s+|$)")


@dataclass(frozen=True)
class Challenge:
    scheme: str  # lower-cased: "basic" or "bearer" (anything else is ignored by the flow)
    params: dict[str, str] = field(default_factory=dict)  # keys lower-cased


def parse_www_authenticate(headers: list[str]) -> list[Challenge]:
    """Every challenge in the ``WWW-Authenticate`` header values, in order; malformed tails are dropped."""
    challenges: list[Challenge] = []
    for value in headers:
        pos = 0
        while pos < len(value):
            m = _SCHEME_RE.match(value, pos)
            if not m:
                break
            scheme, pos = m.group(1).lower(), m.end()
            params: dict[str, str] = {}
            while pos < len(value):
                p = _AUTH_PARAM_RE.match(value, pos)
                if not p:
                    break
                quoted, bare = p.group(2), p.group(3)
                params[p.group(1).lower()] = re.sub(r"\\(.)", r"\1", quoted) if quoted is not None else bare
                pos = p.end()
            challenges.append(Challenge(scheme, params))
    return challenges


def error_message(response: httpx.Response) -> str:
    """The human part of a registry or token server error body (read before calling), else the status."""
    try:
        doc = json.loads(response.content)
    except (ValueError, httpx.ResponseNotRead):
        doc = None
    if isinstance(doc, dict):
        errors = doc.get("errors")
        if isinstance(errors, list) and errors and isinstance(errors[0], dict):
            parts = [str(e.get("message") or e.get("code") or "") for e in errors if isinstance(e, dict)]
            return "; ".join(p for p in parts if p) or response.reason_phrase
        for key in ("details", "detail", "message", "error"):
            if isinstance(doc.get(key), str) and doc[key]:
                return str(doc[key])
    try:
        text = response.text.strip()
    except httpx.ResponseNotRead:
        text = ""
    if text and len(text) < 200 and "\n" not in text:
        return text
    return f"HTTP {response.status_code} {response.reason_phrase}"


class TokenCache:
    """``Authorization`` values obtained during one pull, by (registry endpoint, scope)."""

    def __init__(self) -> None:
        self._values: dict[tuple[str, str], str] = {}

    def get(self, registry: str, scope: str) -> str | None:
        return self._values.get((registry, scope))

    def put(self, registry: str, scope: str, authorization: str) -> None:
        self._values[(registry, scope)] = authorization

    def drop(self, registry: str, scope: str) -> None:
        self._values.pop((registry, scope), None)


def _basic(credentials: tuple[str, str]) -> str:
    user, password = credentials
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode("ascii")


class RegistryAuth(httpx.Auth):
    """The flow for requests to one registry endpoint on behalf of one scope (``repository:<name>:pull``).

    ``subject`` names what is being fetched (a reference, a blob) and starts every error message.
    """

    def __init__(
        self,
        *,
        registry: str,
        scope: str,
        credentials: tuple[str, str] | None,
        cache: TokenCache,
        allow_plain_http: Callable[[str], bool],
        subject: str,
    ) -> None:
        self._subject = subject
        self._registry = registry
        self._scope = scope
        self._credentials = credentials
        self._cache = cache
        self._allow_plain_http = allow_plain_http

    def sync_auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        raise RuntimeError("RegistryAuth is for httpx.AsyncClient only")

    async def async_auth_flow(self, request: httpx.Request) -> AsyncGenerator[httpx.Request, httpx.Response]:
        cached = self._cache.get(self._registry, self._scope)
        if cached is not None:
            request.headers["Authorization"] = cached
        response = yield request
        if response.status_code != 401 or response.request.url.host != request.url.host:
            return  # a 401 from storage a blob was redirected to is not the registry's challenge
        self._cache.drop(self._registry, self._scope)
        challenges = parse_www_authenticate(response.headers.get_list("www-authenticate"))
        by_scheme = {c.scheme: c for c in challenges}
        if "bearer" in by_scheme:
            bearer = by_scheme["bearer"]
            token_request = self._token_request(bearer)
            token_response = yield token_request
            await token_response.aread()
            authorization = "Bearer " + self._token_from(token_response)
        elif "basic" in by_scheme:
            if self._credentials is None:
                await response.aread()
                raise RegistryAuthError(
                    f"{self._subject}: registry {self._registry} requires credentials and none were given: "
                    f"{error_message(response)}"
                )
            authorization = _basic(self._credentials)
        else:
            schemes = ", ".join(c.scheme for c in challenges) or "none"
            raise RegistryAuthError(
                f"{self._subject}: registry {self._registry} answered 401 with no usable challenge (schemes: {schemes})"
            )
        self._cache.put(self._registry, self._scope, authorization)
        request.headers["Authorization"] = authorization
        response = yield request
        if response.status_code == 401:
            self._cache.drop(self._registry, self._scope)
            await response.aread()
            raise self._refused(response)

    def _token_request(self, challenge: Challenge) -> httpx.Request:
        realm = challenge.params.get("realm", "")
        try:
            url = httpx.URL(realm)
        except httpx.InvalidURL:
            url = None
        if url is None or url.scheme not in ("http", "https") or not url.host:
            raise RegistryAuthError(
                f"{self._subject}: registry {self._registry} sent a Bearer challenge with bad realm {realm!r}"
            )
        netloc = url.netloc.decode("ascii")
        if url.scheme == "http" and not self._allow_plain_http(netloc):
            raise InsecureRegistryRefused(
                f"{self._subject}: token realm {realm} of registry {self._registry} is plain HTTP; add {netloc} to "
                "images.insecure_registries to allow it"
            )
        params = {"service": challenge.params["service"]} if "service" in challenge.params else {}
        params["scope"] = challenge.params.get("scope", self._scope)
        headers = {}
        if self._credentials is not None:
            params["account"] = self._credentials[0]
            headers["Authorization"] = _basic(self._credentials)
        return httpx.Request("GET", url, params=params, headers=headers)

    def _token_from(self, response: httpx.Response) -> str:
        realm = f"{response.request.url.scheme}://{response.request.url.netloc.decode('ascii')}"
        if response.status_code in (401, 403):
            who = f"user {self._credentials[0]!r}" if self._credentials else "anonymous access"
            raise RegistryAuthError(
                f"{self._subject}: token server {realm} of registry {self._registry} refused {who}: "
                f"{error_message(response)}"
            )
        if response.status_code != 200:
            raise RegistryUnreachable(
                f"{self._subject}: token server {realm} of registry {self._registry} failed: {error_message(response)}"
            )
        try:
            doc = json.loads(response.content)
        except ValueError:
            doc = None
        token = None
        if isinstance(doc, dict):
            token = doc.get("token") or doc.get("access_token")
        if not isinstance(token, str) or not token:
            raise RegistryAuthError(
                f"{self._subject}: token server {realm} of registry {self._registry} returned no token"
            )
        return token

    def _refused(self, response: httpx.Response) -> Exception:
        message = error_message(response)
        challenges = parse_www_authenticate(response.headers.get_list("www-authenticate"))
        insufficient = any(c.params.get("error") == "insufficient_scope" for c in challenges)
        if insufficient and self._credentials is None:
            # Docker Hub (and others) answer this for repositories that do not exist as well as for private
            # ones; as "not found" it lets a short name go on to the next configured registry.
            return ImageNotFound(
                f"{self._subject}: not found on {self._registry}, or needs credentials ({message})"
            )
        if self._credentials is None:
            return RegistryAuthError(
                f"{self._subject}: registry {self._registry} requires credentials and none were given: {message}"
            )
        return RegistryAuthError(
            f"{self._subject}: registry {self._registry} refused the credentials of user {self._credentials[0]!r}: "
            f"{message}"
        )
