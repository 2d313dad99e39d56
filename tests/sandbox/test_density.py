"""Density through the E2B SDK: memory a sandbox's guest frees goes back to the host (virtio-balloon free page
reporting), while the snapshot image every sandbox of the template maps copy-on-write stays untouched."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import pytest
from e2b import Sandbox

pytestmark = pytest.mark.vm

GUEST_PYTHON = "/opt/aenv/bin/python"  # the tools drive's Python
FILL_MIB = 160
# touch every page of a bytearray, hold it a while, then exit: the guest kernel frees it all at once
FILL = (f"{GUEST_PYTHON} -c 'import time; b = bytearray({FILL_MIB} << 20); "
        f"b[::4096] = bytes(len(b) // 4096 * [1]); open(\"/tmp/filled\", \"w\").close(); time.sleep(4)'")


def _anon_mib(pid: int) -> float:
    """QEMU's anonymous memory: the guest's private (written) pages plus QEMU's own heap."""
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Anonymous:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no Anonymous line for {pid}")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def test_freed_guest_memory_returns_to_the_host_and_the_shared_image_is_untouched(sdk_env) -> None:
    node = sdk_env
    image_path = Path(node.sql(
        "select s.memory_location from templates t join snapshots s "
        "on s.id = t.boot_snapshot_id where t.id = 'base'")[0][0])
    assert node.sql("select json_extract(s.config, '$.shape.free_page_reporting') from templates t "
                    "join snapshots s on s.id = t.boot_snapshot_id where t.id = 'base'")[0][0] == 1
    before = _sha256(image_path)
    a = Sandbox.create(timeout=300)
    b = Sandbox.create(timeout=300)  # maps the same image
    try:
        pid = node.sql(f"select vmm_pid from sandboxes where id = '{a.sandbox_id}'")[0][0]
        assert a.commands.run("echo ready").stdout.strip() == "ready"
        base_mib = _anon_mib(pid)
        fill = a.commands.run(FILL, background=True, timeout=300)
        deadline = time.monotonic() + 120
        while a.commands.run("test -e /tmp/filled || echo no").stdout.strip() == "no":
            assert time.monotonic() < deadline, "the guest never filled its memory"
            time.sleep(0.5)
        peak_mib = _anon_mib(pid)
        assert peak_mib > base_mib + FILL_MIB * 0.8, (base_mib, peak_mib)  # the guest really holds it
        fill.wait()
        # the process has exited: its pages are free in the guest; reporting runs ~2 s later
        deadline, lowest = time.monotonic() + 60, float("inf")
        while time.monotonic() < deadline:
            lowest = min(lowest, _anon_mib(pid))
            if lowest < base_mib + FILL_MIB / 2:
                break
            time.sleep(1)
        assert lowest < base_mib + FILL_MIB / 2, (
            f"QEMU keeps {lowest:.0f} MiB anonymous after the guest freed {FILL_MIB} MiB "
            f"(before {base_mib:.0f}, holding {peak_mib:.0f})")
        print(f"QEMU anonymous memory: {base_mib:.0f} MiB idle, {peak_mib:.0f} MiB holding {FILL_MIB} MiB, "
              f"{lowest:.0f} MiB after the free")
        # the pages were dropped from QEMU, not punched out of the shared file
        assert _sha256(image_path) == before
        assert b.commands.run("echo still fine").stdout.strip() == "still fine"
        a.files.write("/home/user/after", "kept")
        assert a.files.read("/home/user/after") == "kept"
        # freed pages no longer count as dirty: the pause captures far less than the guest wrote
        a.pause()
        node.wait_state(a.sandbox_id, "paused")
        dirty = node.sql(f"select dirty_bytes from snapshots "
                         f"where source_sandbox_id = '{a.sandbox_id}' order by created_at desc limit 1")[0][0]
        assert dirty < (FILL_MIB << 20) // 2, dirty
        a = Sandbox.connect(a.sandbox_id)
        assert a.files.read("/home/user/after") == "kept"
        c = Sandbox.create(timeout=120)  # a fresh restore of the untouched image
        try:
            assert c.commands.run("echo new").stdout.strip() == "new"
        finally:
            c.kill()
    finally:
        a.kill()
        b.kill()
