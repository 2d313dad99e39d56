"""Typed errors of the network layer.

Every error names what failed and what a user can do about it; the API layer maps them to HTTP
(``EgressPolicyError`` is a user input error: 400; the others are node faults: 500).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "NetError",
    "NetCommandError",
    "SlotError",
    "PoolExhausted",
    "EgressPolicyError",
]


class NetError(Exception):
    """Base class of every error raised by ``aenv_node.net``."""


class NetCommandError(NetError):
    """A host networking command (``ip``, ``nft``, ``nsenter``) failed."""

    def __init__(self, argv: Sequence[str], returncode: int, stderr: str, *, context: str = ""):
        self.argv = list(argv)
        self.returncode = returncode
        self.stderr = stderr.strip()
        where = f"{context}: " if context else ""
        super().__init__(
            f"{where}`{' '.join(self.argv)}` exited with {returncode}: {self.stderr or '(no output)'}"
            " (the node needs root with CAP_NET_ADMIN, and iproute2, nftables and util-linux installed)"
        )


class SlotError(NetError):
    """A network slot could not be created, reset or removed."""


class PoolExhausted(NetError):
    """No free slot index is left in the configured address pool."""


class EgressPolicyError(NetError, ValueError):
    """An allowOut / denyOut entry is not something this node can enforce (bad CIDR, IPv6, ...)."""
