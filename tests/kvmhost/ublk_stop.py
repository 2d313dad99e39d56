"""Runs INSIDE the KVM host VM (tests/kvmhost/test_firecracker.py, through the VM's debug shell): stop the ublk
disk of one sandbox from outside the node, as an operator's ``ublk del`` or a dying server's cleanup would.

``ublk_stop.py SANDBOX_ID``: the sandbox's Firecracker pid from the node's SQLite, its ``/dev/ublkbN`` from that
process's open files, then STOP_DEV for N through a control ring of this process's own. Prints ``STOPPED N``.
"""

from __future__ import annotations

import os
import re
import sqlite3
import sys

from aenv_node.storage.frontends.errors import UblkError
from aenv_node.storage.frontends.ublk import stop_device


def ublk_of(pid: int) -> int:
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if m := re.fullmatch(r"/dev/ublkb(\d+)", target):
            return int(m.group(1))
    raise SystemExit(f"process {pid} has no /dev/ublkbN open")


def main() -> None:
    con = sqlite3.connect("file:/var/lib/aenv/aenv.db?mode=ro", uri=True)
    (pid,), = con.execute("SELECT vmm_pid FROM sandboxes WHERE id = ?", (sys.argv[1],)).fetchall()
    dev_id = ublk_of(pid)
    try:
        stop_device(dev_id)
    except UblkError as exc:
        raise SystemExit(f"STOP_DEV of ublk device {dev_id} failed: {exc}") from None
    print(f"STOPPED {dev_id}", flush=True)


if __name__ == "__main__":
    main()
