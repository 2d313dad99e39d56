"""A fake internet for the end-to-end node: the node's only uplink, with a DNS server and web servers.

A namespace ``aenvt-<tag>-inet`` linked to the host by a veth pair: 198.18.X.1 on its end, 198.19.X.1 on
its loopback (RFC 2544 benchmarking addresses). The node gets that veth as its only uplink
(``net.uplinks``) and the namespace's DNS server as its only upstream (``net.dns_upstreams``), so its
sandboxes have egress and DNS as in production while nothing they send can leave this machine. In it:

* a DNS server: ``allowed.test`` -> the link address, ``other.test`` -> the loopback address;
* ``nsprobe.py web`` servers on port 80 (plain) and 443 (TLS, a self-signed certificate), answering
  ``<name> <peer address> <local address>`` once they read a line.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ..conftest import free_port

PROBE = str(Path(__file__).parent.parent / "net" / "nsprobe.py")


def _sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, text=True)


@dataclass
class Internet:
    ns: str
    link: str  # the host's end of the link: the node's uplink
    ip: str
    ip2: str
    host_ip: str
    dns: str = ""  # "IP:PORT" of its DNS server
    _procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @classmethod
    def make(cls, workdir: Path) -> Internet:
        tag = "".join(secrets.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(4))
        x = secrets.randbelow(64) * 4
        net = ipaddress.IPv4Network(f"198.18.{secrets.randbelow(256)}.{x}/30")
        inet = cls(ns=f"aenvt-{tag}-inet", link=f"at{tag}i", ip=str(net.network_address + 1),
                   ip2=f"198.19.{net.network_address.packed[2]}.{x + 1}", host_ip=str(net.network_address + 2))
        try:
            inet._build(workdir)
        except BaseException:
            inet.remove()
            raise
        return inet

    def _build(self, workdir: Path) -> None:
        _sh("ip", "netns", "add", self.ns)
        _sh("ip", "link", "add", self.link, "type", "veth", "peer", "name", "eth0", "netns", self.ns)
        _sh("ip", "addr", "add", f"{self.host_ip}/30", "dev", self.link)
        _sh("ip", "link", "set", self.link, "up")
        _sh("ip", "route", "add", f"{self.ip2}/32", "via", self.ip, "dev", self.link)
        for cmd in ("link set lo up", f"addr add {self.ip}/30 dev eth0", f"addr add {self.ip2}/32 dev lo",
                    "link set eth0 up"):
            _sh("ip", "-n", self.ns, *cmd.split())
        cert, key = workdir / "inet-cert.pem", workdir / "inet-key.pem"
        _sh("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=allowed.test",
            "-keyout", str(key), "-out", str(cert))
        (port,) = self._start("dns", "0", f"allowed.test={self.ip}", f"other.test={self.ip2}")
        self.dns = f"{self.ip}:{port}"
        self._start("web", "web", "80")
        self._start("web", "tls", "443", str(cert), str(key))

    def _start(self, *args: str) -> list[int]:
        proc = subprocess.Popen(["nsenter", f"--net=/run/netns/{self.ns}", "--", sys.executable, PROBE, *args],
                                stdout=subprocess.PIPE)
        self._procs.append(proc)
        assert proc.stdout is not None
        words = proc.stdout.readline().decode().split()
        assert words and words[0] == "ready", f"nsprobe {args} did not start"
        return [int(p) for p in words[1:]]

    def node_env(self) -> dict[str, str]:
        """The node's configuration for egress through this internet only."""
        return {"AENV_NET_EGRESS": "true", "AENV_NET_UPLINKS": self.link, "AENV_NET_DNS_UPSTREAMS": self.dns,
                "AENV_NET_DNS_PORT": str(free_port()), "AENV_NET_EGRESS_PROXY_PORT": str(free_port())}

    def remove(self) -> None:
        for proc in self._procs:
            proc.kill()
            proc.wait()
        subprocess.run(["ip", "link", "del", self.link], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True)


def ip_forward() -> str:
    return Path("/proc/sys/net/ipv4/ip_forward").read_text().strip() if os.path.exists(
        "/proc/sys/net/ipv4/ip_forward") else ""
