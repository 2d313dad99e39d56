"""The crash-point matrix: the node is killed (SIGKILL of itself, ``aenv_node/faults.py``) at every named
step of create, resume, pause, snapshot, fork, publish, compaction, GC and template build, then restarted on
the same state directory, and the invariants are checked:

* every sandbox is running, paused or killed, as its last committed event says; a paused one resumes with
  the file it wrote before the crash;
* nothing is left: no VMM process, mount, loop device, socket or upper of a sandbox that is not running, no
  more network namespaces than the warm pool and the running sandboxes hold, no temporary file;
* no snapshot is half visible: every snapshot directory and layer file has its row, every committed
  snapshot's layers exist, a user snapshot is a template; the repository has no manifest naming a missing
  layer, no temporary object, and every layer's content matches its digest.

One state directory serves the whole matrix (the base template is built once), as a real node lives through
one crash after another.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, TypeVar

import httpx
import pytest
from e2b import Sandbox, Template

from aenv_node.cli._common import build_config
from aenv_node.faults import POINTS, VMM_POINTS
from aenv_node.runtime.parts import node_tag
from aenv_node.storage.repository.chunksums import ChunkSums

from ..conftest import free_pool_cidr, free_port
from .conftest import NodeProcess, processes_mentioning, start_node, stop_node

pytestmark = pytest.mark.vm

MARK = "/home/user/crash-mark.txt"


@dataclass
class Rig:
    state: Path
    port: int
    pool: str
    node: Optional[NodeProcess] = None
    seen: set[str] = field(default_factory=set)  # sandbox ids checked so far
    verified: set[str] = field(default_factory=set)  # repository layers whose content matched their digest

    #: the matrix here is of a node without a data plane (its sandboxes die with it); test_data_plane.py runs
    #: the cells a data plane changes
    data_plane = "false"

    def start(self, args: tuple[str, ...] = (), **env: str) -> NodeProcess:
        assert self.node is None or self.node.proc.poll() is not None
        self.node = start_node(self.state, port=self.port, pool=self.pool, args=args, AENV_NET_WARM_SLOTS="1",
                               AENV_NODE_DATA_PLANE=self.data_plane,
                               AENV_SNAPSHOT_GC_ORPHAN_GRACE_S="0",
                               # the repository's collector (which also sweeps uploads a crash cut) runs
                               # often, with a grace every local publish finishes well within
                               AENV_STORAGE_REPOSITORY_GC_INTERVAL_S="2", AENV_STORAGE_REPOSITORY_GC_GRACE_S="20",
                               **env)
        for k, v in self.node.sdk_env().items():
            os.environ[k] = v
        return self.node

    def api(self) -> httpx.Client:
        assert self.node is not None
        return self.node.api()

    def sql(self, query: str) -> list[tuple[Any, ...]]:
        assert self.node is not None
        return self.node.sql(query)

    @property
    def cfg_tag(self) -> str:
        return node_tag(build_config(None, self.state))

    @property
    def run_dir(self) -> Path:
        return build_config(None, self.state).run_dir


R = TypeVar("R", bound=Rig)


@contextlib.contextmanager
def open_rig(cls: type[R], prefix: str) -> Iterator[R]:
    """A rig on a fresh state directory under /var/tmp; at the end its node (and data plane) stopped, its last
    log kept as /var/tmp/<prefix>last-node.log, the directory removed and the SDK's environment restored."""
    state = Path("/var/tmp") / f"{prefix}{os.getpid()}-{random.randrange(10**6)}"
    r = cls(state, free_port(), free_pool_cidr())
    saved = {k: os.environ.get(k) for k in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY")}
    try:
        yield r
    finally:
        if r.node is not None:
            stop_node(r.node.proc)
            shutil.copy(r.node.log_path, f"/var/tmp/{prefix}last-node.log")
        shutil.rmtree(state, ignore_errors=True)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def rig() -> Iterator[Rig]:
    with open_rig(Rig, "aenv-crash-") as r:
        yield r


# ---- what a cell does before and at its crash ------------------------------------------------------


def _create(rig: Rig) -> str:
    sb = Sandbox.create(timeout=600)
    sb.files.write(MARK, f"written by {sb.sandbox_id}")
    return sb.sandbox_id


def _created_paused(rig: Rig) -> str:
    sid = _create(rig)
    with rig.api() as c:
        assert c.post(f"/sandboxes/{sid}/pause").status_code == 204
    return sid


def _post(path: str, body: Optional[dict[str, Any]] = None) -> Callable[[Rig, Optional[str]], None]:
    def op(rig: Rig, sid: Optional[str]) -> None:
        with rig.api() as c:
            try:
                c.post(path.format(sid=sid), json=body)
            except httpx.HTTPError:
                pass  # the node died under the request: that is the point

    return op


def _kill_op(rig: Rig, sid: Optional[str]) -> None:
    with rig.api() as c:
        c.delete(f"/sandboxes/{sid}")


def _build_op(rig: Rig, sid: Optional[str]) -> None:
    t = Template().from_template("base").run_cmd("echo crash-build > /home/user/built.txt")
    try:
        Template.build(t, f"crash-{random.randrange(10**6)}")
    except Exception:
        pass


@dataclass(frozen=True)
class Cell:
    point: str  # AENV_CRASH_AT (name@hit)
    setup: Optional[Callable[[Rig], str]]  # returns the sandbox the operation acts on
    op: Callable[[Rig, Optional[str]], None]
    #: the state the cell's sandbox must be in after the restart (None: no sandbox of the cell's own)
    expect: Optional[str]
    env: tuple[tuple[str, str], ...] = ()


CELLS = [
    Cell("create.inserted", None, _post("/sandboxes", {"templateID": "base", "timeout": 600}), "killed"),
    Cell("launch.vmm_started", None, _post("/sandboxes", {"templateID": "base", "timeout": 600}), "killed"),
    Cell("launch.envd_ready", None, _post("/sandboxes", {"templateID": "base", "timeout": 600}), "killed"),
    # the create of the setup reaches the launch points once; the resume is the second time
    Cell("launch.vmm_started@2", _created_paused, _post("/sandboxes/{sid}/connect", {"timeout": 600}), "paused"),
    Cell("launch.envd_ready@2", _created_paused, _post("/sandboxes/{sid}/connect", {"timeout": 600}), "paused"),
    Cell("pause.quiesced", _create, _post("/sandboxes/{sid}/pause"), "killed"),
    Cell("capture.captured", _create, _post("/sandboxes/{sid}/pause"), "killed"),
    Cell("capture.frozen", _create, _post("/sandboxes/{sid}/pause"), "killed"),
    Cell("capture.sealed", _create, _post("/sandboxes/{sid}/pause"), "killed"),
    Cell("pause.committed", _create, _post("/sandboxes/{sid}/pause"), "paused"),
    # (without a data plane a pause answers once it is paused: test_data_plane.py has it answering earlier)
    Cell("pause.answered", _create, _post("/sandboxes/{sid}/pause"), "paused"),
    # after the pause answered: its publish, in the background
    Cell("publish.layers_uploaded", _create, _post("/sandboxes/{sid}/pause"), "paused"),
    Cell("publish.manifest_written", _create, _post("/sandboxes/{sid}/pause"), "paused"),
    Cell("compaction.written", _create, _post("/sandboxes/{sid}/pause"), "paused",
         env=(("AENV_SNAPSHOT_COMPACT_AFTER_LAYERS", "2"),)),
    Cell("capture.sealed", _create, _post("/sandboxes/{sid}/snapshots", {}), "killed"),
    Cell("snapshot.committed", _create, _post("/sandboxes/{sid}/snapshots", {}), "killed"),
    Cell("snapshot.committed", _create, _post("/sandboxes/{sid}/fork", {"count": 2}), "killed"),
    Cell("fork.child_inserted", _create, _post("/sandboxes/{sid}/fork", {"count": 2}), "killed"),
    Cell("launch.vmm_started@2", _create, _post("/sandboxes/{sid}/fork", {"count": 2}), "killed"),
    Cell("gc.marked", _created_paused, _kill_op, "killed"),
    Cell("build.booted", None, _build_op, None),
    Cell("build.sealed", None, _build_op, None),
]


def test_every_crash_point_has_a_cell() -> None:
    covered = {c.point.partition("@")[0] for c in CELLS}
    assert covered == set(POINTS), set(POINTS) ^ covered


# ---- the invariants ------------------------------------------------------------------------------


def _last_sandbox_event(rig: Rig, sid: str) -> Optional[str]:
    rows = rig.sql(f"SELECT to_state FROM events WHERE sandbox_id = '{sid}' AND subject = 'sandbox' "
                   "AND to_state IS NOT NULL ORDER BY id DESC LIMIT 1")
    return rows[0][0] if rows else None


def _wait(predicate: Callable[[], bool], what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.3)


def _eventually(check: Callable[[], None], timeout: float = 30) -> None:
    """``check`` passes within ``timeout`` (a sandbox whose VMM died is torn down a moment later)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            check()
            return
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def check_invariants(rig: Rig, allowed: tuple[str, ...] = ("running", "paused", "killed")) -> None:
    state = rig.state
    rows = rig.sql("SELECT id, state, vmm_pid FROM sandboxes")
    running = {sid: pid for sid, st, pid in rows if st == "running"}
    for sid, st, _ in rows:
        assert st in allowed, (sid, st)
        assert _last_sandbox_event(rig, sid) == st, (sid, st, _last_sandbox_event(rig, sid))
    for sid, pid in running.items():  # never a dead VM reported running
        assert pid and sid.encode() in Path(f"/proc/{pid}/cmdline").read_bytes(), (sid, pid)
    # processes: only running sandboxes' VMMs name this state directory
    vmms = set(processes_mentioning(str(state)))
    assert vmms <= set(running.values()), (vmms, running)
    # mounts, loop devices, sockets, uppers
    mounts = Path("/proc/self/mounts").read_text()
    assert str(state) not in mounts and str(rig.run_dir) not in mounts
    loops = subprocess.run(["losetup", "-a"], capture_output=True, text=True).stdout
    assert str(state) not in loops, loops
    if rig.run_dir.exists():  # (the data plane's socket and pid file, when one runs)
        left = {p.name for p in rig.run_dir.iterdir() if not p.name.startswith("dataplane.")} - set(running)
        assert not left, left
    if (state / "sandboxes").exists():
        for d in (state / "sandboxes").iterdir():
            if d.name not in running:
                assert not (d / "upper").exists(), d
    # network namespaces: the running sandboxes' slots and the idle ones (net.warm_slots = 1 here: the pool keeps
    # up to twice that, slots given back kept for the next sandbox)
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    ours = [n for n in names if n.startswith(f"aenv-{rig.cfg_tag}-")]
    assert len(ours) <= 2 + len(running), ours
    # cgroups (vmm.cgroups): of the sandboxes, only the running ones' VMMs have one
    memcg = Path("/sys/fs/cgroup/memory") / f"aenv-{rig.cfg_tag}"
    if memcg.is_dir():
        groups = {d.name for d in memcg.iterdir() if d.is_dir()} & {f"aenv-{sid}" for sid, _, _ in rows}
        assert groups <= {f"aenv-{sid}" for sid in running}, (groups, running)
    # no temporary file anywhere under the state directory: the start-up sweep removed the crash's, the
    # repository's collector the uploads it cut (once older than its grace), and those of the restarted
    # node's own background work (a publish, a compaction) go when it is done
    def temporaries() -> list[Path]:
        return [p for p in state.rglob("*") if p.name.endswith((".tmp", ".part")) or p.name.startswith(".tmp-")]

    _wait(lambda: not temporaries(), "temporary files are left", timeout=90)
    # every snapshot directory and layer file is a row's; every committed snapshot's layers exist
    snaps = dict(rig.sql("SELECT id, status FROM snapshots"))
    for d in (state / "snapshots").iterdir():
        assert snaps.get(d.name) not in (None, "collected"), (d, snaps.get(d.name))
    layer_paths = {p for (p,) in rig.sql("SELECT local_path FROM layers WHERE local_path IS NOT NULL")}
    for f in (state / "layers").iterdir():
        if f.is_file():
            assert str(f) in layer_paths, f
    for sid_, path, key in rig.sql(
            "SELECT sl.snapshot_id, l.local_path, l.repository_key FROM snapshot_layers sl "
            "JOIN layers l ON l.digest = sl.layer_digest JOIN snapshots s ON s.id = sl.snapshot_id "
            "WHERE s.status = 'committed'"):
        assert (path and Path(path).is_file()) or key, (sid_, path, key)
    for (sid_,) in rig.sql("SELECT id FROM snapshots WHERE kind = 'user' AND status = 'committed'"):
        assert rig.sql(f"SELECT count(*) FROM templates WHERE boot_snapshot_id = '{sid_}'") == [(1,)], sid_
    check_repository(state / "repository")


def check_repository(root: Path) -> None:
    """No manifest names a missing layer; no temporary object."""
    if not root.exists():
        return
    present = {p.name for p in (root / "layers" / "sha256").glob("*/*")}
    for m in (root / "manifests").iterdir():
        assert not m.name.startswith("."), m  # a temporary left by a cut commit
        doc = json.loads(m.read_text())
        named = [d["digest"] for d in doc.get("disk_layers", [])] + list(doc.get("memory_layers", []))
        for digest in named:
            assert digest.removeprefix("sha256:") in present, (m.name, digest)


def check_repository_digests(root: Path, verified: set[str]) -> None:
    """Every layer in the repository not verified before: its content is its name (no torn object). Beside
    each layer is its per-chunk checksum record (``<hex>.chunks``, P2P's): it parses, and sums that layer."""
    for p in (root / "layers" / "sha256").glob("*/*"):
        if p.name in verified or p.name.startswith("."):  # a temporary: the invariants above wait those out
            continue
        if p.name.endswith(".chunks"):
            try:
                record = ChunkSums.decode(p.read_bytes())
            except FileNotFoundError:
                continue
            assert record.digest == "sha256:" + p.name.removesuffix(".chunks"), p
            verified.add(p.name)
            continue
        h = hashlib.sha256()
        try:
            with open(p, "rb") as f:  # a layer is written under a temporary name and renamed whole
                while chunk := f.read(1 << 20):
                    h.update(chunk)
        except FileNotFoundError:
            continue  # collected meanwhile (the repository's collector runs every 2 s here)
        assert h.hexdigest() == p.name, p
        verified.add(p.name)


def _settled(rig: Rig, before: set[str], sid: Optional[str]) -> tuple[set[str], Optional[str]]:
    """Once no sandbox is in a transient state: the sandboxes made since ``before``, and the cell's own (its
    set-up's, else the first made)."""
    _wait(lambda: not rig.sql("SELECT id FROM sandboxes WHERE state IN "
                              "('creating','pausing','resuming','snapshotting','forking','killing')"),
          "a sandbox is still in a transient state")
    new = {sid_ for (sid_,) in rig.sql("SELECT id FROM sandboxes")} - before
    return new, sid or (sorted(new)[0] if new else None)


# ---- the matrix ----------------------------------------------------------------------------------


def crash_at(rig: Rig, cell: Cell, after_setup: Optional[Callable[[str], None]] = None) -> tuple[set[str], Optional[str]]:
    """Start the node armed at the cell's point, set up its sandbox (then ``after_setup(sid)``), run its
    operation until the node kills itself there; the sandboxes before, and the cell's own."""
    if rig.node is not None:
        stop_node(rig.node.proc)
    node = rig.start(AENV_CRASH_AT=cell.point, **dict(cell.env))
    before = {sid for (sid,) in rig.sql("SELECT id FROM sandboxes")}
    sid = cell.setup(rig) if cell.setup is not None else None
    if sid is not None and after_setup is not None:
        after_setup(sid)
    assert node.proc.poll() is None, f"the node died during the cell's set-up:\n{node.log()[-3000:]}"
    worker = threading.Thread(target=cell.op, args=(rig, sid), daemon=True)
    worker.start()
    try:
        node.proc.wait(timeout=180)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"crash point {cell.point} was not reached:\n{node.log()[-3000:]}") from None
    worker.join(timeout=120)
    assert node.proc.returncode == -9, node.proc.returncode
    assert f"crash point {cell.point.partition('@')[0]}" in node.log()
    return before, sid


@pytest.mark.parametrize("cell", CELLS, ids=[f"{c.point}-{c.op.__name__ if c.op.__name__ != 'op' else ''}{i}"
                                             for i, c in enumerate(CELLS)])
def test_crash_point(rig: Rig, cell: Cell) -> None:
    before, sid = crash_at(rig, cell)
    rig.start()
    new, mine = _settled(rig, before, sid)
    if cell.expect is not None:
        assert mine is not None, "the cell's sandbox has no row"
        assert rig.sql(f"SELECT state FROM sandboxes WHERE id = '{mine}'") == [(cell.expect,)]
    for child in new - {mine}:  # fork children: killed with their parent's node, none left creating
        assert rig.sql(f"SELECT state FROM sandboxes WHERE id = '{child}'") == [("killed",)]
    if cell.point.startswith("build."):
        assert rig.sql("SELECT count(*) FROM template_builds WHERE status IN ('waiting', 'building')") == [(0,)]
        last = rig.sql("SELECT status, error FROM template_builds ORDER BY started_at DESC LIMIT 1")[0]
        assert last[0] == "error" and "interrupted" in last[1], last
    # the restarted node's own background work (a publish, a compaction) writes a layer file a moment
    # before its row: a leak is what stays
    _eventually(lambda: check_invariants(rig))
    check_repository_digests(rig.state / "repository", rig.verified)
    if cell.expect == "paused":
        assert mine is not None
        if cell.point.startswith("publish."):  # published again by the restart: the record says paused
            snap = rig.sql(f"SELECT snapshot_id FROM sandboxes WHERE id = '{mine}'")[0][0]
            record = rig.state / "repository" / "manifests" / f"sandbox-{mine}.json"
            _wait(lambda: record.exists() and json.loads(record.read_text()).get("snapshot_id") == snap,
                  f"the repository's record of {mine} does not name {snap}")
            check_repository(rig.state / "repository")
        back = Sandbox.connect(mine, timeout=60)
        assert back.files.read(MARK) == f"written by {mine}"
        assert back.commands.run("echo alive").stdout == "alive\n"
        back.kill()
    rig.seen |= new


def test_repository_objects_match_their_digests(rig: Rig) -> None:
    """No torn layer in the repository after any cell (each cell verified the layers new since the last; the
    repository's collector may have removed some since): the matrix verified some."""
    if rig.node is None:
        pytest.skip("the matrix did not run")
    check_repository_digests(rig.state / "repository", rig.verified)
    assert rig.verified


# ---- the VMM killed at each point, the node alive ---------------------------------------------------

VMM_CELLS = [
    # a create whose VMM dies fails with a clear error; a resume's leaves the sandbox paused
    Cell("launch.vmm_started", None, _post("/sandboxes", {"templateID": "base", "timeout": 600}), "error"),
    Cell("launch.vmm_started@2", _created_paused, _post("/sandboxes/{sid}/connect", {"timeout": 600}), "paused"),
    # envd answered: the create (or resume) is done, and the VMM's death right after it ends the sandbox
    Cell("launch.envd_ready", None, _post("/sandboxes", {"templateID": "base", "timeout": 600}), "error"),
    Cell("launch.envd_ready@2", _created_paused, _post("/sandboxes/{sid}/connect", {"timeout": 600}), "error"),
    Cell("pause.quiesced", _create, _post("/sandboxes/{sid}/pause"), "error"),
    # the pause's capture was whole before the VMM died: the sandbox is paused in it
    Cell("capture.captured", _create, _post("/sandboxes/{sid}/pause"), "paused"),
    Cell("capture.sealed", _create, _post("/sandboxes/{sid}/pause"), "paused"),
    Cell("pause.committed", _create, _post("/sandboxes/{sid}/pause"), "paused"),
    Cell("capture.captured", _create, _post("/sandboxes/{sid}/snapshots", {}), "error"),
    Cell("snapshot.committed", _create, _post("/sandboxes/{sid}/snapshots", {}), "error"),
    Cell("snapshot.committed", _create, _post("/sandboxes/{sid}/fork", {"count": 2}), "error"),
    Cell("build.booted", None, _build_op, None),
]


def test_every_vmm_point_has_a_cell() -> None:
    assert {c.point.partition("@")[0] for c in VMM_CELLS} == set(VMM_POINTS)


@pytest.mark.parametrize("cell", VMM_CELLS, ids=[f"{c.point}-{i}" for i, c in enumerate(VMM_CELLS)])
def test_vmm_killed_at(rig: Rig, cell: Cell) -> None:
    """SIGKILL of the operation's VMM at the point: the node lives on, the operation ends with an error or
    completes, and the sandbox's state says what happened to it, with nothing left behind."""
    if rig.node is not None:
        stop_node(rig.node.proc)
    node = rig.start(AENV_CRASH_VMM_AT=cell.point, **dict(cell.env))
    before = {sid for (sid,) in rig.sql("SELECT id FROM sandboxes")}
    sid = cell.setup(rig) if cell.setup is not None else None
    cell.op(rig, sid)
    _wait(lambda: f"crash point {cell.point.partition('@')[0]}" in node.log(), "the point was not reached")
    assert node.proc.poll() is None, f"the node died:\n{node.log()[-3000:]}"
    new, mine = _settled(rig, before, sid)
    if cell.expect is not None:
        assert mine is not None, "the cell's sandbox has no row"
        # the VMM's death is noticed by its watcher, which ends the run (a moment after the answer)
        _wait(lambda: rig.sql(f"SELECT state FROM sandboxes WHERE id = '{mine}'") == [(cell.expect,)],
              f"{mine} is not {cell.expect}: {rig.sql(f'SELECT state FROM sandboxes WHERE id = {mine!r}')}", 30)
        if cell.expect == "error":  # with the reason in its event
            err = rig.sql(f"SELECT error FROM events WHERE sandbox_id = '{mine}' AND to_state = 'error'")
            assert err and "vmm" in (err[-1][0] or "").lower(), err
    else:
        _wait(lambda: rig.sql("SELECT count(*) FROM template_builds WHERE status IN ('waiting', 'building')")
              == [(0,)], "the build did not end", 120)
        last = rig.sql("SELECT status, error FROM template_builds ORDER BY started_at DESC LIMIT 1")[0]
        assert last[0] == "error" and last[1], last
    _eventually(lambda: check_invariants(rig, allowed=("running", "paused", "killed", "error")))
    if mine is not None and cell.expect is not None:  # where it settled, not a state it passed through
        assert rig.sql(f"SELECT state FROM sandboxes WHERE id = '{mine}'") == [(cell.expect,)]
    if cell.expect == "paused":
        assert mine is not None
        back = Sandbox.connect(mine, timeout=60)
        assert back.files.read(MARK) == f"written by {mine}"
        assert back.commands.run("echo alive").stdout == "alive\n"
        back.kill()
    rig.seen |= new
