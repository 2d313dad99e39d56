"""A template build whose boot never brings envd up: retried once, then failed with the reason, and nothing
left behind (no VMM process, no snapshot row or file, no build upper)."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import pytest

from .conftest import processes_mentioning, start_node, stop_node

pytestmark = pytest.mark.vm


def test_a_hung_template_boot_is_retried_once_then_fails_cleanly() -> None:
    state = Path(tempfile.mkdtemp(prefix="aenv-boot-", dir="/var/tmp"))
    node = start_node(state, wait_template=False, AENV_TEMPLATES_BOOT_TIMEOUT_S="2")
    try:
        deadline = time.monotonic() + 300
        with node.api() as c:
            while True:
                r = c.get("/templates/base")
                if r.status_code == 200 and r.json()["buildStatus"] == "error":
                    break
                assert time.monotonic() < deadline, node.log()[-3000:]
                time.sleep(0.5)
        log = node.log()
        assert "template base: boot 1 hung (envd at" in log and "booting again" in log, log[-3000:]
        [(status, error)] = node.sql("SELECT status, error FROM template_builds WHERE template_id = 'base'")
        assert status == "error" and "not ready after 2s" in error, error
        assert "(booted 2 times); the guest console ends with" in error, error
        [(to_state, ev_error)] = node.sql(
            "SELECT to_state, error FROM events WHERE subject_id = 'base' AND to_state = 'error'")
        assert ev_error == error
        assert node.sql("SELECT count(*) FROM snapshots") == [(0,)]
        assert list((state / "snapshots").iterdir()) == []
        [build_dir] = (state / "builds").iterdir()
        assert not (build_dir / "upper").exists()  # the console log stays for the post-mortem
        assert (build_dir / "console.log").exists()
        assert processes_mentioning(str(build_dir)) == []  # the VMM (its console log is under the build dir)
    finally:
        stop_node(node.proc)
        shutil.rmtree(state, ignore_errors=True)


def test_a_node_told_not_to_build_its_templates_boots_no_vm_and_serves() -> None:
    """``templates.build_default = false``: the node starts and serves its API with no build of ``base`` (a node
    opened on a state for inspection, or the fleet-state bench); a create from the unbuilt template is refused in
    E2B's error shape, not started."""
    state = Path(tempfile.mkdtemp(prefix="aenv-nobuild-", dir="/var/tmp"))
    node = start_node(state, wait_template=False, AENV_TEMPLATES_BUILD_DEFAULT="false")
    try:
        time.sleep(2)  # what a build would have started by now
        assert node.sql("SELECT count(*) FROM template_builds") == [(0,)]
        assert processes_mentioning(str(state)) == []  # no VMM
        with node.api() as c:
            assert c.get("/health").status_code == 200
            r = c.post("/sandboxes", json={"templateID": "base"})
            assert 400 <= r.status_code < 500 and set(r.json()) >= {"code", "message"}, r.text
        assert node.sql("SELECT count(*) FROM sandboxes WHERE state = 'running'") == [(0,)]
    finally:
        stop_node(node.proc)
        shutil.rmtree(state, ignore_errors=True)
