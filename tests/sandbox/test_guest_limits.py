"""A runaway guest hurts only itself: a memory hog and a fork bomb inside one sandbox leave the node and a
neighbour sandbox answering, and the runaway sandbox can still be killed with nothing left behind.

What holds it: the guest's own kernel (its RAM is the VM's: the hog meets the guest's OOM killer, never the
host's), and the VMM's cgroup on the host (CPU quota and shares, memory, tasks: vmm/cgroup.py)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox

from .conftest import NodeProcess, processes_mentioning

pytestmark = pytest.mark.vm

HOG = "python3 -c 'a = []\nwhile True: a.append(bytearray(64 << 20))'"
BOMB = "bash -c 'b() { b | b & }; b'"


def _cpu_s(sandbox_id: str) -> float:
    """CPU seconds the sandbox's VMM process has used so far."""
    (pid,) = [p for p in processes_mentioning(sandbox_id) if "qemu" in Path(f"/proc/{p}/exe").resolve().name
              or "firecracker" in Path(f"/proc/{p}/exe").resolve().name]
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _answers(node: NodeProcess, neighbour: Sandbox) -> None:
    """The node's API and the neighbour's envd both answer (generous deadlines: this is about being alive
    under a 2-core TCG host whose cores the runaway guest keeps busy, not about speed)."""
    assert httpx.get(node.url + "/health", timeout=30).status_code == 200
    with node.api() as api:
        assert api.get(f"/sandboxes/{neighbour.sandbox_id}", timeout=60).status_code == 200
    assert neighbour.commands.run("echo alive", timeout=120).stdout.strip() == "alive"
    neighbour.files.write("/tmp/probe", "still here")
    assert neighbour.files.read("/tmp/probe") == "still here"


def test_a_memory_hog_and_a_fork_bomb_hurt_only_their_own_sandbox(sdk_env: NodeProcess) -> None:
    runaway = Sandbox.create()
    neighbour = Sandbox.create()
    try:
        # the memory hog: the guest's OOM killer ends it; the guest, its envd and everything else stay
        hog = runaway.commands.run(HOG, timeout=180)  # returns (raises) once the guest killed it
    except Exception as e:  # CommandExitException: killed by SIGKILL
        hog = e
    try:
        assert getattr(hog, "exit_code", None) not in (0, None), hog
        assert runaway.commands.run("echo survived", timeout=60).stdout.strip() == "survived"
        kernel = runaway.commands.run("dmesg | grep -ci 'out of memory' || true", user="root").stdout.strip()
        assert int(kernel or 0) >= 1  # the guest's kernel, not the host's, killed it
        _answers(sdk_env, neighbour)

        # the fork bomb, as the sandbox user, left running in the background
        before = _cpu_s(runaway.sandbox_id)
        runaway.commands.run(BOMB, background=True, timeout=0)
        time.sleep(20)  # let it fill the guest
        busy = _cpu_s(runaway.sandbox_id) - before
        print(f"the runaway VMM used {busy:.1f} CPU seconds in 20 s")
        assert busy > 5  # the bomb really ran (an idle guest uses well under a second)
        _answers(sdk_env, neighbour)
        vmm = runaway.get_info()  # the API still answers about the runaway itself
        assert vmm.sandbox_id == runaway.sandbox_id
    finally:
        with sdk_env.api() as api:
            assert api.delete(f"/sandboxes/{runaway.sandbox_id}", timeout=120).status_code == 204
    # killed for good: its VMM is gone, its row says so, and the neighbour is unaffected
    deadline = time.monotonic() + 30
    while processes_mentioning(runaway.sandbox_id) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert processes_mentioning(runaway.sandbox_id) == []
    assert sdk_env.sql(f"SELECT state FROM sandboxes WHERE id = '{runaway.sandbox_id}'") == [("killed",)]
    _answers(sdk_env, neighbour)
    neighbour.kill()
