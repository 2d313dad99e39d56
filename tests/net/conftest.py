"""A network lab for the slot tests: real namespaces, no VM.

* a guest is simulated by a namespace whose ``eth0`` is the peer of the slot's ``tap0`` (the slot's
  ``test_guest_netns`` option), configured exactly as a VM's eth0 would be;
* "the internet" is a namespace ``aenvt-<tag>-inet`` linked to the host by a veth of its own, with
  198.18.X.1 on the link and 198.19.X.1 on its loopback (the benchmarking range, RFC 2544). The
  slots' config names that veth as the ONLY uplink, so guest traffic can never leave by a real
  interface; and the tests only ever address their own namespaces and the host.

Every namespace, link, nft table and process the lab makes is removed when the test ends, pass or
fail. Names carry a random tag per test so parallel runs do not collide.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import trio

from aenv_node.net import (
    NetworkConfig,
    ensure_host_networking,
    remove_orphans,
    teardown_host_networking,
)

PROBE = str(Path(__file__).with_name("nsprobe.py"))


def _can_run() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces, nftables)"
    for tool in ("ip", "nft", "nsenter", "sysctl"):
        if shutil.which(tool) is None:
            return f"needs the {tool} command"
    return None


_why_not = _can_run()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if _why_not is not None:
        for item in items:
            if "tests/net" in str(item.path):
                item.add_marker(pytest.mark.skip(reason=_why_not))


@pytest.fixture(scope="session", autouse=True)
def _restore_ip_forward():
    """ensure_host_networking switches IPv4 forwarding on (as the node does for good); put the
    machine back as we found it after the test session."""
    path = Path("/proc/sys/net/ipv4/ip_forward")
    before = path.read_text().strip() if path.exists() else None
    yield
    if before is not None and path.read_text().strip() != before:
        path.write_text(before + "\n")


def _sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, check=check)


@dataclass
class Lab:
    tag: str
    pool_cidr: str
    inet_ns: str
    inet_if: str
    inet_ip: str  # the internet's address on its link
    inet_ip2: str  # a second internet address (on its loopback)
    host_inet_ip: str  # the host's address on the internet link
    _procs: list[trio.Process] = field(default_factory=list)
    _guests: list[str] = field(default_factory=list)
    _configs: list[NetworkConfig] = field(default_factory=list)

    def config(self, **kw) -> NetworkConfig:
        kw.setdefault("uplinks", (self.inet_if,))
        cfg = NetworkConfig(node_tag=self.tag, pool_cidr=self.pool_cidr, **kw)
        self._configs.append(cfg)
        return cfg

    async def host_networking(self, **kw) -> NetworkConfig:
        cfg = self.config(**kw)
        await ensure_host_networking(cfg)
        return cfg

    def guest_netns(self) -> str:
        name = f"aenvt-{self.tag}-g{len(self._guests)}"
        _sh("ip", "netns", "add", name)
        self._guests.append(name)
        return name

    async def serve(self, netns: str | None, name: str, ports: tuple[int, ...] = (0,)) -> list[int]:
        """Start a probe server in ``netns`` (None: the host) on 0.0.0.0; return its ports."""
        return await self.probe_server(netns, "serve", name, *map(str, ports))

    async def probe_server(self, netns: str | None, *args: str) -> list[int]:
        """Start ``nsprobe.py ARGS`` (a server) in ``netns`` (None: the host); return the ports it says."""
        prefix = [] if netns is None else ["nsenter", f"--net=/run/netns/{netns}", "--"]
        proc = await trio.lowlevel.open_process(
            [*prefix, sys.executable, PROBE, *args],
            stdout=subprocess.PIPE,
        )
        self._procs.append(proc)
        assert proc.stdout is not None
        buf = b""
        with trio.fail_after(10):
            while not buf.endswith(b"\n"):
                chunk = await proc.stdout.receive_some(256)
                assert chunk, "probe server died"
                buf += chunk
        words = buf.decode().split()
        assert words[0] == "ready", buf
        return [int(p) for p in words[1:]]

    async def connect(
        self, netns: str | None, host: str, port: int, timeout: float = 1.0, *, src: str | None = None
    ) -> str | None:
        """Connect from ``netns`` (None: the host); the server's answer, or None if unreachable."""
        return await self.probe(netns, "connect", host, str(port), str(timeout), *([src] if src else []))

    async def probe(self, netns: str | None, *args: str) -> str | None:
        """Run ``nsprobe.py ARGS`` (a client) in ``netns`` (None: the host): what it printed, or None when
        it failed."""
        prefix = [] if netns is None else ["nsenter", f"--net=/run/netns/{netns}", "--"]
        res = await trio.run_process(
            [*prefix, sys.executable, PROBE, *args],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
        out = res.stdout.decode().strip()
        return out if res.returncode == 0 else None

    async def cleanup(self) -> None:
        for proc in self._procs:
            if proc.returncode is None:
                proc.kill()
            await proc.wait()
        for cfg in self._configs[:1]:  # every config of the lab shares tag and pool
            await remove_orphans(cfg)
            await teardown_host_networking(cfg)
        for g in self._guests:
            _sh("ip", "netns", "del", g, check=False)
        _sh("ip", "link", "del", self.inet_if, check=False)
        _sh("ip", "netns", "del", self.inet_ns, check=False)


def leftovers(tag: str) -> list[str]:
    """Anything of the lab's tag still on the host: namespaces, links, nft tables."""
    found = []
    found += [n for n in _sh("ip", "netns", "list").stdout.split() if tag in n]
    found += [line for line in _sh("ip", "-o", "link").stdout.splitlines() if tag in line]
    found += [line for line in _sh("nft", "list", "tables").stdout.splitlines() if tag in line]
    return found


@pytest.fixture
async def lab() -> AsyncIterator[Lab]:
    tag = "t" + "".join(secrets.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(3))
    x = secrets.randbelow(64) * 4
    link = ipaddress.IPv4Network(f"198.18.{secrets.randbelow(256)}.{x}/30")
    lab = Lab(
        tag=tag,
        # 10.150-199: the benches' nodes hold /16s of 10.200-249 (bench/_node.py), and CI smokes the benches
        pool_cidr=f"10.{150 + secrets.randbelow(50)}.{secrets.randbelow(256)}.0/24",
        inet_ns=f"aenvt-{tag}-inet",
        inet_if=f"at{tag}i",
        inet_ip=str(link.network_address + 1),
        inet_ip2=f"198.19.{link.network_address.packed[2]}.{x + 1}",
        host_inet_ip=str(link.network_address + 2),
    )
    try:
        _sh("ip", "netns", "add", lab.inet_ns)
        _sh("ip", "link", "add", lab.inet_if, "type", "veth", "peer", "name", "eth0", "netns", lab.inet_ns)
        _sh("ip", "addr", "add", f"{lab.host_inet_ip}/30", "dev", lab.inet_if)
        _sh("ip", "link", "set", lab.inet_if, "up")
        _sh("ip", "route", "add", f"{lab.inet_ip2}/32", "via", lab.inet_ip, "dev", lab.inet_if)
        for cmd in (
            "link set lo up",
            f"addr add {lab.inet_ip}/30 dev eth0",
            f"addr add {lab.inet_ip2}/32 dev lo",
            "link set eth0 up",
        ):
            _sh("ip", "-n", lab.inet_ns, *cmd.split())
        yield lab
    finally:
        with trio.CancelScope(shield=True):
            await lab.cleanup()
        left = leftovers(tag)
        assert not left, f"the lab left things behind: {left}"
