"""Running sandboxes outlive the control plane (``node.data_plane``): their disks are served by the data-plane
process, which is also the parent of their VMMs, so a node killed with SIGKILL (or stopped, or upgraded)
comes back with every running sandbox still running, its processes and files intact.

* The control plane killed under load (commands, snapshots and creates in flight): after the restart every
  sandbox that ran still runs on the same VMM and answers, its background process alive and its files there;
  only creates cut before they ran are killed. A graceful stop leaves them running too, and a taken-over
  sandbox pauses, resumes, snapshots and is killed as any other.
* The control plane killed inside a capture (each point of pause, snapshot and fork): the sandbox runs on
  (its vCPUs resumed, its filesystem thawed, an upper the capture froze sealed into a layer of the node's)
  with every write before and after the crash. A pause (which answers once the guest is captured, before
  the persist) is then done again before the node serves; one that had committed leaves it paused there.
* The data plane killed: the node stops by itself, and its next start settles the sandboxes as after a
  crash of the whole node (paused at the last periodic snapshot, else killed), with no VMM left over.

The invariants after each restart are the crash matrix's (``test_crash_points.check_invariants``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Iterator, Optional

import httpx
import pytest
from e2b import Sandbox

from aenv_node.config import load_config
from aenv_node.runtime.parts import node_tag
from aenv_node.vmm.process import read_pid_file

from .conftest import stop_node
from .test_crash_points import (
    MARK,
    Cell,
    Rig,
    _create,
    _eventually,
    _post,
    _settled,
    _wait,
    check_invariants,
    crash_at,
    open_rig,
)

pytestmark = pytest.mark.vm


class DataPlaneRig(Rig):
    data_plane = "true"

    def dataplane_pid(self) -> Optional[int]:
        return read_pid_file(self.run_dir / "dataplane.pid")

    def dataplane(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "aenv_node.cli.node", "dataplane", *args],
                              env={**os.environ, "AENV_STATE_DIR": str(self.state)}, capture_output=True, text=True,
                              timeout=120)


@pytest.fixture(scope="module")
def dp() -> Iterator[DataPlaneRig]:
    with open_rig(DataPlaneRig, "aenv-dataplane-") as r:
        yield r


def _alive(pid: int, sid: str) -> bool:
    try:
        return sid.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _node_tag(dp: DataPlaneRig) -> str:
    return node_tag(load_config(environ={}, overrides={"node": {"state_dir": str(dp.state)}}))


def _running(dp: DataPlaneRig) -> dict[str, int]:
    return {sid: pid for sid, pid in dp.sql("SELECT id, vmm_pid FROM sandboxes WHERE state = 'running'")}


def test_control_plane_killed_under_load_keeps_every_running_sandbox(dp: DataPlaneRig) -> None:
    dp.start()
    plane = dp.dataplane_pid()
    assert plane is not None
    sandboxes = [Sandbox.create(timeout=900) for _ in range(3)]
    sleepers: dict[str, int] = {}
    for sb in sandboxes:
        sb.files.write(MARK, f"written by {sb.sandbox_id}")
        sleepers[sb.sandbox_id] = sb.commands.run("sleep 100000", background=True, timeout=0).pid
    vmms = _running(dp)

    # load: commands into every sandbox, snapshots of one, creates of new ones, until the kill
    stop = threading.Event()
    counts: Counter[str] = Counter()

    def commands(sb: Sandbox) -> None:
        i = 0
        while not stop.is_set():
            try:
                sb.commands.run(f"echo {i} >> /home/user/load.txt", request_timeout=10)
                counts["command"] += 1
            except Exception:
                counts["command failed"] += 1
                time.sleep(0.2)
            i += 1

    def posts(path: str, body: dict[str, object], what: str) -> None:
        while not stop.is_set():
            try:
                with dp.api() as c:
                    counts[f"{what} {c.post(path, json=body).status_code}"] += 1
            except httpx.HTTPError:
                counts[f"{what} failed"] += 1
                time.sleep(0.2)

    workers = [threading.Thread(target=commands, args=(sb,), daemon=True) for sb in sandboxes]
    workers += [threading.Thread(target=posts, args=(f"/sandboxes/{sandboxes[0].sandbox_id}/snapshots", {},
                                                     "snapshot"), daemon=True),
                threading.Thread(target=posts, args=("/sandboxes", {"templateID": "base", "timeout": 900}, "create"),
                                 daemon=True)]
    for w in workers:
        w.start()
    _wait(lambda: counts["command"] >= 30 and counts["snapshot 201"] >= 1 and counts["create 201"] >= 1,
          f"the load did not get going: {counts}", timeout=180)
    before_kill = set(_running(dp))
    assert dp.node is not None
    dp.node.proc.send_signal(signal.SIGKILL)
    dp.node.proc.wait()
    stop.set()
    for w in workers:
        w.join(timeout=60)
    node = dp.start()

    # the data plane is the same process; every sandbox that ran runs on, on the same VMM
    assert dp.dataplane_pid() == plane
    new, _ = _settled(dp, set(), None)
    after = _running(dp)
    for sid, pid in vmms.items():
        assert after.get(sid) == pid, (sid, pid, after.get(sid))
    assert before_kill <= set(after), (before_kill - set(after), counts)
    # only creates the kill cut before they ran were settled as killed
    cut = dp.sql("SELECT sandbox_id, from_state FROM events WHERE operation = 'reconcile' AND to_state = 'killing'")
    assert all(st == "creating" for _, st in cut), cut
    tag = _node_tag(dp)
    for sid in after:
        assert _alive(after[sid], sid)
        events = dp.sql(f"SELECT detail FROM events WHERE sandbox_id = '{sid}' AND operation = 'adopt'")
        assert events, sid  # taken over, with its event
        # started by the data plane, in its own cgroup (vmm.cgroups) from its first instruction
        assert f":/aenv-{tag}/aenv-{sid}\n" in Path(f"/proc/{after[sid]}/cgroup").read_text(), sid
    for sb in sandboxes:
        back = Sandbox.connect(sb.sandbox_id, timeout=900)
        assert back.files.read(MARK) == f"written by {sb.sandbox_id}"
        assert back.commands.run(f"kill -0 {sleepers[sb.sandbox_id]} && echo alive").stdout == "alive\n"
        assert back.files.read("/home/user/load.txt").strip()
        # its logs went on from where the killed node's reader stopped: no line twice
        started = dp.sql(f"SELECT count(*) FROM sandbox_logs WHERE sandbox_id = '{sb.sandbox_id}' "
                         "AND message LIKE 'started process %sleep 100000%'")
        assert started == [(1,)], started
    _eventually(lambda: check_invariants(dp))
    status = dp.dataplane("status")
    assert status.returncode == 0 and f"{len(after)} disks, {len(after)} VMMs" in status.stdout, status.stdout

    # a graceful stop leaves them running too; the next start takes them over again
    stop_node(node.proc, keep_dataplane=True)
    assert dp.sql("SELECT count(*) FROM sandboxes WHERE state = 'running'") == [(len(after),)]
    assert all(_alive(pid, sid) for sid, pid in after.items())
    # their isolation and egress rules stay while they run with no node
    assert subprocess.run(["nft", "list", "table", "inet", f"aenv_{tag}"], capture_output=True).returncode == 0
    dp.start()
    assert _running(dp) == after

    # a taken-over sandbox is a sandbox like any other: its disk stack, memory and processes are whole
    first, second, third = (Sandbox.connect(sb.sandbox_id) for sb in sandboxes)
    first.files.write("/home/user/after.txt", "after the restarts")
    first.pause()
    first = Sandbox.connect(first.sandbox_id)
    assert first.files.read("/home/user/after.txt") == "after the restarts"
    assert first.files.read(MARK) == f"written by {first.sandbox_id}"
    assert first.commands.run(f"kill -0 {sleepers[first.sandbox_id]} && echo alive").stdout == "alive\n"
    with dp.api() as c:
        r = c.post(f"/sandboxes/{second.sandbox_id}/snapshots", json={})
        assert r.status_code == 201, r.text
        snap = r.json()["snapshotID"]
    child = Sandbox.create(snap, timeout=300)
    assert child.files.read(MARK) == f"written by {second.sandbox_id}"
    for sb in (first, second, third, child):
        sb.kill()
    for sid in set(after) - {s.sandbox_id for s in sandboxes}:
        Sandbox.kill(sid)
    _wait(lambda: not _running(dp), "sandboxes still running after their kill")
    _eventually(lambda: check_invariants(dp))
    assert dp.dataplane("status").stdout.startswith(f"data plane pid {plane}: 0 disks, 0 VMMs")
    assert not [sid for sid in after if Path(f"/sys/fs/cgroup/memory/aenv-{tag}/aenv-{sid}").exists()]


DP_CELLS = [
    # the node died inside a pause, before or after it answered (at the capture, before the persist): the
    # sandbox is taken over (vCPUs resumed, filesystem thawed) and paused again before the node serves
    Cell("pause.quiesced", _create, _post("/sandboxes/{sid}/pause"), "paused"),
    Cell("capture.captured", _create, _post("/sandboxes/{sid}/pause"), "paused"),
    # the upper it froze is sealed by the take-over: the writes before the crash stay on the disk
    Cell("capture.frozen", _create, _post("/sandboxes/{sid}/pause"), "paused"),
    Cell("pause.answered", _create, _post("/sandboxes/{sid}/pause"), "paused"),
    # the node died inside a capture that keeps the sandbox running: it runs on
    Cell("capture.sealed", _create, _post("/sandboxes/{sid}/snapshots", {}), "running"),
    Cell("snapshot.committed", _create, _post("/sandboxes/{sid}/fork", {"count": 2}), "running"),
    # the pause committed: it is paused there (its VMM killed, its disk closed in the data plane)
    Cell("pause.committed", _create, _post("/sandboxes/{sid}/pause"), "paused"),
    # a create cut before it ran is killed, its disk closed and its VMM killed in the data plane
    Cell("launch.envd_ready", None, _post("/sandboxes", {"templateID": "base", "timeout": 600}), "killed"),
]


@pytest.mark.parametrize("cell", DP_CELLS, ids=[f"{c.point}-{i}" for i, c in enumerate(DP_CELLS)])
def test_control_plane_killed_inside_an_operation(dp: DataPlaneRig, cell: Cell) -> None:
    # with a process that must survive, and writes the capture must keep, acknowledged before it
    before, sid = crash_at(dp, cell, lambda s: Sandbox.connect(s).commands.run("sleep 100000", background=True,
                                                                               timeout=0))
    dp.start()
    new, mine = _settled(dp, before, sid)
    assert mine is not None
    assert dp.sql(f"SELECT state FROM sandboxes WHERE id = '{mine}'") == [(cell.expect,)]
    if cell.expect == "paused" and cell.point != "pause.committed":  # taken over, then paused again
        ops = dp.sql(f"SELECT operation, to_state FROM events WHERE sandbox_id = '{mine}' AND subject = 'sandbox' "
                     "AND to_state IS NOT NULL ORDER BY id")
        cut = ops.index(("pause", "pausing"))
        assert ops[cut + 1:] == [("reconcile", "running"), ("adopt", "running"), ("reconcile", "pausing"),
                                 ("pause", "paused")], ops
    for child in new - {mine}:  # fork children cut before they ran
        assert dp.sql(f"SELECT state FROM sandboxes WHERE id = '{child}'") == [("killed",)]
    _eventually(lambda: check_invariants(dp))
    if cell.expect in ("running", "paused"):
        back = Sandbox.connect(mine, timeout=120)
        assert back.files.read(MARK) == f"written by {mine}"
        assert "sleep 100000" in back.commands.run("ps -eo args").stdout
        back.files.write("/home/user/after.txt", "after")  # a thawed filesystem takes writes
        back.pause()  # and the stack the take-over recorded captures whole
        back = Sandbox.connect(mine, timeout=120)
        assert back.files.read(MARK) == f"written by {mine}"
        assert back.files.read("/home/user/after.txt") == "after"
        back.kill()
    _eventually(lambda: check_invariants(dp))


def test_a_lost_data_plane_stops_the_node_and_the_next_start_settles_its_sandboxes(dp: DataPlaneRig) -> None:
    if dp.node is not None:
        stop_node(dp.node.proc)
    node = dp.start(AENV_SNAPSHOT_PERIODIC_INTERVAL_S="3")
    kept = Sandbox.create(timeout=600)
    kept.files.write(MARK, f"written by {kept.sandbox_id}")
    _wait(lambda: dp.sql(f"SELECT count(*) FROM snapshots WHERE source_sandbox_id = '{kept.sandbox_id}' "
                         "AND kind = 'periodic' AND status = 'committed'")[0][0] >= 1, "no periodic snapshot")
    # (between two periodic captures: during one the row says snapshotting)
    _wait(lambda: kept.sandbox_id in _running(dp), "the sandbox is not running")
    vmm = _running(dp)[kept.sandbox_id]
    plane = dp.dataplane_pid()
    assert plane is not None
    os.kill(plane, signal.SIGKILL)
    try:
        node.proc.wait(timeout=120)  # it stops by itself
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the node did not stop when its data plane died:\n{node.log()[-3000:]}") from None
    assert "the data plane (pid" in node.log()
    dp.start()
    assert dp.dataplane_pid() not in (None, plane)  # a new one
    _settled(dp, set(), None)
    assert dp.sql(f"SELECT state FROM sandboxes WHERE id = '{kept.sandbox_id}'") == [("paused",)]
    _wait(lambda: not _alive(vmm, kept.sandbox_id), "the orphaned VMM was not killed")
    _eventually(lambda: check_invariants(dp))
    back = Sandbox.connect(kept.sandbox_id, timeout=120)
    assert back.files.read(MARK) == f"written by {kept.sandbox_id}"
    back.kill()


def test_pause_on_stop_pauses_and_publishes_instead(dp: DataPlaneRig) -> None:
    """``serve --pause-on-stop``: a graceful stop pauses every running sandbox (events ``node_stop``) and
    closes its disk in the data plane; the next start resumes it with its files and processes."""
    if dp.node is not None:
        stop_node(dp.node.proc)
    node = dp.start(args=("--pause-on-stop",))
    sb = Sandbox.create(timeout=600)
    sb.files.write(MARK, f"written by {sb.sandbox_id}")
    sleeper = sb.commands.run("sleep 100000", background=True, timeout=0).pid
    stop_node(node.proc, keep_dataplane=True)
    assert dp.sql(f"SELECT state FROM sandboxes WHERE id = '{sb.sandbox_id}'") == [("paused",)]
    assert ("node_stop", "pausing") in dp.sql(f"SELECT operation, to_state FROM events WHERE sandbox_id = "
                                              f"'{sb.sandbox_id}'")
    assert dp.dataplane("status").stdout.split(":")[1].startswith(" 0 disks, 0 VMMs"), dp.dataplane("status").stdout
    dp.start()
    back = Sandbox.connect(sb.sandbox_id, timeout=120)
    assert back.files.read(MARK) == f"written by {sb.sandbox_id}"
    assert back.commands.run(f"kill -0 {sleeper} && echo alive").stdout == "alive\n"
    back.kill()
