"""A fork that cannot place every child reports per-child errors and leaks nothing."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from e2b import Sandbox

from ..conftest import free_pool_cidr
from .conftest import start_node, stop_node

pytestmark = pytest.mark.vm


def test_fork_partial_failure_reports_per_child_errors_and_leaks_nothing(monkeypatch) -> None:
    # a /28 holds 4 slots: the parent takes one, so at most 3 of 4 children can get a network
    pool = free_pool_cidr().replace(".0/24", ".0/28")
    state = Path(tempfile.mkdtemp(prefix="aenv-capacity-", dir="/var/tmp"))
    node = start_node(state, pool=pool, AENV_NET_WARM_SLOTS="0")  # no warm slot holds a place
    try:
        for k, v in node.sdk_env().items():
            monkeypatch.setenv(k, v)
        parent = Sandbox.create()
        parent.files.write("/home/user/p.txt", "parent")
        results = parent.fork(count=4)
        ok = [r for r in results if isinstance(r, Sandbox)]
        failed = [r for r in results if not isinstance(r, Sandbox)]
        assert len(results) == 4 and len(ok) == 3 and len(failed) == 1, results
        assert "slot" in str(failed[0]).lower() and "503" in str(failed[0])
        for child in ok:
            assert child.files.read("/home/user/p.txt") == "parent"
        # the failed child holds nothing: no VMM, no slot; its row says why
        rows = node.sql("SELECT id, state, vmm_pid, slot_index, error FROM sandboxes "
                        f"WHERE parent_sandbox_id = '{parent.sandbox_id}' AND state != 'running'")
        assert len(rows) == 1 and rows[0][1:4] == ("error", None, None) and "slot" in rows[0][4].lower()
        ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
        assert rows[0][0] not in ps
        assert not (state / "sandboxes" / rows[0][0] / "upper").exists()
        assert parent.commands.run("echo parent still runs").stdout == "parent still runs\n"
        for child in ok:
            child.kill()
        parent.kill()
        assert node.sql("SELECT count(*) FROM network_slots WHERE sandbox_id IS NOT NULL") == [(0,)]
    finally:
        stop_node(node.proc)
        shutil.rmtree(state, ignore_errors=True)
