"""One slot: creation, the host reaching the guest through the slot address, teardown."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from aenv_node.net import (
    FoundSlot,
    NetworkConfig,
    SlotError,
    create_slot,
    destroy_slot,
    list_slots,
    open_slot,
)

from aenv_node.net.conntrack import flush_table

from .conftest import Lab, leftovers


def _links_in(netns: str) -> dict[str, dict]:
    out = subprocess.run(["ip", "-n", netns, "-j", "addr"], capture_output=True, text=True, check=True).stdout
    return {link["ifname"]: link for link in json.loads(out)}


async def test_slot_layout_and_host_reaches_guest(lab: Lab) -> None:
    cfg = await lab.host_networking(egress=False)
    guest = lab.guest_netns()
    slot = await create_slot(cfg, 5, test_guest_netns=guest)
    try:
        assert slot.netns == f"aenv-{lab.tag}-5"
        assert slot.host_veth == f"ae{lab.tag}-5"
        # slot 5 of a /24 pool with /30 slots is the 6th /30
        assert (slot.host_ip, slot.ns_ip) == (
            str(cfg.pool.network_address + 5 * 4 + 1),
            str(cfg.pool.network_address + 5 * 4 + 2),
        )
        links = _links_in(slot.netns)
        assert set(links) == {"lo", "veth0", "tap0"}
        assert links["tap0"]["address"] == cfg.tap_mac
        assert [a["local"] for a in links["tap0"]["addr_info"] if a["family"] == "inet"] == ["169.254.0.22"]
        assert [a["local"] for a in links["veth0"]["addr_info"] if a["family"] == "inet"] == [slot.ns_ip]
        g = _links_in(guest)["eth0"]
        assert g["address"] == cfg.guest_mac
        assert [a["local"] for a in g["addr_info"] if a["family"] == "inet"] == ["169.254.0.21"]

        # the host reaches a guest port through the slot's unique address (DNAT), and the guest
        # sees the host's end of the slot's veth as the peer
        (port,) = await lab.serve(guest, "guest")
        assert await lab.connect(None, slot.address, port) == f"guest {slot.host_ip}"
        assert await list_slots(cfg) == [FoundSlot(5, netns=True, host_veth=True)]
    finally:
        await destroy_slot(cfg, 5)
    assert await list_slots(cfg) == []
    assert not [n for n in leftovers(lab.tag) if f"aenv-{lab.tag}-5" in n or f"ae{lab.tag}-5" in n]
    # the guest's end of the "tap" went with the slot
    assert "eth0" not in _links_in(guest)


async def test_guest_snapshot_portability_identical_guest_side(lab: Lab) -> None:
    """Two slots differ only on the host side: the guest side (addresses, MACs, tap name) is the
    same, so a snapshot restores in either."""
    cfg = await lab.host_networking(egress=False)
    g1, g2 = lab.guest_netns(), lab.guest_netns()
    async with open_slot(cfg, 0, test_guest_netns=g1) as a, open_slot(cfg, 1, test_guest_netns=g2) as b:
        same = ("ns_veth", "tap", "guest_ip", "tap_ip", "guest_mac", "tap_mac", "guest_prefixlen")
        assert all(getattr(a, f) == getattr(b, f) for f in same)
        assert a.address != b.address and a.host_veth != b.host_veth and a.netns != b.netns
        pa, pb = await lab.serve(g1, "A"), await lab.serve(g2, "B")
        assert await lab.connect(None, a.address, pa[0]) == f"A {a.host_ip}"
        assert await lab.connect(None, b.address, pb[0]) == f"B {b.host_ip}"
    assert await list_slots(cfg) == []


async def test_teardown_is_idempotent_and_complete(lab: Lab) -> None:
    cfg = await lab.host_networking()
    await create_slot(cfg, 2)
    assert any(f"aenv-{lab.tag}-2" in x for x in leftovers(lab.tag))
    await destroy_slot(cfg, 2)
    await destroy_slot(cfg, 2)  # again: nothing left, no error
    await destroy_slot(cfg, 7)  # never existed
    left = leftovers(lab.tag)
    # no namespace or link of a slot remains (the lab's own "internet" and the node's host table
    # stay until the lab ends)
    assert not [x for x in left if f"aenv-{lab.tag}-" in x or f"ae{lab.tag}-" in x], left


async def test_real_tap_is_created(lab: Lab) -> None:
    cfg = lab.config()
    async with open_slot(cfg, 3) as slot:
        out = subprocess.run(
            ["ip", "-n", slot.netns, "-d", "-j", "link", "show", "tap0"], capture_output=True, text=True, check=True
        ).stdout
        (tap,) = json.loads(out)
        assert tap["linkinfo"]["info_kind"] == "tun"
        assert tap["address"] == cfg.tap_mac


async def test_create_refuses_existing_and_rolls_back_on_failure(lab: Lab) -> None:
    cfg = lab.config()
    async with open_slot(cfg, 4):
        with pytest.raises(SlotError, match="already exists"):
            await create_slot(cfg, 4)
        # the refused create did not damage the existing slot
        assert [(f.index, f.netns, f.host_veth) for f in await list_slots(cfg)] == [(4, True, True)]
    # a create that fails part way (the test guest namespace does not exist) leaves nothing
    with pytest.raises(SlotError):
        await create_slot(cfg, 6, test_guest_netns=f"aenvt-{lab.tag}-missing")
    assert await list_slots(cfg) == []


def test_config_validation() -> None:
    with pytest.raises(ValueError):
        NetworkConfig(node_tag="Bad-Tag")
    with pytest.raises(ValueError):
        NetworkConfig(node_tag="n0", pool_cidr="fd00::/64")
    with pytest.raises(ValueError):
        NetworkConfig(node_tag="n0", pool_cidr="10.0.0.0/24", slot_prefixlen=31)
    cfg = NetworkConfig(node_tag="n0")
    assert cfg.capacity == 16384
    assert str(cfg.subnet(0)) == "10.11.0.0/30" and str(cfg.subnet(16383)) == "10.11.255.252/30"
    with pytest.raises(SlotError):
        cfg.subnet(16384)
    # interface names fit in IFNAMSIZ for the largest index and tag
    assert len(NetworkConfig(node_tag="abcd").host_veth_name(16383)) <= 15


async def test_cancelled_create_leaves_nothing(lab: Lab) -> None:
    import trio

    cfg = lab.config()
    outcomes = set()
    for delay in (0.0, 0.002, 0.005, 0.008, 0.012, 0.016, 0.02, 0.03):
        with trio.move_on_after(delay) as scope:
            await create_slot(cfg, 8)
        outcomes.add(scope.cancelled_caught)
        if scope.cancelled_caught:
            assert await list_slots(cfg) == [], f"cancelled after {delay}s"
        else:
            await destroy_slot(cfg, 8)
    assert True in outcomes  # at least one create was really interrupted


async def test_reset_flushes_connection_tracking(lab: Lab) -> None:
    import shutil

    if shutil.which("conntrack") is None:
        pytest.skip("conntrack not installed (scripts/setup.d/45-net.sh installs it)")
    cfg = await lab.host_networking(egress=True)
    guest = lab.guest_netns()
    (port,) = await lab.serve(lab.inet_ns, "inet")
    async with open_slot(cfg, 9, test_guest_netns=guest) as slot:
        assert await lab.connect(guest, lab.inet_ip, port) is not None

        def entries() -> str:
            return subprocess.run(
                [*slot.nsenter_argv(), "conntrack", "-L"], capture_output=True, text=True, check=True
            ).stdout

        assert lab.inet_ip in entries()
        await slot.reset()
        assert lab.inet_ip not in entries()


async def test_a_flush_of_a_namespace_that_is_gone_says_which(tmp_path: Path) -> None:
    with pytest.raises(SlotError, match=r"flushing slot 7: .*No such file"):
        await flush_table(tmp_path / "no-such-netns", context="flushing slot 7")
    not_a_netns = tmp_path / "file"
    not_a_netns.write_text("")
    with pytest.raises(SlotError, match=r"setns into"):
        await flush_table(not_a_netns, context="flushing slot 7")
