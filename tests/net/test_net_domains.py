"""Egress by domain name and the node's DNS: a resolver and web servers in "the internet" namespace, the
node's DNS forwarder and egress proxy in this process, a simulated guest behind a real slot."""

from __future__ import annotations

import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import trio

from aenv_node.net import (
    ALL_TRAFFIC,
    DnsForwarder,
    EgressPolicy,
    EgressProxy,
    NetworkConfig,
    Resolver,
    open_slot,
)

from ..conftest import free_port
from .conftest import Lab

NO = "1.0"  # seconds a probe waits before calling a destination unreachable


@dataclass
class Node:
    """The node's side: its DNS forwarder and egress proxy, with the policy of each slot."""

    cfg: NetworkConfig
    proxy: EgressProxy
    policies: dict[int, EgressPolicy] = field(default_factory=dict)


@asynccontextmanager
async def node_services(lab: Lab, dns_upstream: str) -> AsyncIterator[Node]:
    cfg = await lab.host_networking(egress=True, dns_port=free_port(), proxy_port=free_port())
    assert cfg.dns_port is not None and cfg.proxy_port is not None
    resolver = Resolver([dns_upstream], timeout_s=1.0)
    policies: dict[int, EgressPolicy] = {}

    def serves(index: int) -> bool:
        p = policies.get(index)
        return p is not None and (p.internet or bool(p.domains))

    proxy = EgressProxy(cfg, resolver, policies.get, port=cfg.proxy_port)
    forwarder = DnsForwarder(cfg, resolver, serves, port=cfg.dns_port)
    async with trio.open_nursery() as nursery:
        await nursery.start(forwarder.run)
        await nursery.start(proxy.run)
        yield Node(cfg, proxy, policies)
        nursery.cancel_scope.cancel()


def _cert(tmp: Path) -> tuple[str, str]:
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=allowed.test",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )
    return str(cert), str(key)


def _http(host: str) -> str:
    return f"GET / HTTP/1.1\\r\\nHost: {host}\\r\\n\\r\\n"


async def test_a_domain_allowlist_lets_one_name_through_and_blocks_another(lab: Lab, tmp_path: Path) -> None:
    inet, inet2 = lab.inet_ip, lab.inet_ip2
    (dns_port,) = await lab.probe_server(
        lab.inet_ns, "dns", "0",
        f"allowed.test={inet2}", f"other.test={inet}", f"a.wild.test={inet2}", f"wild.test={inet2}",
        "private.test=10.1.2.3",
    )
    cert, key = _cert(tmp_path)
    await lab.probe_server(lab.inet_ns, "web", "web", "80")
    await lab.probe_server(lab.inet_ns, "web", "tls", "443", cert, key)
    (other_port,) = await lab.serve(lab.inet_ns, "plain")
    guest = lab.guest_netns()
    async with node_services(lab, f"{inet}:{dns_port}") as node, open_slot(node.cfg, 5, test_guest_netns=guest) as slot:
        policy = EgressPolicy.from_e2b(allow_out=["allowed.test", "*.wild.test", "private.test"],
                                       deny_out=[ALL_TRAFFIC])
        node.policies[slot.index] = policy
        await slot.apply_egress(policy)

        # the guest resolves through whatever server it names: the node answers from its upstream
        assert await lab.probe(guest, "resolve", "allowed.test", "8.8.8.8") == inet2
        assert await lab.probe(guest, "resolve", "nothing.test", "192.0.2.1") == "FAIL NXDOMAIN"

        # HTTP by Host, TLS by SNI: the allowed name goes through, to the address the NODE resolved
        # (inet2), whatever address the guest connected to (inet); the proxy connects from the host
        assert await lab.probe(guest, "ask", inet, "80", NO, _http("allowed.test")) == \
            f"web {lab.host_inet_ip} {inet2}"
        assert await lab.probe(guest, "ask", inet, "443", NO, "hello\\n", "allowed.test") == \
            f"tls {lab.host_inet_ip} {inet2}"
        assert await lab.probe(guest, "ask", inet, "80", NO, _http("a.wild.test:80")) == \
            f"web {lab.host_inet_ip} {inet2}"
        # another name is blocked, on both protocols, even at its own address
        assert await lab.probe(guest, "ask", inet, "80", NO, _http("other.test")) is None
        assert await lab.probe(guest, "ask", inet, "443", NO, "hello\\n", "other.test") is None
        # a wildcard is for the names below it, not the name itself
        assert await lab.probe(guest, "ask", inet2, "80", NO, _http("wild.test")) is None
        # an allowed name resolving to a private address opens nothing (the node's LAN stays closed)
        assert await lab.probe(guest, "ask", inet, "80", NO, _http("private.test")) is None
        # no name at all (not TLS, not HTTP) and ports no domain entry names: closed
        assert await lab.probe(guest, "ask", inet, "80", NO, "hello\\n") is None
        assert await lab.connect(guest, inet, other_port, 0.7) is None
        assert node.proxy.counts["allowed"] == 3
        assert node.proxy.counts["denied"] == 3
        assert node.proxy.counts["unresolved"] == 1

        # an address allowOut entry is not proxied: it goes out directly (masqueraded)
        policy = EgressPolicy.from_e2b(allow_out=["allowed.test", inet], deny_out=[ALL_TRAFFIC])
        node.policies[slot.index] = policy
        await slot.apply_egress(policy)
        assert await lab.probe(guest, "ask", inet, "80", NO, _http("other.test")) == f"web {lab.host_inet_ip} {inet}"
        assert node.proxy.counts["allowed"] == 3

        # a policy update is live: the name is no longer allowed
        policy = EgressPolicy.from_e2b(allow_out=["else.test"], deny_out=[ALL_TRAFFIC])
        node.policies[slot.index] = policy
        await slot.apply_egress(policy)
        assert await lab.probe(guest, "ask", inet, "80", NO, _http("allowed.test")) is None

        # no internet at all: no DNS either (no tunnel out of an isolated sandbox)
        node.policies[slot.index] = EgressPolicy.from_e2b(allow_internet_access=False)
        await slot.apply_egress(node.policies[slot.index])
        assert await lab.probe(guest, "resolve", "allowed.test", "8.8.8.8") == "FAIL REFUSED"

        # the services answer slots only: the host itself (or anything on the LAN) gets nothing
        assert await lab.probe(None, "ask", "127.0.0.1", str(node.cfg.proxy_port), NO, _http("allowed.test")) is None
        assert node.proxy.counts["not a slot"] == 1


async def test_without_deny_rules_domains_change_nothing_and_dns_still_works(lab: Lab) -> None:
    """E2B: domain entries filter only what denyOut blocks; with no denyOut everything public is open."""
    inet = lab.inet_ip
    (dns_port,) = await lab.probe_server(lab.inet_ns, "dns", "0", f"allowed.test={inet}")
    (port,) = await lab.serve(lab.inet_ns, "plain")
    guest = lab.guest_netns()
    async with node_services(lab, f"{inet}:{dns_port}") as node, open_slot(node.cfg, 6, test_guest_netns=guest) as slot:
        node.policies[slot.index] = EgressPolicy.from_e2b(allow_out=["allowed.test"])
        await slot.apply_egress(node.policies[slot.index])
        assert await lab.probe(guest, "resolve", "allowed.test", "1.1.1.1") == inet
        assert await lab.connect(guest, inet, port) == f"plain {lab.host_inet_ip}"
        assert sum(node.proxy.counts.values()) == 0
