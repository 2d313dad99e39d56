"""Identifiers of the rows the node creates (snapshots, builds): a prefix and 80 random bits."""

from __future__ import annotations

import secrets

__all__ = ["new_id"]


def new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(10)}"
