"""Flush a network namespace's connection-tracking table over netlink, without a process.

A slot given back to the pool has its conntrack table flushed, so no NAT mapping or "established" state of
the previous guest survives into the next sandbox's. That runs on every kill; ``nsenter --net=... conntrack
-F`` cost two exec'd programs each time (about 1.8 ms of CPU in them, and the node's own cost of spawning them,
measured under the control-plane bench's create -> kill churn). The flush is a single ctnetlink request, so
it is written here: one ``IPCTNL_MSG_CT_DELETE`` with no tuple is the kernel's "flush the table", and
``AF_UNSPEC`` in its header makes it flush IPv4 and IPv6 alike (what ``conntrack -F`` does per family).
A netlink library (pyroute2) would have been a large dependency for one message of 20 bytes.

The socket has to be made inside the slot's namespace (a netlink socket belongs to the namespace of the
thread that created it): a short thread of its own makes it (``aenv_node/netns.py``). The request and its
acknowledgement then go over that socket from the caller's worker thread.
"""

from __future__ import annotations

import errno
import os
import socket
import struct
from pathlib import Path

import trio

from ..netns import call_in_netns
from .errors import SlotError

__all__ = ["flush_table"]

NETLINK_NETFILTER = 12
NFNL_SUBSYS_CTNETLINK = 1
IPCTNL_MSG_CT_DELETE = 2
NLM_F_REQUEST = 0x1
NLM_F_ACK = 0x4
NLMSG_ERROR = 0x2

_NLMSGHDR = struct.Struct("=IHHII")  # length, type, flags, sequence, port id
_NFGENMSG = struct.Struct("=BBH")  # family, version (NFNETLINK_V0), resource id (big-endian; 0)

def flush_request(seq: int) -> bytes:
    """The netlink message asking ctnetlink to delete every entry of every family."""
    body = _NFGENMSG.pack(socket.AF_UNSPEC, 0, 0)
    msg_type = (NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_DELETE
    return _NLMSGHDR.pack(_NLMSGHDR.size + len(body), msg_type, NLM_F_REQUEST | NLM_F_ACK, seq, 0) + body


def _socket_in(netns: Path) -> socket.socket:
    """A netfilter netlink socket of the namespace at ``netns`` (made by a thread of its own: ``netns.py``)."""
    return call_in_netns(
        netns, lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, NETLINK_NETFILTER)
    )


def _flush_sync(netns: Path) -> None:
    with _socket_in(netns) as sock:
        sock.settimeout(5.0)
        sock.bind((0, 0))
        seq = 1
        sock.send(flush_request(seq))
        while True:
            data = sock.recv(65536)
            offset = 0
            while offset + _NLMSGHDR.size <= len(data):
                length, msg_type, _flags, reply_seq, _pid = _NLMSGHDR.unpack_from(data, offset)
                if msg_type == NLMSG_ERROR and reply_seq == seq:
                    (code,) = struct.unpack_from("=i", data, offset + _NLMSGHDR.size)
                    if code == 0 or code == -errno.ENOENT:  # acknowledged; ENOENT: the table was empty
                        return
                    raise OSError(-code, os.strerror(-code))
                if length < _NLMSGHDR.size:
                    raise OSError(errno.EPROTO, "malformed netlink reply")
                offset += (length + 3) & ~3


async def flush_table(netns: Path, *, context: str) -> None:
    """Delete every connection-tracking entry of the network namespace at ``netns``.

    Raises SlotError (with ``context``) when the kernel refuses or the namespace is gone.
    """
    try:
        await trio.to_thread.run_sync(_flush_sync, netns)
    except OSError as exc:
        raise SlotError(f"{context}: {exc}") from exc
