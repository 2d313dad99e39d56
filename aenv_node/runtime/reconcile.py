"""Start-up reconciliation: the database and reality agree before anything is served.

Run through ``Node.reconcilers`` (before any service starts). A node that
stopped without pausing its sandboxes (a crash, SIGKILL) left rows saying
creating, running, pausing, ... and perhaps VMM processes, network namespaces,
sockets and uppers. Each such sandbox becomes:

* paused, if it was resuming (its pause snapshot is intact);
* paused at its new snapshot, if it was pausing and that pause's capture
  had committed (the stop came before the paused transition);
* paused at its newest periodic snapshot, if it has one (published again, so
  the repository's record says paused instead of running here), also when the
  node died in the middle of a capture (snapshotting, forking: the sandbox
  was running, and the interrupted capture committed nothing);
* killed otherwise, with the reason in its event;
* killed, and its VMM too if it still ran, when its repository record names another node: a node of the
  cluster took it over from its checkpoint while this one was down (or cut off), and two copies must not
  run; the record is that node's and is left alone.

Then what its run left is removed: the VMM (by the pid it wrote to its run
directory before it ran, else the one the row recorded, and only if that
process is this sandbox's), its run and work directories, its
repository ownership record, and every network slot of this node's range.
A sandbox paused here whose snapshot was never published (the stop came
between the pause and its publish) is queued for publishing again.

With a data plane (``node.data_plane``) the data plane is started first if none
answers, and a sandbox it still serves is taken over instead (``Adoption``:
the sandbox registry attaches to it when it starts): its row said running, or
a capture the restart cut (snapshotting, forking, or pausing with no committed
pause snapshot), its disk is open in the data plane, and its VMM is alive, is
the data plane's child, and is the one it recorded in ``run/<id>/vmm.pid``.
One taken over from a cut pause runs again and is paused again once it is
(``CutPauses``): a pause answers before it is persisted, so the caller may
have been told it paused.
Everything else the data plane holds (a disk or a VMM no sandbox is taken
over with) is closed or killed: only what the node started, found by what it
recorded, never by a scan of processes.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Optional

import trio
from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from ..dataplane import vmm_key
from ..net import remove_orphans
from ..snapshot.operations import SnapshotOperations
from ..snapshot.layers import ensure_layers
from ..snapshot.publish import record_unsettled, settle_record, unpublished_pauses
from ..snapshot.store import SnapshotStore
from ..state import (
    Event,
    EventSubject,
    LayerKind,
    NetworkSlot,
    Sandbox,
    SandboxState,
    Snapshot,
    SnapshotKind,
    SnapshotStatus,
)
from ..state import repository as repo
from ..vmm import FirecrackerDriver, kill_recorded
from ..vmm.process import read_pid_file
from .node import Node
from .parts import NodeParts
from .sandbox import Adoption

__all__ = ["Reconciler", "LIVE_STATES"]

log = logging.getLogger(__name__)

S = SandboxState

#: States in which a sandbox holds a VMM process on this node.
LIVE_STATES = (S.CREATING, S.RUNNING, S.PAUSING, S.RESUMING, S.SNAPSHOTTING, S.FORKING, S.KILLING)


def _is_our_vmm(pid: int, sandbox_id: str) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return sandbox_id.encode() in cmdline


def _left_live(s: Session) -> list[tuple[str, Optional[int]]]:
    """(sandbox, recorded VMM pid) of every sandbox the previous run left live."""
    return [(sid, pid) for sid, pid in s.execute(
        select(Sandbox.id, Sandbox.vmm_pid).where(Sandbox.state.in_(LIVE_STATES)))]


def _pause_snapshot_of_this_pause(s: Session, sandbox_id: str) -> Optional[str]:
    """The pause snapshot a sandbox left pausing committed during that pause (None if none): the newest
    committed pause snapshot of it created since its last pausing transition."""
    began = s.scalar(select(Event.ts).where(Event.sandbox_id == sandbox_id, Event.subject == EventSubject.SANDBOX,
                                            Event.to_state == S.PAUSING.value).order_by(Event.id.desc()).limit(1))
    if began is None:
        return None
    return s.scalar(select(Snapshot.id).where(
        Snapshot.source_sandbox_id == sandbox_id, Snapshot.kind == SnapshotKind.PAUSE,
        Snapshot.status == SnapshotStatus.COMMITTED, Snapshot.created_at >= began)
        .order_by(Snapshot.created_at.desc()).limit(1))


def _adoptable(s: Session, sandbox_id: str) -> Optional[tuple[SandboxState, int, str]]:
    """The state a sandbox was left in, its slot and the snapshot it runs from, if a take-over continues from
    that state (None: settle it)."""
    sb = s.get(Sandbox, sandbox_id)
    if sb is None or sb.slot_index is None or sb.snapshot_id is None:
        return None
    state = SandboxState(sb.state)
    if state in (S.RUNNING, S.SNAPSHOTTING, S.FORKING) or (
            state == S.PAUSING and _pause_snapshot_of_this_pause(s, sandbox_id) is None):  # it committed nothing
        return state, sb.slot_index, sb.snapshot_id
    return None


def _settle_rows(s: Session, adopted: dict[str, Adoption], moved: dict[str, str]) -> list[tuple[str, str]]:
    """Every sandbox the previous run left live, settled (a taken-over one: running, every layer of its disk a
    row of the node's; one another node took over: killed here); (snapshot, sandbox) to publish again."""
    republish: list[tuple[str, str]] = []
    for sb in s.scalars(select(Sandbox).where(Sandbox.state.in_(LIVE_STATES))):
        current = sb.state
        if sb.id in moved:
            if current != S.KILLING:
                repo.transition(s, sb.id, S.KILLING, operation="reconcile")
            repo.transition(s, sb.id, S.KILLED, operation="reconcile", vmm_pid=None, slot_index=None,
                            detail={"reason": f"node {moved[sb.id]} took the sandbox over while this node was "
                                              "down", "owner": moved[sb.id]})
            continue
        if sb.id in adopted:
            ensure_layers(s, adopted[sb.id].layers, LayerKind.DISK)
            if current != S.RUNNING:
                again = "; it pauses again" if current == S.PAUSING else ""
                repo.transition(s, sb.id, S.RUNNING, operation="reconcile",
                                detail={"reason": f"the node restarted during {current}; the sandbox runs on in "
                                                  f"the data plane and the operation committed nothing{again}"})
            continue
        if current == S.RESUMING:
            # its pause snapshot is intact: it is still paused
            repo.transition(s, sb.id, S.PAUSED, operation="reconcile", vmm_pid=None, slot_index=None)
            continue
        if current in (S.SNAPSHOTTING, S.FORKING):
            # the node died during a live capture (a periodic snapshot, say): the sandbox was running, and
            # what the capture wrote is uncommitted; the lifecycle goes on from running
            repo.transition(s, sb.id, S.RUNNING, operation="reconcile",
                            detail={"reason": f"the node restarted during a capture ({current})"})
            current = S.RUNNING
        if current == S.PAUSING:
            taken = _pause_snapshot_of_this_pause(s, sb.id)
            if taken is not None:
                # the node died after the pause's capture committed: the sandbox is paused there
                repo.transition(s, sb.id, S.PAUSED, operation="reconcile", snapshot_id=taken, vmm_pid=None,
                                slot_index=None, detail={"reason": "the node restarted after the pause's snapshot "
                                                                   "committed", "snapshot_id": taken})
                republish.append((taken, sb.id))
                continue
        periodic = SnapshotStore.latest_periodic(s, sb.id)
        if periodic is not None and current in (S.RUNNING, S.PAUSING):
            if current != S.PAUSING:
                repo.transition(s, sb.id, S.PAUSING, operation="reconcile")
            repo.transition(s, sb.id, S.PAUSED, operation="reconcile", snapshot_id=periodic.id, vmm_pid=None,
                            slot_index=None, detail={"reason": "the node restarted: paused at its latest "
                                                               "periodic snapshot", "snapshot_id": periodic.id})
            republish.append((periodic.id, sb.id))
            continue
        if current != S.KILLING:
            repo.transition(s, sb.id, S.KILLING, operation="reconcile")
        repo.transition(s, sb.id, S.KILLED, operation="reconcile", vmm_pid=None, slot_index=None,
                        detail={"reason": "the node restarted; its VMM did not survive"})
    s.execute(delete(NetworkSlot).where(NetworkSlot.slot_index.not_in([a.slot.index for a in adopted.values()])))
    return republish


#: how long a reconcile waits for the VMMs it SIGKILLed to be gone before it removes their cgroups
_VMM_EXIT_WAIT_S = 60


def _exists(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie has left its cgroups: it counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Reconciler:
    """The node's reconciler (``Node.reconcilers``); see the module docstring."""

    def __init__(self, parts: NodeParts, ops: SnapshotOperations) -> None:
        self.parts = parts
        self.ops = ops

    async def __call__(self, node: Node) -> None:
        p = self.parts
        found = await p.db.run(_left_live)
        moved = await self._moved_away(found)
        adopted = await self._find_adoptable([f for f in found if f[0] not in moved])
        keep_slots = [a.slot.index for a in adopted.values()]
        await remove_orphans(p.netcfg, keep=keep_slots)
        # what the last run left goes first, whatever the rows below turn out to need: nothing else owns it
        killed_pids: list[int] = []
        for sid, pid in found:
            if sid in adopted:
                continue
            # the pid the VMM itself recorded before it ran (a create or a fork child killed before its row
            # named one), else the row's
            killed = kill_recorded(p.cfg.run_dir / sid / "vmm.pid", sid)
            if killed is None and pid and _is_our_vmm(pid, sid):
                try:
                    os.kill(pid, 9)
                    killed = pid
                except ProcessLookupError:
                    pass
            if killed is not None:
                log.warning("reconcile: killed leftover VMM %d of sandbox %s", killed, sid)
                killed_pids.append(killed)
            if p.dataplane is not None:  # the disk it served goes with it
                await p.dataplane.close_disk(sid)
            # its sockets and its writable upper died with it (a pause's state is in its snapshot)
            shutil.rmtree(p.cfg.run_dir / sid, ignore_errors=True)
            shutil.rmtree(p.cfg.sandboxes_dir / sid, ignore_errors=True)
        await self._clear_dataplane(adopted)
        republish = await p.db.run(_settle_rows, adopted, moved)
        # pauses whose publish the stop cut (their local snapshot is whole; the repository's record is not)
        republish += await p.db.run(unpublished_pauses)
        for snapshot_id, sid in republish:
            # published as a pause once the operations run, so its repository record says paused (and other
            # nodes may resume it) instead of running on this node
            self.ops.after_pause(snapshot_id, sid)
        for sid, _ in found:  # a record naming this node as running would make other nodes refuse it
            if sid in adopted or sid in moved:
                continue  # it runs here: the record is right; or it runs elsewhere: the record is that node's
            try:
                await settle_record(p.db, p.repository, sid, p.owner)
            except Exception as exc:  # the repository may be unreachable: retried until it answers
                log.warning("settling the ownership record of %s failed: %s", sid, exc)
                error = f"{type(exc).__name__}: {exc}"
                await p.db.run(record_unsettled, sid, error)
        removed = await remove_orphans(p.netcfg, keep=keep_slots)
        if p.driver.limits is not None:  # the cgroups a crash left, of the VMMs killed above among them
            limits = p.driver.limits
            # A VMM a pid file missed is still in its sandbox's cgroup: one already exiting when its pid was
            # read (its command line is empty then, so ``kill_recorded`` left it) stayed in its cgroup past the
            # sweep in CI, and the cgroup stayed for good. Whatever is in the cgroup of a sandbox that ends here
            # is that sandbox's VMM: killed too. A SIGKILLed VMM busy in the kernel (writing its memory out
            # under a loaded disk) took over 5 s to go: the sweep waits until the cgroups are empty.
            ended = [vmm_key(sid) for sid, _ in found if sid not in adopted]
            for name in ended:
                for pid in limits.members(name):
                    try:
                        os.kill(pid, 9)
                    except ProcessLookupError:
                        pass

            def busy() -> list[str]:
                return [n for n in ended if limits.members(n)] + [str(pid) for pid in killed_pids if _exists(pid)]

            with trio.move_on_after(_VMM_EXIT_WAIT_S):
                while busy():
                    await trio.sleep(0.05)
            left = busy()
            if left:
                log.warning("reconcile: killed VMMs still exist after %d s (%s): their cgroups stay",
                            _VMM_EXIT_WAIT_S, ", ".join(left))
            await trio.to_thread.run_sync(limits.sweep)
        if isinstance(p.driver, FirecrackerDriver):  # the chroots of jailed VMMs that are gone
            jails = await p.driver.sweep_jails(wait_for=killed_pids)
            if jails:
                log.info("reconcile: removed the jails of %d VMMs gone: %s", len(jails), ", ".join(jails))
        p.adoptions = adopted
        # a pause answers before it is persisted (snapshot/operations.py): one the restart cut is done again
        # once the sandbox is taken over (lifetimes.py ``CutPauses``)
        p.cut_pauses = [sid for sid, a in adopted.items() if a.left_in == S.PAUSING]
        if removed or found:
            log.info("reconcile: %d sandboxes settled (%d to take over), %d orphan slots removed", len(found),
                     len(adopted), len(removed))

    async def _moved_away(self, found: list[tuple[str, Optional[int]]]) -> dict[str, str]:
        """Of the sandboxes left live, those whose repository record another node holds now: sandbox -> owner.
        A record that cannot be read (the repository is down) moves nothing: the checkpoint's publish finds
        out later (``SandboxMovedAway``)."""
        p = self.parts
        out: dict[str, str] = {}
        for sid, _ in found:
            try:
                rec = await trio.to_thread.run_sync(p.repository.get_ownership, sid)
            except Exception as exc:
                log.warning("reconcile: the ownership record of %s could not be read: %s", sid, exc)
                continue
            if rec is not None and rec.owner not in ("", p.owner):
                log.warning("reconcile: sandbox %s was taken over by node %s while this node was down: it ends "
                            "here", sid, rec.owner)
                out[sid] = rec.owner
        return out

    async def _find_adoptable(self, found: list[tuple[str, Optional[int]]]) -> dict[str, Adoption]:
        """With a data plane (started here if none answers): the sandboxes to take over (module docstring)."""
        p = self.parts
        if p.dataplane is None:
            return {}
        await p.dataplane.ensure_running(env=p.cfg.as_environment(), log_path=p.cfg.state_dir / "logs" /
                                         "dataplane.log")
        held = {d.sandbox_id for d in await p.dataplane.held_disks()}
        children = await p.dataplane.children()
        out: dict[str, Adoption] = {}
        for sid, _ in found:
            pid = read_pid_file(p.cfg.run_dir / sid / "vmm.pid")
            if sid not in held or pid is None or children.get(pid) != vmm_key(sid) or not _is_our_vmm(pid, sid):
                continue
            left = await p.db.run(_adoptable, sid)
            if left is None:
                continue
            state, slot_index, snapshot_id = left
            # an upper a cut capture froze is sealed into a layer: the stack the guest sees, as it is
            disk = await p.dataplane.recover_disk(sid, p.cfg.layers_dir)
            out[sid] = Adoption(vmm_pid=pid, slot=p.netcfg.slot(slot_index), left_in=state, disk_source=disk.source,
                                layers=disk.refs, snapshot_id=snapshot_id)
        return out

    async def _clear_dataplane(self, adopted: dict[str, Adoption]) -> None:
        """Close every disk and kill every VMM the data plane holds that no taken-over sandbox uses."""
        p = self.parts
        if p.dataplane is None:
            return
        keep = {a.vmm_pid for a in adopted.values()}
        for pid, key in (await p.dataplane.children()).items():
            if pid not in keep:
                log.warning("reconcile: killing VMM %d (%s) the data plane ran for the previous run", pid, key)
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass
        for disk in await p.dataplane.held_disks():
            if disk.sandbox_id not in adopted:
                await p.dataplane.close_disk(disk.sandbox_id)
