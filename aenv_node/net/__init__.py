"""Network slots for sandboxes: a network namespace per sandbox holding the VM's tap device, a
unique veth address per slot for the host to reach the guest, NAT, an egress policy, isolation,
and a warm pool of prepared slots.

Public face:

* ``NetworkConfig``: the node's network parameters (node tag, pool CIDR, egress switch, uplinks).
* ``Slot`` + ``create_slot`` / ``destroy_slot`` / ``open_slot``: one slot.
* ``list_slots`` / ``remove_orphans``: reconciliation after a crash.
* ``SlotPool`` + ``IndexAllocator`` / ``MemoryIndexAllocator``: the warm pool.
* ``EgressPolicy`` + ``apply_egress``: E2B allowOut / denyOut on a live slot.
* ``ensure_host_networking`` / ``teardown_host_networking``: the host's forwarding, isolation and
  masquerade (once per node start / stop).

Everything runs the ``ip``, ``nft``, ``nsenter`` (and optionally ``conntrack``) commands as root.
"""

from .egress import (
    ALL_TRAFFIC,
    EgressPolicy,
    EgressRule,
    apply_egress,
    ensure_host_networking,
    teardown_host_networking,
)
from .errors import EgressPolicyError, NetCommandError, NetError, PoolExhausted, SlotError
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
    "EgressPolicy",
    "EgressPolicyError",
    "EgressRule",
    "FoundSlot",
    "IndexAllocator",
    "MemoryIndexAllocator",
    "NetCommandError",
    "NetError",
    "NetworkConfig",
    "PoolExhausted",
    "Slot",
    "SlotError",
    "SlotPool",
    "apply_egress",
    "create_slot",
    "destroy_slot",
    "ensure_host_networking",
    "list_slots",
    "open_slot",
    "remove_orphans",
    "teardown_host_networking",
]
