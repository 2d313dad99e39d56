"""Egress: the guest reaches "the internet" (a test namespace) per the node switch and the E2B policy."""

from __future__ import annotations

import pytest

from aenv_node.net import ALL_TRAFFIC, EgressPolicy, apply_egress, open_slot

from .conftest import Lab

NO = 0.7  # seconds to wait before calling a destination unreachable


async def test_default_policy_reaches_internet_masqueraded(lab: Lab) -> None:
    cfg = await lab.host_networking(egress=True)
    guest = lab.guest_netns()
    (port,) = await lab.serve(lab.inet_ns, "inet")
    async with open_slot(cfg, 0, test_guest_netns=guest):
        # the internet sees the host's uplink address, never the slot's or the guest's
        assert await lab.connect(guest, lab.inet_ip, port) == f"inet {lab.host_inet_ip}"
        assert await lab.connect(guest, lab.inet_ip2, port) == f"inet {lab.host_inet_ip}"


async def test_deny_allow_and_ports(lab: Lab) -> None:
    cfg = await lab.host_networking(egress=True)
    guest = lab.guest_netns()
    p1, p2 = await lab.serve(lab.inet_ns, "inet", (0, 0))
    inet, inet2 = lab.inet_ip, lab.inet_ip2
    async with open_slot(cfg, 1, test_guest_netns=guest) as slot:
        # denyOut one address: that one is blocked, the other still reachable
        await apply_egress(slot, EgressPolicy.from_e2b(deny_out=[inet]))
        assert await lab.connect(guest, inet, p1, NO) is None
        assert await lab.connect(guest, inet2, p1) is not None

        # deny everything, allow one address: allowOut wins over denyOut (a whitelist)
        await apply_egress(slot, EgressPolicy.from_e2b(deny_out=[ALL_TRAFFIC], allow_out=[f"{inet}/32"]))
        assert await lab.connect(guest, inet, p1) is not None
        assert await lab.connect(guest, inet2, p1, NO) is None

        # allowOut with a port: only that port of that address
        await apply_egress(slot, EgressPolicy.from_e2b(deny_out=[ALL_TRAFFIC], allow_out=[f"{inet}:{p2}"]))
        assert await lab.connect(guest, inet, p2) is not None
        assert await lab.connect(guest, inet, p1, NO) is None

        # allow_internet_access=false is denyOut 0.0.0.0/0
        no_internet = EgressPolicy.from_e2b(allow_internet_access=False)
        assert not no_internet.internet
        await slot.apply_egress(no_internet)
        assert await lab.connect(guest, inet, p1, NO) is None
        assert await lab.connect(guest, inet2, p2, NO) is None

        # and back: the update is live on the running slot
        await slot.apply_egress(EgressPolicy())
        assert await lab.connect(guest, inet, p1) is not None

        # the host still reaches the guest whatever the egress policy (replies are not egress)
        await slot.apply_egress(no_internet)
        (gport,) = await lab.serve(guest, "guest")
        assert await lab.connect(None, slot.address, gport) == f"guest {slot.host_ip}"


async def test_allow_out_cannot_open_blocked_ranges(lab: Lab) -> None:
    """allowOut 0.0.0.0/0 still does not reach the always-blocked ranges (the host's veth end)."""
    cfg = await lab.host_networking(egress=True)
    guest = lab.guest_netns()
    (api,) = await lab.serve(None, "host-api")
    async with open_slot(cfg, 2, test_guest_netns=guest) as slot:
        await slot.apply_egress(EgressPolicy.from_e2b(allow_out=[ALL_TRAFFIC], deny_out=[ALL_TRAFFIC]))
        assert await lab.connect(guest, slot.host_ip, api, NO) is None
        assert await lab.connect(None, slot.host_ip, api) is not None  # the server is up


async def test_egress_switched_off_on_the_node_blocks_everything(lab: Lab) -> None:
    cfg = await lab.host_networking(egress=False)
    guest = lab.guest_netns()
    (port,) = await lab.serve(lab.inet_ns, "inet")
    assert await lab.connect(None, lab.inet_ip, port) is not None  # the internet is up
    async with open_slot(cfg, 3, test_guest_netns=guest) as slot:
        assert await lab.connect(guest, lab.inet_ip, port, NO) is None
        await slot.apply_egress(EgressPolicy.from_e2b(allow_out=[ALL_TRAFFIC]))
        assert await lab.connect(guest, lab.inet_ip2, port, NO) is None
        # the host still reaches the guest
        (gport,) = await lab.serve(guest, "guest")
        assert await lab.connect(None, slot.address, gport) is not None
        # switching egress on for the node (same call, new config) opens it without touching slots
        await lab.host_networking(egress=True)
        assert await lab.connect(guest, lab.inet_ip, port) is not None


@pytest.mark.parametrize(
    "allow,deny",
    [
        ([], ["1.2.3.4", "1.2.3.0/24", ALL_TRAFFIC]),  # overlapping entries merge
        (["8.8.8.8:53", "9.9.9.0/24:1000-2000"], [ALL_TRAFFIC]),
        (["example.com"], [ALL_TRAFFIC]),  # a domain: opens the DNS server; no proxy, nothing else
    ],
)
async def test_policies_load_into_nftables(lab: Lab, allow: list[str], deny: list[str]) -> None:
    cfg = lab.config()
    async with open_slot(cfg, 4) as slot:
        policy = EgressPolicy.from_e2b(allow_out=allow, deny_out=deny)
        await apply_egress(slot, policy)
        import subprocess

        rules = subprocess.run(
            [*slot.nsenter_argv(), "nft", "list", "chain", "inet", "aenv", "egress_user"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert rules.rstrip().endswith("}")
        assert ("drop" in rules) == bool(deny)
        assert ("accept" in rules) == bool(policy.allow)
        if "example.com" in allow:
            assert "8.8.8.8 accept" in rules or "8.8.8.8 } accept" in rules
            assert [str(d) for d in policy.domains] == ["example.com"]


async def test_host_table_is_idempotent_and_removable(lab: Lab) -> None:
    """Without uplinks (production default: any interface but the slots'), the table loads too;
    ensure is idempotent, teardown removes it (twice is fine)."""
    import subprocess

    from aenv_node.net import ensure_host_networking, teardown_host_networking

    cfg = lab.config(uplinks=())
    await ensure_host_networking(cfg)
    await ensure_host_networking(cfg)
    table = subprocess.run(
        ["nft", "list", "table", "inet", f"aenv_{lab.tag}"], capture_output=True, text=True, check=True
    ).stdout
    assert f'oifname != "ae{lab.tag}-*" masquerade' in table
    assert table.count("chain forward") == 1
    assert open("/proc/sys/net/ipv4/ip_forward").read().strip() == "1"
    await teardown_host_networking(cfg)
    await teardown_host_networking(cfg)
    tables = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True, check=True).stdout
    assert f"aenv_{lab.tag}" not in tables
