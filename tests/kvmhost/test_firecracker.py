"""The production path: Firecracker running Linux guests on a KVM host (a TCG VM with nested SVM, here), driven
by the unmodified E2B SDK from this machine. One VM for the whole module (it takes minutes to come up)."""

from __future__ import annotations

import time

import pytest
from e2b import Sandbox

from . import flows, vm

pytestmark = [pytest.mark.vm, pytest.mark.slow]
KVMHOST_VMM = "auto"  # auto must pick Firecracker on a KVM host


def test_auto_picks_firecracker_with_kvm_and_ublk_disks(host: vm.KvmHost) -> None:
    log = host.node_log()
    assert "VMM firecracker with kvm" in log, log[-3000:]
    assert "sandbox disks through ublk" in log, log[-3000:]


def test_quickstart(host: vm.KvmHost) -> None:
    flows.quickstart()


def test_pause_resume_with_a_running_process(host: vm.KvmHost) -> None:
    flows.pause_resume_with_running_process()


def test_snapshot_then_create(host: vm.KvmHost) -> None:
    flows.snapshot_then_create()


def test_fork_children_diverge(host: vm.KvmHost) -> None:
    flows.fork_diverges()


def test_ttl_pause_then_auto_resume(host: vm.KvmHost) -> None:
    flows.ttl_pauses_and_traffic_resumes()


def test_template_build_from_base(host: vm.KvmHost) -> None:
    flows.template_build_from_base()


def test_a_dead_ublk_disk_takes_down_only_its_sandbox(host: vm.KvmHost) -> None:
    """Sandbox A's ublk device is stopped from outside the node: A ends in error with the reason recorded and
    logged, its Firecracker is gone; sandbox B, served by the same node, goes on working."""
    a, b = Sandbox.create(), Sandbox.create()
    try:
        (pid_a,) = [r["vmm_pid"] for r in host.sql(f"SELECT vmm_pid FROM sandboxes WHERE id = '{a.sandbox_id}'")]
        out = host.sh(f"/opt/aenv-node/venv/bin/python /opt/aenv-node/src/ublk_stop.py {a.sandbox_id} 2>&1")
        assert "STOPPED" in out, out
        deadline = time.monotonic() + 60
        while (row := host.sql(f"SELECT state, error FROM sandboxes WHERE id = '{a.sandbox_id}'")[0])["state"] \
                != "error":
            assert time.monotonic() < deadline, f"sandbox A did not end: {row}\n{host.dataplane_log()}"
            time.sleep(1)
        assert "UblkError" in row["error"] and "ended under its server" in row["error"], row
        assert f"sandbox {a.sandbox_id} failed: UblkError" in host.node_log()
        assert host.sh(f"test -e /proc/{pid_a} && echo ALIVE || echo GONE").strip().endswith("GONE")
        # B is untouched
        assert b.commands.run("echo alive").stdout == "alive\n"
        b.files.write("/home/user/after.txt", "still writing")
        assert b.files.read("/home/user/after.txt") == "still writing"
        assert host.sql(f"SELECT state FROM sandboxes WHERE id = '{b.sandbox_id}'") == [{"state": "running"}]
    finally:
        b.kill()
        Sandbox.kill(a.sandbox_id)


def test_a_restarted_node_takes_over_its_running_firecracker_sandbox(host: vm.KvmHost) -> None:
    """The node killed (SIGKILL), then stopped (SIGTERM): each next start takes the running sandbox over, on the
    same Firecracker, its background process and files there. Its first capture after that is a full one
    (the dead node may have had a snapshot taken that reset KVM's dirty log): a pause and a resume keep both."""
    sb = Sandbox.create(timeout=900)
    sid = sb.sandbox_id
    try:
        sb.files.write("/home/user/kept.txt", "kept")
        sleeper = sb.commands.run("sleep 100000", background=True, timeout=0).pid
        (vmm,) = [r["vmm_pid"] for r in host.sql(f"SELECT vmm_pid FROM sandboxes WHERE id = '{sid}'")]
        for sig in ("KILL", "TERM"):
            host.restart_node(sig)
            assert host.sql(f"SELECT state, vmm_pid FROM sandboxes WHERE id = '{sid}'") == [
                {"state": "running", "vmm_pid": vmm}], host.node_log()[-3000:]
        assert host.sql(f"SELECT count(*) AS n FROM events WHERE sandbox_id = '{sid}' AND operation = 'adopt'") \
            == [{"n": 2}]
        back = Sandbox.connect(sid, timeout=900)
        assert back.commands.run(f"kill -0 {sleeper} && echo alive").stdout == "alive\n"
        back.pause()
        (snap,) = host.sql(f"SELECT s.dirty_bytes, s.memory_mb FROM sandboxes b JOIN snapshots s "
                           f"ON s.id = b.snapshot_id WHERE b.id = '{sid}'")
        assert snap["dirty_bytes"] == snap["memory_mb"] << 20, snap  # the full capture
        back = Sandbox.connect(sid, timeout=900)
        assert back.commands.run(f"kill -0 {sleeper} && echo alive").stdout == "alive\n"
        assert back.files.read("/home/user/kept.txt") == "kept"
    finally:
        Sandbox.kill(sid)
