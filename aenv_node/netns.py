"""One call made inside a network namespace, from a thread of its own.

A tun file or a netlink socket belongs, for its whole life, to the network namespace of the thread that opened
it; ``setns`` moves only the calling thread. So the call runs in a thread started for it, which enters the
namespace, makes the object and ends: no thread that runs other work (Trio's worker threads, reused for any
job) ever changes namespace, and a failed switch back cannot leave one behind. Python 3.11 has no
``os.setns``: libc's is called through ctypes.

Used by ``vmm/`` (a jailed Firecracker's tap) and ``net/`` (a slot's conntrack flush); imports nothing from
the node.
"""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path
from typing import Callable, TypeVar

__all__ = ["call_in_netns"]

T = TypeVar("T")

CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def call_in_netns(netns: Path, fn: Callable[[], T], *, name: str = "aenv-netns") -> T:
    """``fn()`` called in a new thread that first enters the network namespace at ``netns`` (a bind mount such
    as ``/run/netns/NAME``). Blocking (it joins the thread): from async code, call it through a worker thread.
    Raises OSError when the namespace cannot be entered, or whatever ``fn`` raises."""
    result: list[T] = []
    errors: list[BaseException] = []

    def enter_and_call() -> None:
        try:
            fd = os.open(netns, os.O_RDONLY | os.O_CLOEXEC)
            try:
                if _libc.setns(fd, CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"setns into {netns}: {os.strerror(err)}")
            finally:
                os.close(fd)
            result.append(fn())
        except BaseException as exc:  # handed to the caller
            errors.append(exc)

    thread = threading.Thread(target=enter_and_call, name=name)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return result[0]
