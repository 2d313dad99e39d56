"""Running the host's networking commands from Trio.

Why commands and not pyroute2: slots are built with ``ip`` and ``nft`` run through
``trio.run_process``. ``nft -f`` applies a whole ruleset as one atomic kernel transaction with
nftables' own parser (pyroute2's nftables support is low level and partial); entering a network
namespace happens in a child process (``ip -n``, ``nsenter --net``), never by ``setns()`` on one of
Trio's reused worker threads, where a forgotten switch back would silently move unrelated work into a
sandbox's namespace; and every step is a command an operator can replay by hand while debugging.
The price is a few process spawns per slot (a few ms each), paid by the warm pool's refiller, not by
``acquire()``. The one step every sandbox's release runs, the conntrack flush, is done in-process instead
(``conntrack.py``: one netlink message, from a thread of its own that ends after entering the namespace).
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence

import trio

from .errors import NetCommandError

__all__ = ["run", "run_in_netns", "netns_path", "which", "IGNORED_ON_DELETE"]

# stderr fragments that mean "already gone": deletes are idempotent.
IGNORED_ON_DELETE = (
    "Cannot find device",
    "No such device",
    "No such file or directory",
    "does not exist",
    "No such process",
)


def netns_path(name: str) -> str:
    """Where ``ip netns`` keeps the bind mount of a named network namespace."""
    return f"/run/netns/{name}"


async def run(
    argv: Sequence[str],
    *,
    stdin: bytes | None = None,
    context: str = "",
    ok_if: Sequence[str] = (),
) -> str:
    """Run ``argv``; return its stdout. Raise NetCommandError unless it succeeds.

    ``ok_if``: stderr fragments for which a failure counts as success (idempotent deletes).
    """
    proc = await trio.run_process(
        list(argv),
        stdin=stdin if stdin is not None else b"",
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )
    if proc.returncode != 0:
        err = proc.stderr.decode(errors="replace")
        if any(frag in err for frag in ok_if):
            return ""
        raise NetCommandError(argv, proc.returncode, err, context=context)
    return proc.stdout.decode(errors="replace")


async def run_in_netns(
    netns: str,
    argv: Sequence[str],
    *,
    stdin: bytes | None = None,
    context: str = "",
    ok_if: Sequence[str] = (),
) -> str:
    """Run ``argv`` inside the named network namespace (``nsenter --net``: no mount-namespace work,
    unlike ``ip netns exec``, so it is cheaper)."""
    return await run(
        ["nsenter", f"--net={netns_path(netns)}", "--", *argv],
        stdin=stdin,
        context=context,
        ok_if=ok_if,
    )


def which(name: str) -> bool:
    """True when the command exists on PATH (checked without spawning it)."""
    return shutil.which(name) is not None
