"""The snapshot operations' bookkeeping (transitions, claims, truthful states on failure) driven against a
fake launcher and a fake VM.

Why fakes here: a real capture or restore needs a guest (a TCG boot takes ~30 s, a restore ~1 s), and the
paths tested here are the ones a real guest rarely takes (a capture that fails, a restore that fails after
the claim). The same operations with real guests, the real registry and the real VMM are tested end to end
in tests/sandbox (pause/resume, fork, snapshots, restarts). The database, the repository and the garbage
collector are the real ones.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import pytest
import trio
from sqlalchemy import select

from aenv_node.snapshot.errors import ForkLimit, SandboxConflict, StateDiskFull
from aenv_node.snapshot.gc import GarbageCollector
from aenv_node.snapshot.operations import Launch, LiveSandbox, SnapshotOperations
from aenv_node.snapshot.source import SnapshotSource
from aenv_node.snapshot.store import SnapshotStore
from aenv_node.state import (
    Database,
    Event,
    MachineShape,
    Sandbox,
    SandboxState,
    Snapshot,
    SnapshotConfig,
    SnapshotKind,
    SnapshotStatus,
    utcnow,
)
from aenv_node.state import repository as repo
from aenv_node.storage.repository import PosixFsRepository
from aenv_node.vmm import SnapshotFormat, VmState
from aenv_node.vmm.capture_buffer import CaptureBufferPool

SHAPE = MachineShape(vcpus=1, mem_mib=64, kernel="/k", initrd="/i", cmdline="c", tools_img="/t", accel="tcg")
OWNER = "node-a/abcd"


class FakeVm:
    """A VM whose capture fails (the disk under the snapshot directory filled up, say)."""

    #: no process behind it (the crash points read a VM's pid; 0 is never killed)
    pid = 0

    def __init__(self) -> None:
        self.state = VmState.RUNNING
        self.resumed = 0

    async def capture(self, *args: object, **kwargs: object) -> None:
        self.state = VmState.PAUSED
        raise OSError(28, "No space left on device")

    async def resume(self) -> None:
        self.state = VmState.RUNNING
        self.resumed += 1


@dataclass
class FakeHandle:
    sandbox_id: str
    source: SnapshotSource
    vm: FakeVm = field(default_factory=FakeVm)
    address: str = "169.254.0.21"
    access_token: Optional[str] = "tok"
    image: object = None
    slot: object = None
    env_vars: dict[str, str] = field(default_factory=dict)
    op_lock: trio.Lock = field(default_factory=trio.Lock)
    done: trio.Event = field(default_factory=trio.Event)
    paused_snapshot_id: Optional[str] = None
    pausing: bool = False
    stops: list[str] = field(default_factory=list)

    def request_stop(self, reason: str = "kill") -> None:
        self.stops.append(reason)


class FakeLauncher:
    def __init__(self, db: Database, *, fail: bool = False) -> None:
        self.db = db
        self.fail = fail
        self.live: dict[str, FakeHandle] = {}
        self.launched: list[Launch] = []

    def get(self, sandbox_id: str) -> Optional[LiveSandbox]:
        return self.live.get(sandbox_id)  # type: ignore[return-value]  # FakeHandle has LiveSandbox's fields

    async def launch(self, launch: Launch) -> LiveSandbox:
        self.launched.append(launch)
        if self.fail:
            raise OSError("the VMM did not start")
        await self.db.run(lambda s: repo.transition(s, launch.sandbox_id, SandboxState.RUNNING,
                                                    operation=launch.operation))
        handle = self.live[launch.sandbox_id] = FakeHandle(launch.sandbox_id, launch.source)
        return handle  # type: ignore[return-value]


@pytest.fixture
def db(tmp_path: Path) -> Database:
    d = Database(tmp_path / "aenv.db")
    d.upgrade()
    return d


def _ops(db: Database, tmp_path: Path, launcher: FakeLauncher) -> tuple[SnapshotOperations, PosixFsRepository]:
    store = SnapshotStore(db, layers_dir=tmp_path / "layers", snapshots_dir=tmp_path / "snapshots")
    gc = GarbageCollector(db, layers_dir=tmp_path / "layers", snapshots_dir=tmp_path / "snapshots", live=lambda: [])
    repository = PosixFsRepository(tmp_path / "repo")
    ops = SnapshotOperations(db, store=store, gc=gc, repository=repository, buffers=CaptureBufferPool(0, 0),
                             launcher=launcher, node_id="node-a", owner=OWNER, vmm_name="qemu",
                             default_timeout_s=300, fork_max_count=4, compact_after_layers=8)
    return ops, repository


def _sandbox(db: Database, sid: str, state: SandboxState, snapshot: Optional[str] = None) -> None:
    with db.session() as s:
        if snapshot is not None:
            s.add(Snapshot(id=snapshot, kind=SnapshotKind.PAUSE, status=SnapshotStatus.COMMITTED,
                           vmstate_location="/v", vmstate_format="qemu-devices", memory_location="/m",
                           config=SnapshotConfig(shape=SHAPE)))
            s.flush()
        repo.insert_sandbox(s, Sandbox(id=sid, template_id="base", snapshot_id=snapshot, envd_access_token="tok",
                                       network_policy={"allowOut": ["10.0.0.0/8"]}))
    with db.session() as s:
        path = {SandboxState.RUNNING: [SandboxState.RUNNING],
                SandboxState.PAUSED: [SandboxState.RUNNING, SandboxState.PAUSING, SandboxState.PAUSED]}[state]
        for to in path:
            repo.transition(s, sid, to, operation="setup")


def _source(snapshot_id: str = "boot") -> SnapshotSource:
    return SnapshotSource(snapshot_id=snapshot_id, vmstate=Path("/v"), format=SnapshotFormat.QEMU_DEVICES,
                          memory=Path("/m"), memory_layers=[], memory_base="/m", shape=SHAPE, template_id="base")


def _state(db: Database, sid: str) -> SandboxState:
    with db.session() as s:
        return repo.get_sandbox(s, sid, include_killed=True).state


async def test_pause_or_fork_of_a_sandbox_not_running_here_is_a_conflict(db: Database, tmp_path: Path) -> None:
    ops, _ = _ops(db, tmp_path, FakeLauncher(db))
    _sandbox(db, "ipaused", SandboxState.PAUSED, "snp")
    with pytest.raises(SandboxConflict, match="already paused"):
        await ops.pause("ipaused")
    with pytest.raises(SandboxConflict, match="not running: cannot fork"):
        await ops.fork("ipaused", count=1, timeout_s=None)
    with pytest.raises(ForkLimit, match="between 1 and 4"):
        await ops.fork("ipaused", count=5, timeout_s=None)


async def test_a_failed_capture_leaves_the_sandbox_running_with_the_error(db: Database, tmp_path: Path) -> None:
    launcher = FakeLauncher(db)
    ops, _ = _ops(db, tmp_path, launcher)
    _sandbox(db, "irun", SandboxState.RUNNING)
    handle = launcher.live["irun"] = FakeHandle("irun", _source())
    with pytest.raises(StateDiskFull, match="the node's state disk is full: No space left on device"):
        await ops.snapshot("irun", name="mine")
    assert _state(db, "irun") == SandboxState.RUNNING and handle.vm.state is VmState.RUNNING
    with pytest.raises(StateDiskFull, match="the node's state disk is full: No space left on device"):
        await ops.pause("irun")
    assert _state(db, "irun") == SandboxState.RUNNING and handle.stops == []  # not stopped: it runs on
    with db.session() as s:
        assert list(s.scalars(select(Snapshot))) == []  # nothing half committed
        errors = [(e.from_state, e.to_state, e.error) for e in s.scalars(select(Event).where(Event.error.is_not(None)))]
    assert [(f, t) for f, t, _ in errors] == [("snapshotting", "running"), ("pausing", "running")]
    assert all(e.startswith("StateDiskFull: the node's state disk is full: No space left on device")
               for _, _, e in errors), errors
    assert list((tmp_path / "snapshots").iterdir()) == []  # the capture's directories went


async def test_resume_claims_the_sandbox_then_restores_it(db: Database, tmp_path: Path) -> None:
    launcher = FakeLauncher(db)
    ops, repository = _ops(db, tmp_path, launcher)
    _sandbox(db, "ip", SandboxState.PAUSED, "snp_p")
    row, resumed = await ops.resume("ip", timeout_s=60)
    assert resumed and row.state == SandboxState.RUNNING
    (launch,) = launcher.launched
    assert launch.operation == "resume" and launch.source.snapshot_id == "snp_p"
    assert launch.access_token == launch.previous_token == "tok"  # a resume keeps its token
    rec = repository.get_ownership("ip")
    assert rec is not None and rec.owner == OWNER and rec.state == "running"
    assert 50 < (row.end_at - utcnow()).total_seconds() <= 60
    # running here already: no second restore, the timeout moves
    row, resumed = await ops.resume("ip", timeout_s=3600)
    assert not resumed and len(launcher.launched) == 1
    assert (row.end_at - utcnow()) > dt.timedelta(seconds=3500)


async def test_a_failed_restore_hands_the_claim_back(db: Database, tmp_path: Path) -> None:
    ops, repository = _ops(db, tmp_path, FakeLauncher(db, fail=True))
    _sandbox(db, "ip", SandboxState.PAUSED, "snp_p")
    repository.release_sandbox("ip", OWNER, "snp_p")  # published as paused by this node before
    with pytest.raises(OSError, match="did not start"):
        await ops.resume("ip")
    rec = repository.get_ownership("ip")
    assert rec is not None and rec.state == "paused" and rec.snapshot_id == "snp_p"  # as it was: any node may
