"""Hosts for cluster tests: one network namespace per "host", each with its own address on a LAN the test makes.

The LAN is a bridge in the test's own namespace with an address of its own (the scheduler and the gateways run
there, as on a control host) and a veth into each host's namespace. A node runs in its host's namespace only
(``nsenter --net``: the mounts, processes and files are the machine's, so a node's state directory and its data
plane's sockets are where a test looks for them): it listens on its host's address, makes its sandboxes'
network slots, their veths and its nftables table in that namespace, and is reached by the gateway, the
scheduler and the other nodes at that address, never through 127.0.0.1.

The addresses are a /24 of 10.13.0.0/16 that nothing on this machine routes yet. Everything is removed at the
end: the namespaces (with what the nodes left in them), the veths and the bridge.
"""

from __future__ import annotations

import ipaddress
import json
import random
import subprocess
from dataclasses import dataclass, field


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = ["ip", *(["-n", ns] if ns else []), *args]
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def _free_lan() -> ipaddress.IPv4Network:
    routes = json.loads(subprocess.run(["ip", "-j", "-4", "route", "show"], capture_output=True, text=True,
                                       check=True).stdout or "[]")
    used = [ipaddress.ip_network(r["dst"], strict=False) for r in routes if r.get("dst") not in (None, "", "default")]
    for _ in range(200):
        cand = ipaddress.ip_network(f"10.13.{random.randrange(1, 250)}.0/24")
        if not any(cand.overlaps(u) for u in used):
            return cand
    raise RuntimeError("no free /24 in 10.13.0.0/16 for the test's hosts")


@dataclass
class Lan:
    """A bridge in this namespace (``gateway_address`` is ours on it) and the hosts' namespaces on it."""

    tag: str
    net: ipaddress.IPv4Network
    hosts: dict[str, str] = field(default_factory=dict)  # name -> its namespace

    @property
    def bridge(self) -> str:
        return f"aenvlan{self.tag}"

    @property
    def own_address(self) -> str:
        """This namespace's address on the LAN (where the scheduler listens for the nodes)."""
        return str(self.net[254])

    def address(self, host: str) -> str:
        return str(self.net[list(self.hosts).index(host) + 1])

    def namespace(self, host: str) -> str:
        return self.hosts[host]

    def add_host(self, name: str) -> str:
        """A new host: its namespace, loopback up, a veth on the LAN with the next address; its namespace."""
        ns = f"aenvh{self.tag}-{len(self.hosts) + 1}"
        outer = f"aenvv{self.tag}{len(self.hosts) + 1}"
        _ip("netns", "add", ns)
        self.hosts[name] = ns
        _ip("link", "add", outer, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("link", "set", outer, "master", self.bridge, "up")
        _ip("link", "set", "lo", "up", ns=ns)
        _ip("addr", "add", f"{self.address(name)}/{self.net.prefixlen}", "dev", "eth0", ns=ns)
        _ip("link", "set", "eth0", "up", ns=ns)
        return ns

    def remove(self) -> None:
        """The veths first (each pair goes with its outer end, even while its namespace is still held), then the
        namespaces and the bridge."""
        for i in range(1, len(self.hosts) + 1):
            subprocess.run(["ip", "link", "del", f"aenvv{self.tag}{i}"], capture_output=True)
        for ns in self.hosts.values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)

    def leftovers(self) -> list[str]:
        """What of the LAN is still on the host (nothing after ``remove``)."""
        links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout
        spaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        return [w.split("@")[0] for w in links.split() if w.startswith(("aenvv" + self.tag, self.bridge))] + \
            [line.split()[0] for line in spaces.splitlines() if line.startswith(f"aenvh{self.tag}-")]


def make_lan() -> Lan:
    lan = Lan(f"{random.randrange(16**4):04x}", _free_lan())
    _ip("link", "add", lan.bridge, "type", "bridge")
    _ip("addr", "add", f"{lan.own_address}/{lan.net.prefixlen}", "dev", lan.bridge)
    _ip("link", "set", lan.bridge, "up")
    return lan


def in_namespace(ns: str) -> list[str]:
    """The command prefix that runs a program in ``ns``'s network namespace, and nothing else of it."""
    return ["nsenter", f"--net=/run/netns/{ns}"]
