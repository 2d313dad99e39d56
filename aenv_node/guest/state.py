"""The mutable state ``/init`` sets: env vars, access token, default user and workdir.

Also the access checks that depend on it: the ``X-Access-Token`` gate and
signed ``/files`` URLs (``v1_`` + unpadded base64 of
sha256("path:operation:user:token[:expiration]"), as e2b/sandbox/signature.py
makes them).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .errors import HttpError
from .users import UnknownUser, User, lookup_user


def _compare_digest(a: bytes, b: bytes) -> bool:
    import hmac  # lazily: hashing is only needed once a token is set

    return hmac.compare_digest(a, b)


@dataclass
class EnvdState:
    default_user: str = "user"
    default_workdir: str | None = None
    env_vars: dict[str, str] = field(default_factory=dict)
    access_token: str | None = None
    # Newest /init timestamp applied, in ns since the epoch.
    last_init_ns: int = 0

    def token_ok(self, presented: str | None) -> bool:
        if self.access_token is None:
            return True
        if presented is None:
            return False
        return _compare_digest(presented.encode(), self.access_token.encode())

    def user(self, name: str | None) -> User:
        """The named user, or the default user; UnknownUser if there is none such."""
        return lookup_user(name if name else self.default_user)

    # ----- signed URLs --------------------------------------------------
    def signature(self, path: str, operation: str, username: str, expiration: int | None) -> str:
        import base64
        import hashlib

        assert self.access_token is not None
        raw = f"{path}:{operation}:{username}:{self.access_token}"
        if expiration is not None:
            raw += f":{expiration}"
        digest = hashlib.sha256(raw.encode()).digest()
        return "v1_" + base64.b64encode(digest).rstrip(b"=").decode("ascii")

    def check_signing(
        self,
        *,
        header_token: str | None,
        signature: str | None,
        expiration: str | None,
        username: str | None,
        path: str,
        operation: str,
    ) -> None:
        """Authorize a /files request by token header or URL signature (HTTP 401 if not)."""
        if self.access_token is None:
            return
        if header_token:
            if not self.token_ok(header_token):
                raise HttpError(401, "access token present in header but does not match")
            return
        if signature is None:
            raise HttpError(401, "missing signature query parameter")
        exp: int | None = None
        if expiration is not None and expiration != "":
            try:
                exp = int(expiration)
            except ValueError:
                raise HttpError(400, f"invalid signature_expiration {expiration!r}") from None
        expected = self.signature(path, operation, username or "", exp)
        if not _compare_digest(expected.encode(), signature.encode()):
            raise HttpError(401, "invalid signature")
        if exp is not None and exp < int(time.time()):
            raise HttpError(401, "signature is already expired")


__all__ = ["EnvdState", "UnknownUser"]
