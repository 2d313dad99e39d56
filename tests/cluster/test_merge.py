"""The gateway's merged listings (``cluster/merge.py``): paging through the cluster's ``GET /v2/sandboxes`` with
the tokens it gives lists every sandbox of every node exactly once, in the order one node would, whatever the
page size and however the sandboxes are spread (start times collide on purpose: the order's tie-break is the
id). Each node's page is cut here exactly as a node cuts it (``api/handlers/sandboxes.py``)."""

from __future__ import annotations

import datetime as dt

from hypothesis import given, settings
from hypothesis import strategies as st

from aenv_node.api.handlers.sandboxes import decode_token, encode_token
from aenv_node.cluster.merge import (
    SandboxPage,
    listed_twice,
    merge_running,
    merge_sandbox_pages,
    merge_snapshots,
    merge_templates,
    page_templates,
    started_key,
    without_stale,
)

T0 = dt.datetime(2026, 12, 1, 12, 0, 0, tzinfo=dt.timezone.utc)


def _sandbox(sandbox_id: str, micros: int) -> dict[str, str]:
    started = T0 + dt.timedelta(microseconds=micros)
    return {"sandboxID": sandbox_id, "startedAt": started.isoformat().replace("+00:00", "Z")}


def _node_page(items: list[dict[str, str]], token: str | None, limit: int, descending: bool) -> SandboxPage:
    """What one node answers: its sandboxes after ``token`` in the order, at most ``limit``, and whether more."""
    ordered = sorted(items, key=started_key, reverse=descending)
    if token is not None:
        when, sid = decode_token(token)
        micros = (when - dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)) // dt.timedelta(microseconds=1)
        place = (micros, sid)
        ordered = [i for i in ordered if (started_key(i) < place if descending else started_key(i) > place)]
    return SandboxPage(ordered[:limit], len(ordered) > limit)


@settings(max_examples=200, deadline=None)
@given(spread=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 5)), max_size=40),
       limit=st.integers(1, 7), descending=st.booleans())
def test_paging_through_the_merged_list_gives_every_sandbox_once_in_order(
        spread: list[tuple[int, int]], limit: int, descending: bool) -> None:
    nodes: list[list[dict[str, str]]] = [[], [], []]
    for n, (node, micros) in enumerate(spread):
        nodes[node].append(_sandbox(f"sb{n:03d}", micros))
    seen: list[dict[str, str]] = []
    token: str | None = None
    for _ in range(len(spread) + 2):
        page, token = merge_sandbox_pages([_node_page(items, token, limit, descending) for items in nodes],
                                          limit=limit, descending=descending)
        assert len(page) <= limit
        seen += page
        if token is None:
            break
        assert page, "a token after an empty page would loop"
    assert token is None, "paging did not end"
    everything = sorted((i for items in nodes for i in items), key=started_key, reverse=descending)
    assert [i["sandboxID"] for i in seen] == [i["sandboxID"] for i in everything]


def test_a_token_is_the_last_item_place_as_a_node_encodes_it() -> None:
    a, b = _sandbox("a", 1), _sandbox("b", 2_000_001)
    page, token = merge_sandbox_pages([SandboxPage([a], False), SandboxPage([b], True)], limit=1,
                                      descending=False)
    assert page == [a]
    assert token == encode_token(T0 + dt.timedelta(microseconds=1), "a")
    # nothing more anywhere: no token, even for a full page
    assert merge_sandbox_pages([SandboxPage([a], False), SandboxPage([b], False)], limit=2,
                               descending=True) == ([b, a], None)


def test_running_snapshots_and_templates_merge_once_each() -> None:
    assert [i["sandboxID"] for i in merge_running([[_sandbox("z", 5)], [_sandbox("a", 9), _sandbox("m", 1)]])] \
        == ["m", "z", "a"]

    def snap(sid: str, minute: int) -> dict[str, str]:
        return {"snapshotID": sid, "createdAt": (T0 + dt.timedelta(minutes=minute)).isoformat()}

    shared = snap("s-shared", 3)
    assert [s["snapshotID"] for s in merge_snapshots([[snap("s1", 1), shared], [shared, snap("s2", 5)]],
                                                     limit=2)] == ["s2", "s-shared"]

    def tpl(tid: str, minute: int, node: str) -> dict[str, str]:
        return {"templateID": tid, "createdAt": (T0 + dt.timedelta(minutes=minute)).isoformat(), "node": node}

    merged = merge_templates([[tpl("base", 0, "n1"), tpl("app", 2, "n1")], [tpl("base", 0, "n2"),
                                                                            tpl("web", 1, "n2")]])
    assert [(t["templateID"], t["node"]) for t in merged] == [("base", "n1"), ("web", "n2"), ("app", "n1")]
    assert [t["templateID"] for t in page_templates(merged, limit=1, after="base")] == ["web"]
    assert [t["templateID"] for t in page_templates(merged, limit=5, after=None)] == ["base", "web", "app"]
    assert page_templates(merged, limit=5, after="gone") == []


@settings(max_examples=300, deadline=None)
@given(spread=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 5), st.integers(0, 4)), max_size=30),
       limit=st.integers(1, 5), descending=st.booleans())
def test_a_moved_sandbox_still_listed_by_the_node_it_left_is_paged_once_from_its_home(
        spread: list[tuple[int, int, int]], limit: int, descending: bool) -> None:
    """A sandbox that moved is listed by its new node and, stale, by the node it left (which did not learn of
    the move): the gateway drops the stale listing (its binding names the other node), and paging still gives
    every sandbox exactly once, also when a node's whole page was stale, or the sandbox's new node did not
    answer (its only listing is the stale one, which goes)."""
    nodes: list[list[dict[str, str]]] = [[], [], []]
    home: dict[str, str | None] = {}
    gone: set[str] = set()
    for n, (node, micros, stale_on) in enumerate(spread):
        sb = _sandbox(f"sb{n:03d}", micros)
        nodes[node].append(sb)
        if stale_on < 3 and stale_on != node:  # it moved here from ``stale_on``, which still lists it
            nodes[stale_on].append(dict(sb))
            home[sb["sandboxID"]] = f"n{node}"
        elif stale_on == 4:  # it moved from ``node`` to a node missing from this listing
            nodes[(node + 1) % 3].append(dict(sb))
            home[sb["sandboxID"]] = "n9"
            gone.add(sb["sandboxID"])
    seen: list[dict[str, str]] = []
    token: str | None = None
    for _ in range(2 * len(spread) + 2):
        answers = [(f"n{i}", _node_page(items, token, limit, descending)) for i, items in enumerate(nodes)]
        twice = listed_twice((node_id, page.items) for node_id, page in answers)
        assert twice <= set(home)
        pages = [SandboxPage(without_stale(page.items, node_id, {s: home[s] for s in twice}), page.more, page.last)
                 for node_id, page in answers]
        page, token = merge_sandbox_pages(pages, limit=limit, descending=descending)
        assert len(page) <= limit
        seen += page
        if token is None:
            break
    else:
        raise AssertionError("paging did not end")
    ids = [s["sandboxID"] for s in seen]
    assert sorted(ids) == sorted({f"sb{n:03d}" for n in range(len(spread))} - gone), ids
    assert [started_key(s) for s in seen] == sorted((started_key(s) for s in seen), reverse=descending)
