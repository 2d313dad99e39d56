"""Network slots for sandboxes: a network namespace per sandbox holding the VM's tap device, a
unique veth address per slot for the host to reach the guest, NAT, an egress policy, isolation,
and a warm pool of prepared slots.

Public face:

* ``NetworkConfig``: the node's network parameters (node tag, pool CIDR, egress switch, uplinks).
* ``Slot`` + ``create_slot`` / ``destroy_slot`` / ``open_slot``: one slot.
* ``list_slots`` / ``remove_orphans``: reconciliation after a crash.
* ``SlotPool`` + ``IndexAllocator`` / ``MemoryIndexAllocator``: the warm pool.
* ``EgressPolicy`` + ``apply_egress``: E2B allowOut / denyOut (addresses and domain names) on a live slot.
* ``ensure_host_networking`` / ``teardown_host_networking``: the host's forwarding, isolation,
  masquerade and redirections to the node's services (once per node start / stop).
* ``DnsForwarder`` + ``Resolver``: the node's DNS for its guests; ``EgressProxy``: the domain check of
  ``allowOut`` names (SNI / Host).

Everything runs the ``ip``, ``nft`` and ``nsenter`` commands as root (and flushes a slot's connection
tracking over netlink).
"""

from .dns import DnsForwarder, Resolver, host_nameservers
from .egress import ALL_TRAFFIC, DomainRule, EgressPolicy, EgressRule, apply_egress
from .egress_proxy import EgressProxy
from .errors import EgressPolicyError, NetCommandError, NetError, PoolExhausted, SlotError
from .host_table import ensure_host_networking, teardown_host_networking
from .pool import IndexAllocator, MemoryIndexAllocator, SlotPool
from .slot import (
    DEFAULT_BLOCKED_CIDRS,
    FoundSlot,
    NetworkConfig,
    Slot,
    create_slot,
    destroy_slot,
    list_slots,
    open_slot,
    remove_orphans,
)

__all__ = [
    "ALL_TRAFFIC",
    "DEFAULT_BLOCKED_CIDRS",
    "DnsForwarder",
    "DomainRule",
    "EgressPolicy",
    "EgressPolicyError",
    "EgressProxy",
    "EgressRule",
    "FoundSlot",
    "IndexAllocator",
    "MemoryIndexAllocator",
    "NetCommandError",
    "NetError",
    "NetworkConfig",
    "PoolExhausted",
    "Resolver",
    "Slot",
    "SlotError",
    "SlotPool",
    "apply_egress",
    "create_slot",
    "destroy_slot",
    "ensure_host_networking",
    "host_nameservers",
    "list_slots",
    "open_slot",
    "remove_orphans",
    "teardown_host_networking",
]
