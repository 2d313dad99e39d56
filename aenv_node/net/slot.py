"""Network slots: one network namespace per sandbox, holding the VM's tap device.

Layout of slot ``i`` of node ``<tag>`` (defaults)::

    host (root netns)                 netns aenv-<tag>-<i>                         guest (VM)
    ae<tag>-<i>  10.11.x.1/30 <veth> veth0 10.11.x.2/30     tap0 169.254.0.22/30 <tap> eth0 169.254.0.21/30
                                       DNAT 10.11.x.2 -> 169.254.0.21 (host reaches guest ports)
                                       SNAT 169.254.0.21 -> 10.11.x.2 (guest egress), egress policy

The guest side is identical in every slot (addresses, the tap's name ``tap0`` and both MAC
addresses), so a snapshot taken in one slot restores in any other without touching the guest: its
IP configuration, its ARP entry for the gateway and the VMM's device config (Firecracker records the
tap name in its snapshot) all stay valid. What makes a slot unique is its veth pair: the address
``Slot.address`` (the namespace end, ``10.11.x.2``) is where the host, and only the host, reaches the
guest's ports.

All per-slot state lives in the slot's namespace and its veth pair; the host carries no per-slot
rules (its table matches slot interfaces by name prefix, see ``egress.py``). So deleting the veth and
the namespace removes a slot completely, and the names alone (``aenv-<tag>-<i>``, ``ae<tag>-<i>``)
let the reconciler find what a crashed node left behind (``list_slots`` / ``remove_orphans``).

Every step runs ``ip`` / ``nft`` / ``nsenter`` through ``trio.run_process`` (see ``_cmd.py`` for why
commands rather than pyroute2). Creation is all-or-nothing: a failure or cancellation part way
tears down whatever was made, shielded from cancellation.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import re
from collections.abc import AsyncIterator, Collection
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import trio

from . import conntrack
from ._cmd import IGNORED_ON_DELETE, netns_path, run, run_in_netns
from .egress import EgressPolicy, apply_egress, blocked_set, egress_chain_rules, redirect_chain_rules
from .errors import NetCommandError, NetError, SlotError

__all__ = [
    "DEFAULT_BLOCKED_CIDRS",
    "NetworkConfig",
    "Slot",
    "FoundSlot",
    "create_slot",
    "destroy_slot",
    "open_slot",
    "list_slots",
    "remove_orphans",
]

log = logging.getLogger(__name__)

# Destinations no sandbox may reach whatever its allowOut says (E2B blocks the private ranges the
# same way): private networks (the node's LAN, cloud metadata), link-local, loopback, CGNAT,
# "this network", multicast and reserved. The slot pool is always added on top.
DEFAULT_BLOCKED_CIDRS: tuple[str, ...] = (
    "0.0.0.0/8",
    "10.0.0.0/8",
    "100.64.0.0/10",
    "127.0.0.0/8",
    "169.254.0.0/16",
    "172.16.0.0/12",
    "192.168.0.0/16",
    "224.0.0.0/4",
    "240.0.0.0/4",
)

_TAG = re.compile(r"^[a-z0-9]{1,4}$")
NS_VETH = "veth0"
TAP = "tap0"


@dataclass(frozen=True)
class NetworkConfig:
    """Parameters of a node's network slots (all of them node config keys, see the package docs).

    ``node_tag`` makes every name unique per node on a host and recognisable for reconciliation.
    ``uplinks``: interfaces guest traffic may leave the host by (empty: any interface but the
    slots'); the tests give their own fake "internet" link here so nothing can ever reach a real
    network. ``dns_port`` / ``proxy_port``: where the node's DNS forwarder and egress proxy listen on
    the host (None: the node runs none; guest DNS then goes out as any traffic, domain entries open
    nothing). Slots made with a DNS port send every guest DNS packet (port 53) to it.
    """

    node_tag: str
    pool_cidr: str = "10.11.0.0/16"
    slot_prefixlen: int = 30
    egress: bool = True
    uplinks: tuple[str, ...] = ()
    blocked_cidrs: tuple[str, ...] = DEFAULT_BLOCKED_CIDRS
    guest_ip: str = "169.254.0.21"
    tap_ip: str = "169.254.0.22"
    guest_prefixlen: int = 30
    guest_mac: str = "02:ae:00:00:00:21"
    tap_mac: str = "02:ae:00:00:00:22"
    dns_port: int | None = None
    proxy_port: int | None = None
    pool: ipaddress.IPv4Network = field(init=False, repr=False, compare=False)
    blocked: tuple[ipaddress.IPv4Network, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not _TAG.match(self.node_tag):
            raise ValueError(f"node_tag {self.node_tag!r} must be 1-4 characters of [a-z0-9]")
        pool = ipaddress.ip_network(self.pool_cidr)
        if not isinstance(pool, ipaddress.IPv4Network):
            raise ValueError(f"pool_cidr {self.pool_cidr!r} must be an IPv4 network")
        if not (pool.prefixlen <= self.slot_prefixlen <= 30):
            raise ValueError(
                f"slot_prefixlen {self.slot_prefixlen} must be between the pool's /{pool.prefixlen} and /30"
            )
        blocked = tuple(ipaddress.IPv4Network(c) for c in self.blocked_cidrs)
        object.__setattr__(self, "pool", pool)
        object.__setattr__(self, "blocked", blocked)
        for u in self.uplinks:
            if u.startswith(self.host_veth_prefix):
                raise ValueError(f"uplink {u!r} is a slot interface of this node")

    @property
    def capacity(self) -> int:
        """How many slots the pool holds (indexes 0 .. capacity-1)."""
        return 1 << (self.slot_prefixlen - self.pool.prefixlen)

    @property
    def netns_prefix(self) -> str:
        return f"aenv-{self.node_tag}-"

    @property
    def host_veth_prefix(self) -> str:
        return f"ae{self.node_tag}-"

    def netns_name(self, index: int) -> str:
        return f"{self.netns_prefix}{index}"

    def host_veth_name(self, index: int) -> str:
        return f"{self.host_veth_prefix}{index}"

    def subnet(self, index: int) -> ipaddress.IPv4Network:
        if not (0 <= index < self.capacity):
            raise SlotError(
                f"slot index {index} is outside the pool {self.pool} "
                f"(0..{self.capacity - 1} with /{self.slot_prefixlen} slots)"
            )
        size = 1 << (32 - self.slot_prefixlen)
        base = int(self.pool.network_address) + index * size
        return ipaddress.IPv4Network((base, self.slot_prefixlen))

    def slot_of_address(self, address: str) -> int | None:
        """The index of the slot whose namespace end is ``address`` (where its guest's traffic comes
        from, after the slot's source NAT), or None when no slot of this pool has that address."""
        try:
            ip = ipaddress.IPv4Address(address)
        except ValueError:
            return None
        if ip not in self.pool:
            return None
        offset = int(ip) - int(self.pool.network_address)
        index, host = divmod(offset, 1 << (32 - self.slot_prefixlen))
        return index if host == 2 else None

    def slot(self, index: int, *, test_guest_netns: str | None = None) -> Slot:
        """The description of slot ``index`` (nothing is created)."""
        net = self.subnet(index)
        return Slot(
            config=self,
            index=index,
            netns=self.netns_name(index),
            host_veth=self.host_veth_name(index),
            ns_veth=NS_VETH,
            tap=TAP,
            host_ip=str(net.network_address + 1),
            ns_ip=str(net.network_address + 2),
            prefixlen=self.slot_prefixlen,
            guest_ip=self.guest_ip,
            tap_ip=self.tap_ip,
            guest_prefixlen=self.guest_prefixlen,
            guest_mac=self.guest_mac,
            tap_mac=self.tap_mac,
            test_guest_netns=test_guest_netns,
        )


@dataclass(frozen=True)
class Slot:
    """One sandbox's network: names and addresses. Created by ``create_slot`` / ``SlotPool``.

    For the VMM: run it inside ``netns`` (``nsenter_argv`` / ``netns_path``; Firecracker's jailer
    takes ``--netns netns_path``), attach the tap ``tap`` and give the guest ``guest_mac``; the guest
    uses ``guest_ip``/``guest_prefixlen`` with gateway ``tap_ip``. The host reaches guest port P at
    ``address``:P.

    ``test_guest_netns``: tests only. Instead of a tap, ``tap0`` is one end of a veth pair whose other
    end (``eth0``, configured exactly as a guest would be) lives in that existing namespace, so
    guest traffic can be simulated without a VM.
    """

    config: NetworkConfig = field(repr=False, compare=False)
    index: int
    netns: str
    host_veth: str
    ns_veth: str
    tap: str
    host_ip: str
    ns_ip: str
    prefixlen: int
    guest_ip: str
    tap_ip: str
    guest_prefixlen: int
    guest_mac: str
    tap_mac: str
    test_guest_netns: str | None = None

    @property
    def address(self) -> str:
        """The address the host connects to in order to reach the guest's ports (DNATed)."""
        return self.ns_ip

    @property
    def proxy_address(self) -> str | None:
        """Where the slot sends connections for a domain check (its host end), None: no proxy."""
        return self.host_ip if self.config.proxy_port is not None else None

    @property
    def netns_path(self) -> str:
        return netns_path(self.netns)

    def nsenter_argv(self) -> list[str]:
        """Prefix that runs a command (the VMM) inside the slot's namespace."""
        return ["nsenter", f"--net={self.netns_path}", "--"]

    async def apply_egress(self, policy: EgressPolicy, *, replace: bool = True) -> None:
        """See ``egress.apply_egress``."""
        await apply_egress(self, policy, replace=replace)

    async def reset(self, *, keep_default_egress: bool = False) -> None:
        """Make the slot fit for another sandbox: its connection-tracking table is flushed (no NAT or
        "established" state survives from the previous guest) and the default egress policy put back (allow
        all but the always-blocked ranges). ``keep_default_egress``: the caller knows the slot still has the
        default policy (``SlotPool`` tracks it), so ``nft`` is not run to set it again."""
        if not keep_default_egress:
            await self.apply_egress(EgressPolicy())
        await flush_conntrack(self)

    async def destroy(self) -> None:
        await destroy_slot(self.config, self.index)


def _slot_ruleset(slot: Slot, policy: EgressPolicy) -> str:
    cfg = slot.config
    tap, veth = f'"{slot.tap}"', f'"{slot.ns_veth}"'
    egress = "\n".join(f"    {r}" for r in egress_chain_rules(policy))
    redirect = "\n".join(f"    {r}" for r in redirect_chain_rules(policy, slot.proxy_address))
    dns = (f'    iifname {tap} meta l4proto {{ tcp, udp }} th dport 53 dnat ip to {slot.host_ip}\n'
           if cfg.dns_port is not None else "")
    return f"""\
table inet aenv {{
  set blocked {{
    type ipv4_addr; flags interval;
    elements = {blocked_set(cfg)}
  }}
  chain egress_user {{
{egress}
  }}
  chain egress_redirect {{
{redirect}
  }}
  chain forward {{
    type filter hook forward priority filter; policy drop;
    iifname {tap} ip saddr != {slot.guest_ip} counter drop comment "spoofed source"
    iifname {veth} oifname {tap} ip saddr {slot.host_ip} ct status dnat accept
    iifname {veth} oifname {tap} ct state established,related accept
    iifname {tap} oifname {veth} ct status dnat accept
    iifname {tap} oifname {veth} ip daddr @blocked drop
    iifname {tap} oifname {veth} meta nfproto ipv4 jump egress_user
    iifname {tap} oifname {veth} meta nfproto ipv4 accept
  }}
  chain input {{
    type filter hook input priority filter; policy drop;
    iif "lo" accept
    ct state established,related accept
  }}
  chain prerouting {{
    type nat hook prerouting priority dstnat; policy accept;
    iifname {veth} ip daddr {slot.ns_ip} dnat ip to {slot.guest_ip}
{dns}    iifname {tap} jump egress_redirect
  }}
  chain postrouting {{
    type nat hook postrouting priority srcnat; policy accept;
    oifname {veth} ip saddr {slot.guest_ip} snat ip to {slot.ns_ip}
  }}
}}
"""


def _batch(*lines: str) -> bytes:
    return ("\n".join(lines) + "\n").encode()


async def create_slot(
    config: NetworkConfig,
    index: int,
    *,
    policy: EgressPolicy | None = None,
    test_guest_netns: str | None = None,
) -> Slot:
    """Create slot ``index``: namespace, veth pair, tap, NAT and the egress policy (default: allow
    all but the always-blocked ranges). All or nothing; raises SlotError if the slot's names are
    already taken (a leftover: ``remove_orphans`` clears it)."""
    slot = config.slot(index, test_guest_netns=test_guest_netns)
    if await trio.Path(slot.netns_path).exists():
        raise SlotError(
            f"network namespace {slot.netns} already exists: a leftover of an earlier run? "
            "remove it with remove_orphans() (the node's reconciler does this on start)"
        )
    guest_net = f"{slot.tap_ip}/{slot.guest_prefixlen}"
    try:
        await run(["ip", "netns", "add", slot.netns], context=f"creating slot {index}")
        await run_in_netns(
            slot.netns,
            [
                "sysctl", "-q", "-w",
                "net.ipv4.ip_forward=1",
                "net.ipv6.conf.all.disable_ipv6=1",
                "net.ipv6.conf.default.disable_ipv6=1",
            ],
            context=f"creating slot {index}",
        )  # fmt: skip
        await run(
            ["ip", "-batch", "-"],
            stdin=_batch(
                f"link add {slot.host_veth} type veth peer name {slot.ns_veth} netns {slot.netns}",
                f"addr add {slot.host_ip}/{slot.prefixlen} dev {slot.host_veth}",
                f"link set {slot.host_veth} up",
            ),
            context=f"creating slot {index}",
        )
        if test_guest_netns is None:
            tap_add = f"tuntap add dev {slot.tap} mode tap"
        else:
            tap_add = f"link add {slot.tap} type veth peer name eth0 netns {test_guest_netns}"
        await run(
            ["ip", "-n", slot.netns, "-batch", "-"],
            stdin=_batch(
                "link set lo up",
                f"addr add {slot.ns_ip}/{slot.prefixlen} dev {slot.ns_veth}",
                f"link set {slot.ns_veth} up",
                tap_add,
                f"link set {slot.tap} address {slot.tap_mac}",
                f"addr add {guest_net} dev {slot.tap}",
                f"link set {slot.tap} up",
                f"route add default via {slot.host_ip} dev {slot.ns_veth}",
            ),
            context=f"creating slot {index}",
        )
        if test_guest_netns is not None:
            await run(
                ["ip", "-n", test_guest_netns, "-batch", "-"],
                stdin=_batch(
                    "link set lo up",
                    f"link set eth0 address {slot.guest_mac}",
                    f"addr add {slot.guest_ip}/{slot.guest_prefixlen} dev eth0",
                    "link set eth0 up",
                    f"route add default via {slot.tap_ip} dev eth0",
                ),
                context=f"creating slot {index} (test guest)",
            )
        await run_in_netns(
            slot.netns,
            ["nft", "-f", "-"],
            stdin=_slot_ruleset(slot, policy or EgressPolicy()).encode(),
            context=f"creating slot {index} (nftables)",
        )
    except BaseException as exc:
        with trio.CancelScope(shield=True):
            try:
                await destroy_slot(config, index)
            except NetError as cleanup_exc:  # keep the original error; log the cleanup one
                log.error("cleanup of half-created slot %d failed: %s", index, cleanup_exc)
        if isinstance(exc, NetCommandError):
            raise SlotError(str(exc)) from exc
        raise
    return slot


async def destroy_slot(config: NetworkConfig, index: int) -> None:
    """Remove everything of slot ``index``: the veth pair, the namespace (with its tap and its
    nftables table). Idempotent: missing pieces are fine. Both removals are always tried, then
    SlotError lists what failed. The veth is deleted explicitly rather than left to the
    namespace's asynchronous cleanup, so the slot's names are free again when this returns.
    (Running the two concurrently gains nothing: both serialise on the kernel's RTNL lock.)"""
    errors: list[str] = []
    for argv in (
        ["ip", "link", "del", config.host_veth_name(index)],
        ["ip", "netns", "del", config.netns_name(index)],
    ):
        try:
            await run(argv, ok_if=IGNORED_ON_DELETE)
        except NetCommandError as e:
            errors.append(str(e))
    if errors:
        raise SlotError(f"removing slot {index} failed: " + "; ".join(errors))


@asynccontextmanager
async def open_slot(
    config: NetworkConfig,
    index: int,
    *,
    policy: EgressPolicy | None = None,
    test_guest_netns: str | None = None,
) -> AsyncIterator[Slot]:
    """A slot that exists for the duration of the ``async with`` block."""
    slot = await create_slot(config, index, policy=policy, test_guest_netns=test_guest_netns)
    try:
        yield slot
    finally:
        with trio.CancelScope(shield=True):
            await destroy_slot(config, index)


async def flush_conntrack(slot: Slot) -> None:
    """Flush the slot namespace's connection-tracking table (what ``conntrack -F`` does, over netlink:
    net/conntrack.py)."""
    await conntrack.flush_table(Path(slot.netns_path), context=f"flushing connection tracking of slot {slot.index}")


@dataclass(frozen=True)
class FoundSlot:
    """A slot's pieces found on the host (for reconciliation)."""

    index: int
    netns: bool
    host_veth: bool


async def list_slots(config: NetworkConfig) -> list[FoundSlot]:
    """Every slot of this node (by name) present on the host, complete or partial, by index."""
    ns_re = re.compile(rf"^{re.escape(config.netns_prefix)}(\d+)$")
    if_re = re.compile(rf"^{re.escape(config.host_veth_prefix)}(\d+)$")

    def _netns_names() -> list[str]:
        try:
            return os.listdir("/run/netns")
        except FileNotFoundError:
            return []

    netns_idx = {
        int(m.group(1)) for n in await trio.to_thread.run_sync(_netns_names) if (m := ns_re.match(n))
    }
    links = json.loads(await run(["ip", "-j", "link", "show"], context="listing slots") or "[]")
    veth_idx = {int(m.group(1)) for link in links if (m := if_re.match(link.get("ifname", "")))}
    return [
        FoundSlot(i, i in netns_idx, i in veth_idx) for i in sorted(netns_idx | veth_idx)
    ]


async def remove_orphans(config: NetworkConfig, keep: Collection[int] = ()) -> list[int]:
    """Destroy every slot of this node found on the host whose index is not in ``keep`` (the slots
    the node's database says are in use). Returns the indexes removed."""
    removed = []
    for found in await list_slots(config):
        if found.index in keep:
            continue
        await destroy_slot(config, found.index)
        removed.append(found.index)
    if removed:
        log.info("removed %d orphaned network slot(s): %s", len(removed), removed)
    return removed
