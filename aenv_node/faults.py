"""Named crash points: the node kills itself (SIGKILL) at a named step, so tests can prove every step is safe.

``AENV_CRASH_AT=pause.captured`` makes the node die the first time a pause reaches that point;
``AENV_CRASH_AT=pause.captured@3`` the third time. The crash-safety tests restart the node on the same state
directory afterwards and check that nothing was lost or left behind (tests/sandbox/test_crash_points.py).

Why SIGKILL of itself and not an exception: an exception runs cleanup (``finally`` blocks, shielded scopes)
that a real crash (an OOM kill, a power cut of the process) does not. ``os.kill(getpid(), SIGKILL)`` stops
every thread at once, with no Python code after it, as ``kill -9`` from outside does.

``AENV_CRASH_VMM_AT=capture.captured`` kills the operation's VMM there instead (SIGKILL of the pid the point
is given), and the node goes on: the operation must notice and leave a truthful state. Only the points that
have a VMM at hand (``VMM_POINTS``) take it.

Off (no variable), ``crash_point`` is one comparison against ``None``. An armed name that is not in
``POINTS`` is refused when the node starts (``check_armed``), so a typo never gives a test that cannot fail.
This module imports nothing from the node: every layer may call it.
"""

from __future__ import annotations

import os
import signal
import sys

__all__ = ["POINTS", "VMM_POINTS", "crash_point", "check_armed", "ENV", "VMM_ENV"]


ENV = "AENV_CRASH_AT"
VMM_ENV = "AENV_CRASH_VMM_AT"

#: Every crash point, with where it is. A point is reached by the operations that run through it.
POINTS: dict[str, str] = {
    "create.inserted": "create: the sandbox row is committed (creating), nothing started",
    "launch.vmm_started": "create, resume, fork child: the VMM process runs, the guest is restored, envd not "
                          "yet initialised",
    "launch.envd_ready": "create, resume, fork child: envd answered /init, the running transition not committed",
    "pause.quiesced": "pause: the guest's filesystem is frozen, nothing captured",
    "capture.captured": "pause, snapshot, fork: the VM's memory and device state are written, the disk layer "
                        "not sealed",
    "capture.frozen": "pause, snapshot, fork: memory captured and the disk's upper frozen (writes go to a fresh "
                      "one), the frozen upper not sealed",
    "capture.sealed": "pause, snapshot, fork: disk and memory layers written, the snapshot not committed",
    "pause.committed": "pause: the snapshot is committed, the VMM still runs, the paused transition not committed",
    "pause.answered": "pause: the call is answering (with a data plane: the guest captured and its upper frozen, "
                      "nothing persisted; without one: the sandbox paused)",
    "snapshot.committed": "snapshot, fork: the snapshot is committed, the sandbox still marked snapshotting "
                          "or forking",
    "fork.child_inserted": "fork: a child's row is committed (creating), its VMM not started",
    "publish.layers_uploaded": "publish: the first layer is in the repository, the manifest not written",
    "publish.manifest_written": "publish: the snapshot's manifest is written, the sandbox's record not updated",
    "compaction.written": "compaction: the merged layer file is written, the stack not swapped",
    "gc.marked": "local GC: garbage is marked collected in the database, no file removed",
    "build.booted": "template build: the build VM answers, nothing captured",
    "build.sealed": "template build: memory captured and the disk layer sealed, the build not committed",
}

#: The points that are given the pid of the VMM the operation drives (``AENV_CRASH_VMM_AT``).
VMM_POINTS = frozenset({"launch.vmm_started", "launch.envd_ready", "pause.quiesced", "capture.captured",
                        "capture.sealed", "pause.committed", "snapshot.committed", "build.booted"})


def _parse(value: str | None) -> tuple[str, int] | None:
    if not value:
        return None
    name, _, nth = value.partition("@")
    return name, int(nth) if nth.isdigit() and int(nth) > 0 else 1


_ARMED = _parse(os.environ.get(ENV))
_VMM_ARMED = _parse(os.environ.get(VMM_ENV))
_hits = 0
_vmm_hits = 0


def check_armed() -> None:
    """Refuse an armed name that names no crash point (raises ``ValueError`` with the list)."""
    if _ARMED is not None and _ARMED[0] not in POINTS:
        raise ValueError(f"{ENV}={os.environ.get(ENV)!r}: no such crash point; known: {', '.join(sorted(POINTS))}")
    if _VMM_ARMED is not None and _VMM_ARMED[0] not in VMM_POINTS:
        raise ValueError(f"{VMM_ENV}={os.environ.get(VMM_ENV)!r}: no such crash point with a VMM; known: "
                         f"{', '.join(sorted(VMM_POINTS))}")


def crash_point(name: str, *, vmm_pid: int | None = None) -> None:
    """Die here (SIGKILL of this process) if ``name`` is the armed crash point and this is the armed hit; or
    SIGKILL ``vmm_pid`` if the point is armed for its VMM."""
    global _hits, _vmm_hits
    if _VMM_ARMED is not None and _VMM_ARMED[0] == name and vmm_pid is not None and vmm_pid > 0:
        _vmm_hits += 1
        if _vmm_hits == _VMM_ARMED[1]:
            sys.stderr.write(f"crash point {name} (hit {_vmm_hits}): killing VMM {vmm_pid} with SIGKILL\n")
            sys.stderr.flush()
            try:
                os.kill(vmm_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    if _ARMED is None or _ARMED[0] != name:
        return
    _hits += 1
    if _hits < _ARMED[1]:
        return
    msg = f"crash point {name} (hit {_hits}): killing this process with SIGKILL\n"
    try:
        sys.stderr.write(msg)
        sys.stderr.flush()
    finally:
        os.kill(os.getpid(), signal.SIGKILL)
