"""The sandbox ownership record: the ``sandbox-<id>`` manifest, typed.  This module alone reads and writes it.

The record is both the pointer to the sandbox's newest published snapshot and who may run it (base.py's
docstring says why it is one document).  Stored as a manifest (``encode_manifest`` bytes) at
``manifests/sandbox-<id>.json``::

    {"version": 1, "sandbox_id": "...", "snapshot_id": "snap-..." | null, "owner": "<node>",
     "state": "paused" | "running" | "deleting", "generation": 7, "updated_at": 1700000000.5,
     "published_at": 1700000000.5}

``generation`` is bumped by every write; ``updated_at`` is the time of the last one; ``published_at`` the time
of the last publish (the field the pointer had before ownership existed; still written).

Records written before this model (no ``version``, no ``owner``, ``published_at`` instead of ``updated_at``)
read as version 1, ``paused``, owned by nobody (``""``), generation 0, updated at their ``published_at``.  A
record of a newer version than this code knows is refused (``ValueError``): a node never rewrites, nor
collects from, a record whose format it does not understand.
"""

from __future__ import annotations

import time
from typing import Any, Final, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .manifest import decode_manifest, encode_manifest

__all__ = [
    "OWNERSHIP_VERSION",
    "OWNER_PAUSED",
    "OWNER_RUNNING",
    "OWNER_DELETING",
    "OwnerState",
    "Ownership",
    "RECORD_PREFIX",
    "sandbox_record_id",
]

#: The format of the record this code writes (and the newest it reads).
OWNERSHIP_VERSION: Final = 1

#: Ownership states: ``paused`` = any node may claim the sandbox; ``running`` = the owner runs it;
#: ``deleting`` = the owner is removing the record (a fence some S3 backends need before a delete).
OWNER_PAUSED: Final = "paused"
OWNER_RUNNING: Final = "running"
OWNER_DELETING: Final = "deleting"
OwnerState = Literal["paused", "running", "deleting"]

#: Manifests whose id starts with this are sandbox records.
RECORD_PREFIX: Final = "sandbox-"

#: The fields that make two records equal (``token`` is the backend's version of the bytes, not the record).
_COMPARED = ("version", "sandbox_id", "owner", "state", "generation", "snapshot_id", "updated_at", "published_at")


def sandbox_record_id(sandbox_id: str) -> str:
    """The manifest id of a sandbox's pointer + ownership record."""
    return f"{RECORD_PREFIX}{sandbox_id}"


class Ownership(BaseModel):
    """A sandbox's ownership record as read (``token`` is the backend's version of it, for compare-and-swap)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    version: Literal[1] = OWNERSHIP_VERSION
    sandbox_id: str
    owner: str = ""  # "" for a pointer written before ownership existed: nobody owns it
    state: OwnerState = OWNER_PAUSED
    generation: int = 0
    snapshot_id: Optional[str] = None  # the newest published snapshot (None: claimed before any publish)
    updated_at: float = 0.0
    published_at: Optional[float] = None  # the last publish (None: never published since the record was made)
    token: str = Field(default="", exclude=True, repr=False)

    @model_validator(mode="before")
    @classmethod
    def _legacy(cls, data: Any) -> Any:
        """Pointers from before ownership: nulls mean "not set"; ``published_at`` stands in for ``updated_at``."""
        if not isinstance(data, dict):
            return data
        doc = {k: v for k, v in data.items() if v is not None or k in ("snapshot_id", "published_at")}
        if not doc.get("updated_at"):
            doc["updated_at"] = doc.get("published_at") or 0.0
        return doc

    # -- bytes ------------------------------------------------------------------------------------------
    @classmethod
    def parse(cls, sandbox_id: str, data: bytes, token: str) -> Ownership:
        """The record stored for ``sandbox_id`` (its id, not the document, says whose it is); ``ValueError``
        if the bytes are not a record this code can read."""
        doc = decode_manifest(data)
        return cls.model_validate({**doc, "sandbox_id": sandbox_id, "token": token})

    def encode(self) -> bytes:
        """The bytes to store (``token`` is not part of them; ``published_at`` only once there was a publish)."""
        return encode_manifest(self.model_dump(mode="json", exclude={"published_at"} if self.published_at is None
                                               else None))

    # -- transitions ------------------------------------------------------------------------------------
    @classmethod
    def successor(cls, sandbox_id: str, cur: Optional[Ownership], *, owner: str, state: OwnerState,
                  snapshot_id: Optional[str], publish: bool = False) -> Ownership:
        """The record that replaces ``cur`` (None: there is none yet): one generation on, written now.
        ``publish``: this write publishes ``snapshot_id`` (``published_at`` moves too)."""
        now = time.time()
        return cls(sandbox_id=sandbox_id, owner=owner, state=state,
                   generation=(cur.generation if cur is not None else 0) + 1, snapshot_id=snapshot_id,
                   updated_at=now, published_at=now if publish else cur.published_at if cur is not None else None)

    def fenced(self) -> Ownership:
        """The same record marked ``deleting`` (the fence a delete without a conditional DELETE writes first)."""
        return self.model_copy(update={"state": OWNER_DELETING})

    def with_token(self, token: str) -> Ownership:
        return self.model_copy(update={"token": token})

    def held_by_other(self, owner: str) -> bool:
        """True if another node holds it (running, or deleting): ``owner`` may not claim it."""
        return self.state != OWNER_PAUSED and self.owner not in ("", owner)

    # -- equality ignores the token ---------------------------------------------------------------------
    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Ownership):
            return NotImplemented
        return self._compared() == other._compared()

    def __hash__(self) -> int:
        return hash(self._compared())

    def _compared(self) -> tuple[Any, ...]:
        return tuple(getattr(self, f) for f in _COMPARED)
