"""Isolation: a guest reaches neither another sandbox, nor the host, nor the node's API; the host
reaches every guest."""

from __future__ import annotations

import subprocess

from aenv_node.net import EgressPolicy, open_slot

from .conftest import Lab

NO = 0.7


async def test_guests_are_isolated_from_each_other_and_the_host(lab: Lab) -> None:
    cfg = await lab.host_networking(egress=True)
    ga, gb = lab.guest_netns(), lab.guest_netns()
    (api,) = await lab.serve(None, "node-api")  # the node's API on 0.0.0.0 in the root namespace
    (inet,) = await lab.serve(lab.inet_ns, "inet")
    async with open_slot(cfg, 0, test_guest_netns=ga) as a, open_slot(cfg, 1, test_guest_netns=gb) as b:
        (pa,) = await lab.serve(ga, "A")
        (pb,) = await lab.serve(gb, "B")
        # the host reaches both guests; the guests reach the internet: the paths are live
        assert await lab.connect(None, a.address, pa) == f"A {a.host_ip}"
        assert await lab.connect(None, b.address, pb) == f"B {b.host_ip}"
        assert await lab.connect(ga, lab.inet_ip, inet) is not None
        assert await lab.connect(None, a.host_ip, api) is not None

        for guest, other in ((ga, b), (gb, a)):
            port = pb if other is b else pa
            # another sandbox, by its slot address or its host end
            assert await lab.connect(guest, other.address, port, NO) is None
            assert await lab.connect(guest, other.host_ip, api, NO) is None
        # the host: its end of the guest's own veth, its uplink address
        assert await lab.connect(ga, a.host_ip, api, NO) is None
        assert await lab.connect(ga, lab.host_inet_ip, api, NO) is None
        # even with allowOut everything
        await a.apply_egress(EgressPolicy.from_e2b(allow_out=["0.0.0.0/0"]))
        assert await lab.connect(ga, b.address, pb, NO) is None
        assert await lab.connect(ga, lab.host_inet_ip, api, NO) is None


async def test_host_rules_isolate_even_if_a_slot_namespace_is_wide_open(lab: Lab) -> None:
    """Defence in depth: replace slot A's nftables table by bare NAT (no filtering at all, as if
    its rules were lost); the host's table alone still keeps A from B and from the host."""
    cfg = await lab.host_networking(egress=True)
    ga, gb = lab.guest_netns(), lab.guest_netns()
    (api,) = await lab.serve(None, "node-api")
    (inet,) = await lab.serve(lab.inet_ns, "inet")
    async with open_slot(cfg, 2, test_guest_netns=ga) as a, open_slot(cfg, 3, test_guest_netns=gb) as b:
        (pb,) = await lab.serve(gb, "B")
        bare_nat = f"""
delete table inet aenv
table ip barenat {{
  chain pre {{ type nat hook prerouting priority dstnat; iifname "veth0" ip daddr {a.ns_ip} dnat to {a.guest_ip}; }}
  chain post {{ type nat hook postrouting priority srcnat; oifname "veth0" ip saddr {a.guest_ip} snat to {a.ns_ip}; }}
}}
"""
        subprocess.run([*a.nsenter_argv(), "nft", "-f", "-"], input=bare_nat, text=True, check=True)
        assert await lab.connect(ga, lab.inet_ip, inet) is not None  # A's egress path works
        assert await lab.connect(ga, b.address, pb, NO) is None
        assert await lab.connect(ga, a.host_ip, api, NO) is None
        assert await lab.connect(ga, lab.host_inet_ip, api, NO) is None
        assert await lab.connect(None, b.address, pb) is not None  # B itself is up


async def test_spoofed_guest_source_is_dropped(lab: Lab) -> None:
    """A guest sending with another source address (here slot B's address) is dropped in its own
    slot: the counter of the anti-spoofing rule moves and nothing gets through."""
    cfg = await lab.host_networking(egress=True)
    ga, gb = lab.guest_netns(), lab.guest_netns()
    (inet,) = await lab.serve(lab.inet_ns, "inet")
    async with open_slot(cfg, 4, test_guest_netns=ga) as a, open_slot(cfg, 5, test_guest_netns=gb) as b:

        def spoof_drops() -> int:
            out = subprocess.run(
                [*a.nsenter_argv(), "nft", "-j", "list", "chain", "inet", "aenv", "forward"],
                capture_output=True, text=True, check=True,
            ).stdout  # fmt: skip
            import json

            for item in json.loads(out)["nftables"]:
                rule = item.get("rule")
                if rule and rule.get("comment") == "spoofed source":
                    return next(e["counter"]["packets"] for e in rule["expr"] if "counter" in e)
            raise AssertionError("no anti-spoofing rule")

        assert spoof_drops() == 0
        assert await lab.connect(ga, lab.inet_ip, inet) is not None
        assert spoof_drops() == 0
        subprocess.run(["ip", "-n", ga, "addr", "add", f"{b.ns_ip}/32", "dev", "eth0"], check=True)
        assert await lab.connect(ga, lab.inet_ip, inet, NO, src=b.ns_ip) is None
        assert spoof_drops() >= 1
