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

from aenv_node.storage.frontends.io_uring import OP_URING_CMD, Ring
from aenv_node.storage.frontends.ublk import _CTRL_CMD, CONTROL_PATH, U_CMD_STOP_DEV


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
    fd = os.open(CONTROL_PATH, os.O_RDWR)
    ring = Ring(4, sqe128=True)
    try:
        ring.prep(OP_URING_CMD, fd, off=U_CMD_STOP_DEV, user_data=1, cmd=_CTRL_CMD.pack(dev_id, 0xFFFF, 0, 0, 0, 0))
        ring.submit(wait=1)
        (_ud, res, _flags), = ring.completions()
    finally:
        ring.close()
        os.close(fd)
    if res != 0:
        raise SystemExit(f"STOP_DEV of ublk device {dev_id} failed: {os.strerror(-res)}")
    print(f"STOPPED {dev_id}", flush=True)


if __name__ == "__main__":
    main()
