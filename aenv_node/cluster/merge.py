"""How the gateway makes one listing of several nodes' listings: pure functions over the nodes' JSON answers.

Each node pages its own sandboxes; the cluster's page is cut from all of them so that a client paging through the
gateway sees every sandbox exactly once, in the order one node would give:

- ``GET /v2/sandboxes``: a node's ``x-next-token`` is a place in a total order (``<startedAt in unix
  microseconds>.<sandbox id>``, ascending or descending by ``order``), not a cursor of its own, so the gateway
  sends the client's token to every node, merges their pages in that order and cuts at ``limit``. The cut is
  exact: a node that answered a full page has nothing before its last item that it did not send, and the merged
  page ends no later than any full page's last item, so nothing is skipped; the next token is the last item's
  place, written by the node's own ``encode_token``, so every node understands it.
- ``GET /sandboxes`` (v1, unpaged): all of them, in start order.
- ``GET /snapshots``: newest first, cut at ``limit``.
- ``GET /templates`` and ``/v2/templates``: a template every node holds (``base``, and templates shared through
  the repository) is listed once; pages are cut from the merged list by the last template id seen, as a node
  does.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Sequence
from typing import Any, Optional

from ..api.handlers.sandboxes import encode_token

__all__ = [
    "SandboxPage",
    "listed_twice",
    "without_stale",
    "merge_sandbox_pages",
    "merge_running",
    "merge_snapshots",
    "merge_templates",
    "page_templates",
    "started_key",
]

_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)

Item = dict[str, Any]


def _parse_time(text: str) -> dt.datetime:
    when = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    return when if when.tzinfo is not None else when.replace(tzinfo=dt.timezone.utc)


def started_key(item: Item) -> tuple[int, str]:
    """A listed sandbox's place in the nodes' order: (startedAt in unix microseconds, sandbox id)."""
    micros = (_parse_time(str(item["startedAt"])) - _EPOCH) // dt.timedelta(microseconds=1)
    return micros, str(item["sandboxID"])


def listed_twice(lists: Iterable[tuple[str, Sequence[Item]]]) -> set[str]:
    """Sandbox ids that more than one node lists: one that moved to another node (a drain, a node gone and back)
    is still listed, paused, by the node it left, which does not learn of the move."""
    seen: set[str] = set()
    twice: set[str] = set()
    for _node, items in lists:
        for item in items:
            sid = str(item["sandboxID"])
            (twice if sid in seen else seen).add(sid)
    return twice


def without_stale(items: Sequence[Item], node_id: str, home: dict[str, Optional[str]]) -> list[Item]:
    """``node_id``'s listed sandboxes but those that live on another node (``home``: sandbox id -> the node its
    binding names, for the ids ``listed_twice`` found; None: bound nowhere, every listing of it is kept)."""
    return [i for i in items if home.get(str(i["sandboxID"]), node_id) in (node_id, None)]


class SandboxPage:
    """One node's answer to ``GET /v2/sandboxes``: its items, whether it has more after them, and the last item
    it sent (``last``; by default the last of ``items``: given when items were dropped from the answer)."""

    __slots__ = ("items", "more", "last")

    def __init__(self, items: Sequence[Item], more: bool, last: Optional[Item] = None) -> None:
        self.items = list(items)
        self.more = more
        self.last = last if last is not None else (self.items[-1] if self.items else None)


def merge_sandbox_pages(pages: Iterable[SandboxPage], *, limit: int, descending: bool) -> tuple[list[Item],
                                                                                               Optional[str]]:
    """The cluster's page from every node's page of the same query, and its ``x-next-token`` (None: the last)."""
    pages = list(pages)
    merged = sorted((item for page in pages for item in page.items), key=started_key, reverse=descending)
    # a node with more to send has nothing it did not send before its page's last item, and may have anything
    # after it: the page ends at the earliest such last item (a full page's last lies at or after the cut at
    # ``limit``, so this only bites on a page that lost items: a moved sandbox's stale listing)
    ends = [page.last for page in pages if page.more and page.last is not None]
    end: Optional[Item] = None
    if ends:
        end = (max if descending else min)(ends, key=started_key)
        bound = started_key(end)
        merged = [i for i in merged if (started_key(i) >= bound if descending else started_key(i) <= bound)]
    out = merged[:limit]
    more = len(merged) > limit or any(page.more for page in pages)
    if not more:
        return out, None
    last = out[-1] if out else end  # nothing left before the bound (every item there stale): page on from it
    if last is None:
        return out, None
    return out, encode_token(_parse_time(str(last["startedAt"])), str(last["sandboxID"]))


def merge_running(lists: Iterable[Sequence[Item]]) -> list[Item]:
    """``GET /sandboxes`` (v1): every node's running sandboxes, oldest first as a node lists them."""
    return sorted((item for items in lists for item in items), key=started_key)


def merge_snapshots(lists: Iterable[Sequence[Item]], *, limit: int) -> list[Item]:
    """``GET /snapshots``: newest first, at most ``limit``, each snapshot once (a shared one may be listed by
    several nodes)."""
    seen: set[str] = set()
    out: list[Item] = []
    for item in sorted((i for items in lists for i in items),
                       key=lambda i: (_parse_time(str(i["createdAt"])), str(i["snapshotID"])), reverse=True):
        if item["snapshotID"] not in seen:
            seen.add(item["snapshotID"])
            out.append(item)
    return out[:limit]


def merge_templates(lists: Iterable[Sequence[Item]]) -> list[Item]:
    """``GET /templates``: each template once (the first node's record of it), oldest first, then by id."""
    seen: dict[str, Item] = {}
    for items in lists:
        for item in items:
            seen.setdefault(str(item["templateID"]), item)
    return sorted(seen.values(), key=lambda i: (_parse_time(str(i["createdAt"])), str(i["templateID"])))


def page_templates(merged: Sequence[Item], *, limit: int, after: Optional[str]) -> list[Item]:
    """``GET /v2/templates``: the page of the merged list after the template id ``after`` (nothing when that id
    is not listed, as a node answers)."""
    start = 0
    if after:
        start = next((i + 1 for i, t in enumerate(merged) if t["templateID"] == after), len(merged))
    return list(merged[start:start + limit])
