"""The host's side of a node's network: one nft table ``inet aenv_<node-tag>`` for all its slots.

It holds what must be true whatever a slot's own rules say (``egress.py`` has those): the node-wide
egress switch, forwarding only to the configured uplinks, masquerade of the pool behind the uplink's
address, and isolation: nothing forwarded between slots, nothing new forwarded *into* a slot, and
nothing from a slot delivered to the host itself (the node's API listens on 0.0.0.0), except the two
services the node runs for its guests:

* guest DNS, which every slot sends to its host end (port 53, any destination the guest asked for), is
  redirected here to the node's DNS forwarder (``dns.py``) on ``NetworkConfig.dns_port``;
* the connections a slot redirected for a domain check (``egress.redirect_chain_rules``: to its host
  end, port kept) are redirected here to the node's egress proxy (``egress_proxy.py``) on
  ``NetworkConfig.proxy_port``; the proxy reads the guest's original port with ``SO_ORIGINAL_DST``.

The table matches slot interfaces by name prefix, so it carries no per-slot rule.
"""

from __future__ import annotations

import trio

from ._cmd import run
from .errors import NetCommandError
from .slot import NetworkConfig

__all__ = [
    "ensure_host_networking",
    "host_networking_present",
    "host_table_name",
    "teardown_host_networking",
]


def host_table_name(node_tag: str) -> str:
    return f"aenv_{node_tag}"


def _host_ruleset(config: NetworkConfig) -> str:
    table = host_table_name(config.node_tag)
    slots = f'"{config.host_veth_prefix}*"'
    pool = config.pool
    if config.egress:
        if config.uplinks:
            uplinks = "{ " + ", ".join(f'"{u}"' for u in config.uplinks) + " }"
            egress = [f"iifname {slots} oifname {uplinks} accept"]
            masq = f"ip saddr {pool} oifname {uplinks} masquerade"
        else:
            egress = [f"iifname {slots} accept"]
            masq = f"ip saddr {pool} oifname != {slots} masquerade"
    else:
        egress = []
        masq = ""
    fwd = [
        # no sandbox reaches another sandbox (whatever its own namespace says)
        f"iifname {slots} oifname {slots} drop",
        # nothing new is forwarded into a slot: replies only (the host's own connections to a guest
        # are not forwarded, they leave from the host itself)
        f"oifname {slots} ct state established,related accept",
        f"oifname {slots} drop",
        f"iifname {slots} ip daddr {pool} drop",
        f"iifname {slots} ip saddr != {pool} drop",  # spoofed (each slot also checks its guest)
        f"iifname {slots} meta nfproto ipv6 drop",
        *egress,
        f"iifname {slots} drop",
    ]
    services = [p for p in (config.dns_port, config.proxy_port) if p is not None]
    inp = [
        # a sandbox never reaches the host itself (node API, host veth addresses, any host address);
        # replies to connections the host opened (the node's proxy to a guest port) come back
        f"iifname {slots} ct state established,related accept",
        # ... but for what the prerouting chain below redirected to the node's DNS forwarder / egress proxy
        *(
            [f"iifname {slots} ip daddr {pool} ct status dnat meta l4proto {{ tcp, udp }} "
             f"th dport {{ {', '.join(map(str, services))} }} accept"]
            if services else []
        ),
        f"iifname {slots} drop",
    ]
    pre = []
    if config.dns_port is not None:
        pre.append(f"iifname {slots} ip daddr {pool} meta l4proto {{ tcp, udp }} th dport 53 "
                   f"redirect to :{config.dns_port}")
    if config.proxy_port is not None:
        pre.append(f"iifname {slots} ip daddr {pool} meta l4proto tcp redirect to :{config.proxy_port}")
    body = "\n".join(
        [
            f"table inet {table} {{",
            "  chain forward {",
            "    type filter hook forward priority filter; policy accept;",
            *(f"    {r}" for r in fwd),
            "  }",
            "  chain input {",
            "    type filter hook input priority filter; policy accept;",
            *(f"    {r}" for r in inp),
            "  }",
            "  chain prerouting {",
            "    type nat hook prerouting priority dstnat; policy accept;",
            *(f"    {r}" for r in pre),
            "  }",
            "  chain postrouting {",
            "    type nat hook postrouting priority srcnat; policy accept;",
            *([f"    {masq}"] if masq else []),
            "  }",
            "}",
        ]
    )
    # add + delete + add in one transaction: atomic replace, and idempotent
    return f"add table inet {table}\ndelete table inet {table}\n{body}\n"


async def ensure_host_networking(config: NetworkConfig) -> None:
    """Set up the host side for the node's slots: IPv4 forwarding (with egress), and table
    ``inet aenv_<tag>`` with forward / input / postrouting chains (isolation, the egress switch,
    masquerade). Idempotent: calling it again replaces the table atomically (e.g. after a config
    change).

    With egress on, ``net.ipv4.ip_forward`` is switched on (for the whole host: an operator who
    needs forwarding off for everything else should say so in the uplink firewall) and never
    switched back off by the node, since other software on the host may rely on it. With egress
    off it is left alone: the host reaching guests is not forwarding (those packets leave from the
    host itself).
    """
    if config.egress:
        await trio.Path("/proc/sys/net/ipv4/ip_forward").write_text("1\n")
    await run(
        ["nft", "-f", "-"],
        stdin=_host_ruleset(config).encode(),
        context="setting up the host networking of the node's sandboxes",
    )


async def teardown_host_networking(config: NetworkConfig) -> None:
    """Remove the host table of this node. Idempotent."""
    await run(
        ["nft", "delete", "table", "inet", host_table_name(config.node_tag)],
        ok_if=("No such file or directory",),
        context="removing the host networking of the node's sandboxes",
    )


async def host_networking_present(config: NetworkConfig) -> bool:
    try:
        await run(["nft", "list", "table", "inet", host_table_name(config.node_tag)])
    except NetCommandError:
        return False
    return True
