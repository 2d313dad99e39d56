"""The start-up reconciler against a database a crashed node left (real SQLite, a real repository, real
processes; no guest: the rows and files are what a previous run leaves, made here in milliseconds)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from sqlalchemy import select

from aenv_node.config import Config
from aenv_node.runtime import Node
from aenv_node.runtime.assemble import install_sandbox_services
from aenv_node.runtime.reconcile import Reconciler
from aenv_node.snapshot.operations import SnapshotOperations
from aenv_node.state import (
    Database,
    Event,
    MachineShape,
    NetworkSlot,
    Sandbox,
    SandboxState,
    Snapshot,
    SnapshotConfig,
    SnapshotKind,
    SnapshotStatus,
)
from aenv_node.state import repository as repo

S = SandboxState
SHAPE = MachineShape(vcpus=1, mem_mib=64, kernel="/k", initrd="/i", cmdline="c", tools_img="/t", accel="tcg")


def _sandbox(db: Database, sid: str, path: list[SandboxState], *, pid: int | None = None) -> None:
    with db.session() as s:
        repo.insert_sandbox(s, Sandbox(id=sid, template_id="base", vmm_pid=pid))
    with db.session() as s:
        for to in path:
            repo.transition(s, sid, to, operation="setup")


async def test_a_crashed_runs_sandboxes_are_settled_and_its_leftovers_reaped(node_config: Config) -> None:
    db = Database(node_config.database_path)
    db.upgrade()
    node = Node(node_config, db, "key")
    install_sandbox_services(node, build_default_template=False)
    (reconciler,) = node.reconcilers
    assert isinstance(reconciler, Reconciler)
    # a leftover "VMM" of irun2: its command line names the sandbox, as the node's VMMs do
    leftover = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", "aenv-irun2"])
    try:
        _sandbox(db, "iperiodic", [S.RUNNING])
        _sandbox(db, "icapturing", [S.RUNNING, S.SNAPSHOTTING])  # killed during its next periodic capture
        _sandbox(db, "irun2", [S.RUNNING], pid=leftover.pid)
        _sandbox(db, "inotours", [S.RUNNING], pid=os.getpid())  # a pid now used by something else
        _sandbox(db, "iresuming", [S.RUNNING, S.PAUSING, S.PAUSED, S.RESUMING])
        _sandbox(db, "ikilling", [S.RUNNING, S.KILLING])
        _sandbox(db, "ipaused", [S.RUNNING, S.PAUSING, S.PAUSED])
        with db.session() as s:
            for sid in ("iperiodic", "icapturing"):
                s.add(Snapshot(id=f"snp_{sid}", kind=SnapshotKind.PERIODIC, status=SnapshotStatus.COMMITTED,
                               source_sandbox_id=sid, vmstate_location="/v", memory_location="/m",
                               config=SnapshotConfig(shape=SHAPE)))
            s.add(NetworkSlot(slot_index=3, netns="aenv-x-3", host_ip="10.0.0.1", slot_ip="10.0.0.2",
                              sandbox_id="irun2"))
        for sid in ("irun2", "iperiodic"):
            (node_config.run_dir / sid).mkdir(parents=True, exist_ok=True)
            (node_config.sandboxes_dir / sid / "upper").mkdir(parents=True, exist_ok=True)

        await reconciler(node)

        assert leftover.wait(timeout=10) == -signal.SIGKILL  # ours: reaped by its recorded pid
        with db.session() as s:
            state = {sb.id: (sb.state, sb.snapshot_id, sb.vmm_pid) for sb in s.scalars(select(Sandbox))}
            slots = list(s.scalars(select(NetworkSlot)))
            reasons = {e.sandbox_id: (e.detail or {}).get("reason") for e in s.scalars(
                select(Event).where(Event.operation == "reconcile", Event.to_state.in_(["paused", "killed"])))}
        assert state == {
            "iperiodic": (S.PAUSED, "snp_iperiodic", None),  # its latest periodic snapshot: paused there
            "icapturing": (S.PAUSED, "snp_icapturing", None),  # the same, after the interrupted capture
            "irun2": (S.KILLED, None, None),
            "inotours": (S.KILLED, None, None),
            "iresuming": (S.PAUSED, None, None),  # its pause snapshot is intact
            "ikilling": (S.KILLED, None, None),
            "ipaused": (S.PAUSED, None, None),  # untouched
        }
        assert reasons["iperiodic"].startswith("the node restarted: paused at its latest periodic snapshot")
        assert reasons["irun2"] == "the node restarted; its VMM did not survive"
        assert slots == []
        for sid in ("irun2", "iperiodic"):
            assert not (node_config.run_dir / sid).exists() and not (node_config.sandboxes_dir / sid).exists()
        # the sandbox paused at its periodic snapshot is queued to be published as paused
        (ops,) = [svc for svc in node.services if isinstance(svc, SnapshotOperations)]
        queued = {ops._after_pause_recv.receive_nowait() for _ in range(2)}
        assert queued == {("snp_iperiodic", "iperiodic"), ("snp_icapturing", "icapturing")}
    finally:
        if leftover.poll() is None:
            leftover.kill()
            leftover.wait()
        db.close()
