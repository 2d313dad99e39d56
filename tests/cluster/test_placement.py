"""The placement rule (``cluster/placement.py``) over generated clusters: it never picks a node that cannot take
the sandbox, it picks the preferred and the warm nodes first, it says why when nothing fits, and its random K
choices spread a burst of creates."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aenv_node.cluster import NoCapacity, NodeCapacity, NodeLoad, NodeStatus, NodeView, PlacementRequest
from aenv_node.cluster.placement import PlacementPolicy, choose_node, fits, load


def _view(i: int, *, vcpus: int = 8, memory_mb: int = 16384, used_vcpus: int = 0, used_mb: int = 0,
          slots: int = 100, alive: bool = True, draining: bool = False, templates: tuple[str, ...] = (),
          reserved_vcpus: int = 0, reserved_mb: int = 0) -> NodeView:
    status = NodeStatus(node_id=f"n{i}", url=f"http://10.0.0.{i}:8000", software="t",
                        capacity=NodeCapacity(vcpus=vcpus, memory_mb=memory_mb, disk_free_mb=1000, slots_free=slots),
                        load=NodeLoad(running=0, paused=0, vcpus=used_vcpus, memory_mb=used_mb),
                        templates=list(templates), draining=draining)
    return NodeView(status=status, seen_at=0.0, alive=alive, reserved_vcpus=reserved_vcpus,
                    reserved_memory_mb=reserved_mb)


nodes = st.lists(st.builds(
    lambda i, v, m, uv, um, slots, alive, draining, warm, rv: _view(
        i, vcpus=v, memory_mb=m, used_vcpus=uv, used_mb=um, slots=slots, alive=alive, draining=draining,
        templates=("tpl",) if warm else (), reserved_vcpus=rv),
    st.integers(0, 10_000), st.integers(1, 64), st.integers(512, 1 << 18), st.integers(0, 300),
    st.integers(0, 1 << 19), st.integers(0, 3), st.booleans(), st.booleans(), st.booleans(), st.integers(0, 50),
), max_size=12, unique_by=lambda v: v.status.node_id)
requests = st.builds(lambda cpu, mem, excl, prefer: PlacementRequest(
    template_id="tpl", cpu_count=cpu, memory_mb=mem, exclude=[f"n{e}" for e in excl],
    prefer=None if prefer is None else f"n{prefer}"),
    st.integers(1, 16), st.integers(128, 1 << 16), st.lists(st.integers(0, 10_000), max_size=3),
    st.none() | st.integers(0, 10_000))
policies = st.builds(PlacementPolicy, cpu_overcommit=st.floats(0.5, 8), memory_overcommit=st.floats(0.5, 3),
                     candidates=st.integers(1, 5))


@settings(max_examples=400, deadline=None)
@given(nodes, requests, policies, st.integers(0, 2**32))
def test_the_chosen_node_can_take_the_sandbox_and_nothing_is_refused_that_fits(
        views: list[NodeView], req: PlacementRequest, policy: PlacementPolicy, seed: int) -> None:
    eligible = [v for v in views if v.alive and not v.status.draining and v.status.node_id not in req.exclude
                and fits(v, req, policy)]
    try:
        chosen = choose_node(views, req, policy, random.Random(seed))
    except NoCapacity as exc:
        assert not eligible, exc
        assert str(exc)
        return
    assert chosen in eligible
    preferred = [v for v in eligible if v.status.node_id == req.prefer]
    if preferred:
        assert chosen is preferred[0]
    elif any("tpl" in v.status.templates for v in eligible):
        assert "tpl" in chosen.status.templates  # a warm node beats a cold one, however loaded


def test_reservations_count_against_capacity_and_overcommit_scales_it() -> None:
    req = PlacementRequest(template_id="t", cpu_count=2, memory_mb=1024)
    policy = PlacementPolicy(cpu_overcommit=1.0, memory_overcommit=1.0)
    assert fits(_view(1, vcpus=4, used_vcpus=2), req, policy)
    assert not fits(_view(1, vcpus=4, used_vcpus=2, reserved_vcpus=1), req, policy)
    assert fits(_view(1, vcpus=4, used_vcpus=2, reserved_vcpus=1), req, PlacementPolicy(cpu_overcommit=2.0))
    assert not fits(_view(1, memory_mb=2048, used_mb=1024, reserved_mb=512), req, policy)
    assert not fits(_view(1, slots=0), req, policy)


def test_nothing_fits_says_why() -> None:
    req = PlacementRequest(template_id="t", cpu_count=2, memory_mb=1024)
    policy = PlacementPolicy()
    with pytest.raises(NoCapacity, match="no node has registered"):
        choose_node([], req, policy, random.Random(1))
    with pytest.raises(NoCapacity, match="2 known: dead, draining or excluded"):
        choose_node([_view(1, alive=False), _view(2, draining=True)], req, policy, random.Random(1))
    with pytest.raises(NoCapacity, match="room for 2 vCPUs and 1024 MiB"):
        choose_node([_view(1, vcpus=1, used_vcpus=4)], req, policy, random.Random(1))
    # the only node holding the template is full: a cold node takes it (it imports the template)
    assert choose_node([_view(1, vcpus=1, used_vcpus=4, templates=("t",)), _view(2)], req, policy,
                       random.Random(1)).status.node_id == "n2"


def test_least_loaded_of_k_spreads_a_burst_and_favours_the_emptier_nodes() -> None:
    """A burst of placements between two heartbeats, each reserving its share as the scheduler does: every node
    gets some, and the node that started emptiest gets the most."""
    policy = PlacementPolicy(cpu_overcommit=4.0, memory_overcommit=1.5, candidates=2)
    used = {1: 0, 2: 8, 3: 16, 4: 24}
    reserved: Counter[int] = Counter()
    rng = random.Random(7)
    req = PlacementRequest(template_id="t", cpu_count=1, memory_mb=256)
    for _ in range(60):
        views = [_view(i, vcpus=8, used_vcpus=used[i], reserved_vcpus=reserved[i], reserved_mb=256 * reserved[i])
                 for i in used]
        chosen = choose_node(views, req, policy, rng)
        reserved[int(chosen.status.node_id[1:])] += 1
    assert set(reserved) == set(used), reserved
    assert reserved[1] == max(reserved.values()) and reserved[4] == min(reserved.values()), reserved
    loads = [load(_view(i, vcpus=8, used_vcpus=used[i] + reserved[i]), policy) for i in used]
    assert max(loads) - min(loads) < 0.35, loads
