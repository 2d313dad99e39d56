"""E2B SDK flows run against the node inside a KVM host VM, shared by the Firecracker and QEMU+KVM modules."""

from __future__ import annotations

import time

from e2b import Sandbox, Template, wait_for_port

# each value is written whole, then renamed over the last: a read never sees the file truncated and still empty
COUNTER = ("nohup sh -c 'i=0; while true; do i=$((i+1)); echo $i > /tmp/count.new; mv /tmp/count.new /tmp/count; "
           "sleep 0.2; done' >/dev/null 2>&1 &")


def counter(sb: Sandbox) -> int:
    return int(sb.commands.run("cat /tmp/count").stdout.strip())


def quickstart() -> None:
    """The README quickstart: create, run, write, read, list, kill."""
    sb = Sandbox.create()
    try:
        r = sb.commands.run("echo hi; uname -r")
        assert r.exit_code == 0 and r.stdout.startswith("hi\n"), r
        sb.files.write("/home/user/hello.txt", "hello from the host")
        assert sb.files.read("/home/user/hello.txt") == "hello from the host"
        assert sb.sandbox_id in [s.sandbox_id for s in Sandbox.list().next_items()]
    finally:
        assert sb.kill() is True
    assert sb.sandbox_id not in [s.sandbox_id for s in Sandbox.list().next_items()]


def pause_resume_with_running_process() -> None:
    """A process keeps counting across pause and resume (by connect), and the files are still there."""
    sb = Sandbox.create()
    try:
        sb.commands.run(COUNTER)
        sb.files.write("/home/user/kept.txt", "kept")
        time.sleep(1)
        sb.pause()
        assert Sandbox.get_info(sb.sandbox_id).state.value == "paused"
        sb = Sandbox.connect(sb.sandbox_id)
        a = counter(sb)
        time.sleep(1.5)
        b = counter(sb)
        assert b > a > 0, (a, b)
        assert sb.files.read("/home/user/kept.txt") == "kept"
        # a second cycle: the restore is from the pause's own snapshot, not the template's
        sb.pause()
        sb = Sandbox.connect(sb.sandbox_id)
        assert counter(sb) >= b
    finally:
        Sandbox.kill(sb.sandbox_id)


def snapshot_then_create() -> None:
    """A snapshot, a sandbox from it, then a pause and resume of the snapshotted sandbox itself: its memory must
    be whole (under Firecracker the pause's diff starts at the snapshot, not at the restore)."""
    sb = Sandbox.create(envs={"FROM": "parent"})
    try:
        sb.commands.run(COUNTER)
        sb.files.write("/home/user/state.txt", "snapshotted")
        snap = sb.create_snapshot()
        sb.files.write("/home/user/state.txt", "changed after")
        assert sb.commands.run("echo still running").stdout == "still running\n"
        child = Sandbox.create(template=snap.snapshot_id)
        try:
            assert child.files.read("/home/user/state.txt") == "snapshotted"
            assert child.commands.run("echo $FROM").stdout == "parent\n"
        finally:
            child.kill()
        sb.pause()
        sb = Sandbox.connect(sb.sandbox_id)
        assert sb.files.read("/home/user/state.txt") == "changed after"
        a = counter(sb)
        time.sleep(1)
        assert counter(sb) > a > 0
        assert Sandbox.delete_snapshot(snap.snapshot_id) is True
    finally:
        Sandbox.kill(sb.sandbox_id)


def fork_diverges() -> None:
    parent = Sandbox.create()
    children: list[Sandbox] = []
    try:
        parent.commands.run("nohup sleep 86400 >/dev/null 2>&1 &")
        parent.files.write("/home/user/shared.txt", "from the parent")
        children = parent.fork(count=2)
        assert len(children) == 2 and len({c.sandbox_id for c in children} | {parent.sandbox_id}) == 3
        for i, c in enumerate(children):
            assert c.files.read("/home/user/shared.txt") == "from the parent"
            assert c.commands.run("pgrep -x sleep >/dev/null && echo inherited").stdout == "inherited\n"
            c.files.write("/home/user/mine.txt", f"child {i}")
        for i, c in enumerate(children):
            assert c.files.read("/home/user/mine.txt") == f"child {i}"
        assert not parent.files.exists("/home/user/mine.txt")
        assert parent.commands.run("echo parent alive").stdout == "parent alive\n"
    finally:
        for c in children:
            c.kill()
        parent.kill()


def ttl_pauses_and_traffic_resumes() -> None:
    # 20 s: a create here takes several seconds, and the write must land before the timeout
    sb = Sandbox.create(timeout=20, lifecycle={"on_timeout": "pause", "auto_resume": True})
    try:
        sb.files.write("/home/user/t.txt", "before timeout")
        deadline = time.monotonic() + 120
        while Sandbox.get_info(sb.sandbox_id).state.value != "paused":
            assert time.monotonic() < deadline, "the sandbox was not paused at its timeout"
            time.sleep(0.5)
        assert sb.files.read("/home/user/t.txt") == "before timeout"  # traffic resumes it
        assert Sandbox.get_info(sb.sandbox_id).state.value == "running"
    finally:
        Sandbox.kill(sb.sandbox_id)


def template_build_from_base() -> None:
    """A template built by the SDK's builder on this host's VMM: FROM base, a RUN step (sealed as a layer of its
    own on this VMM's disks), a start command snapshotted running; then a sandbox of it, and a cached rebuild."""
    t = (Template().from_template("base").run_cmd("echo built-on-the-host > /home/user/built.txt")
         .set_start_cmd("python3 -m http.server 8090", wait_for_port(8090)))
    logs: list[str] = []
    Template.build(t, "host-app", on_build_logs=lambda e: logs.append(e.message))
    assert "step 1/1 RUN echo built-on-the-host" in "\n".join(logs), logs
    sb = Sandbox.create("host-app")
    try:
        assert sb.files.read("/home/user/built.txt") == "built-on-the-host\n"
        r = sb.commands.run("curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:8090/")
        assert r.stdout == "200", r  # the server started at build time is in the snapshot
    finally:
        sb.kill()
    logs.clear()
    Template.build(t, "host-app", on_build_logs=lambda e: logs.append(e.message))
    assert "1 of 1 steps cached" in "\n".join(logs), logs
