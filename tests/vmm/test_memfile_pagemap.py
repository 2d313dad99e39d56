"""Memory-image helpers and the pagemap dirty-page method, without VMs.

The pagemap test maps a file MAP_PRIVATE in this very process (as a restored VMM maps its image), writes
some pages, and checks that exactly those are reported, and that copying them out of /proc/self/mem gives
the written bytes while the file itself stays untouched.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aenv_node.vmm import PAGE_SIZE, Accel, MemoryRange, detect_accel, memfile, pagemap
from aenv_node.vmm.errors import SnapshotError, VmmConfigError

NPAGES = 64

page_sets = st.sets(st.integers(0, NPAGES - 1), max_size=NPAGES)


def write_pages(path: Path, pages: set[int], fill: int, *, size: int = NPAGES * PAGE_SIZE) -> None:
    with open(path, "wb") as f:
        f.truncate(size)
        for p in pages:
            f.seek(p * PAGE_SIZE)
            f.write(bytes([fill]) * PAGE_SIZE)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pages=page_sets)
def test_data_ranges_are_the_written_pages(tmp_path: Path, pages: set[int]) -> None:
    f = tmp_path / "sparse"
    write_pages(f, pages, 7)
    ranges = memfile.data_ranges(f)
    got = {p for r in ranges for p in range(r.offset // PAGE_SIZE, r.end // PAGE_SIZE)}
    assert got == pages
    # merged: no two ranges touch
    assert all(a.end < b.offset for a, b in zip(ranges, ranges[1:], strict=False))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(base=page_sets, diffs=st.lists(page_sets, max_size=3))
def test_materialize_equals_layering_the_writes(tmp_path: Path, base: set[int], diffs: list[set[int]]) -> None:
    model = bytearray(NPAGES * PAGE_SIZE)
    for p in base:
        model[p * PAGE_SIZE : (p + 1) * PAGE_SIZE] = b"\x01" * PAGE_SIZE
    write_pages(tmp_path / "base", base, 1)
    layers = []
    for i, pages in enumerate(diffs):
        d = tmp_path / f"diff{i}"
        write_pages(d, pages, 10 + i)
        for p in pages:
            model[p * PAGE_SIZE : (p + 1) * PAGE_SIZE] = bytes([10 + i]) * PAGE_SIZE
        layers.append((d, None if i % 2 else memfile.data_ranges(d)))
    out = tmp_path / "out"
    memfile.materialize(tmp_path / "base", layers, out)
    assert out.read_bytes() == bytes(model)
    assert (tmp_path / "base").read_bytes()[: PAGE_SIZE * NPAGES].count(b"\x01") == len(base) * PAGE_SIZE


def test_copy_image_keeps_holes(tmp_path: Path) -> None:
    src = tmp_path / "src"
    write_pages(src, {3, 4, 40}, 9, size=16 << 20)
    dst = tmp_path / "dst"
    memfile.copy_image(src, dst)
    assert dst.read_bytes() == src.read_bytes()
    assert dst.stat().st_blocks * 512 <= 64 * 1024  # 3 pages of data, not 16 MiB
    assert not (tmp_path / "dst.part").exists()


def test_pagemap_finds_exactly_the_pages_written_to_a_private_mapping(tmp_path: Path) -> None:
    img = tmp_path / "image"
    write_pages(img, set(range(NPAGES)), 0x11)
    written = {0, 5, 6, 7, 33, 63}
    with open(img, "r+b") as f:
        m = mmap.mmap(f.fileno(), NPAGES * PAGE_SIZE, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    try:
        for p in range(NPAGES):  # fault every page in for reading: present but file-backed, not dirty
            _ = m[p * PAGE_SIZE]
        assert pagemap.dirty_ranges(os.getpid(), img) == ()
        for p in written:
            m[p * PAGE_SIZE : p * PAGE_SIZE + 3] = b"abc"
        maps = pagemap.find_mappings(os.getpid(), img)
        assert len(maps) == 1 and maps[0].file_offset == 0
        pages = pagemap.dirty_page_indices(os.getpid(), maps)
        assert set(pages.tolist()) == written
        ranges = pagemap.pages_to_ranges(pages)
        assert ranges == (
            MemoryRange(0, PAGE_SIZE),
            MemoryRange(5 * PAGE_SIZE, 3 * PAGE_SIZE),
            MemoryRange(33 * PAGE_SIZE, PAGE_SIZE),
            MemoryRange(63 * PAGE_SIZE, PAGE_SIZE),
        )
        out = tmp_path / "diff"
        fd = os.open(out, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, NPAGES * PAGE_SIZE)
            pagemap.copy_out(os.getpid(), maps, ranges, fd)
        finally:
            os.close(fd)
        data = out.read_bytes()
        for p in written:
            assert data[p * PAGE_SIZE : p * PAGE_SIZE + 4] == b"abc\x11"
        assert memfile.data_ranges(out) == ranges
    finally:
        m.close()
    # copy-on-write: the file never saw the writes
    assert img.read_bytes() == b"\x11" * (NPAGES * PAGE_SIZE)


def test_pagemap_of_an_unmapped_file_is_an_error(tmp_path: Path) -> None:
    f = tmp_path / "f"
    f.write_bytes(b"x")
    try:
        pagemap.find_mappings(os.getpid(), f)
    except SnapshotError as e:
        assert "does not map" in str(e)
    else:
        raise AssertionError("expected SnapshotError")


def test_pages_to_ranges_merges_runs() -> None:
    assert pagemap.pages_to_ranges(np.array([], dtype=np.int64)) == ()
    r = pagemap.pages_to_ranges(np.array([1, 2, 3, 7, 9, 10]))
    assert [(x.offset // PAGE_SIZE, x.length // PAGE_SIZE) for x in r] == [(1, 3), (7, 1), (9, 2)]


def test_detect_accel_on_this_host(tmp_path: Path) -> None:
    info = detect_accel()
    if not info.kvm:
        assert info.linux_guests is Accel.TCG
    elif Path("/sys/module/kvm_pvm").exists():
        assert info.kvm_flavour == "pvm" and info.linux_guests is Accel.TCG
    assert detect_accel("tcg").linux_guests is Accel.TCG
    # A host whose KVM is a real vendor module runs Linux guests under KVM.
    fake_sys = tmp_path / "module"
    (fake_sys / "kvm_intel").mkdir(parents=True)
    if info.kvm:
        assert detect_accel(sys_module=fake_sys).linux_guests is Accel.KVM
        assert detect_accel("kvm").linux_guests is Accel.KVM
    # No usable /dev/kvm: TCG, and forcing kvm is an error a user can act on.
    missing = tmp_path / "no-kvm"
    assert detect_accel(kvm_device=missing).linux_guests is Accel.TCG
    try:
        detect_accel("kvm", kvm_device=missing)
    except VmmConfigError as e:
        assert "not usable" in str(e)
    else:
        raise AssertionError("expected VmmConfigError")


def test_make_driver_follows_the_host_and_the_overrides() -> None:
    from aenv_node.vmm import FirecrackerDriver, QemuDriver, make_driver

    info = detect_accel()
    choice = make_driver("auto")
    if info.linux_guests is Accel.TCG:
        assert isinstance(choice.driver, QemuDriver) and choice.accel is Accel.TCG
        try:
            make_driver("firecracker")
        except VmmConfigError as e:
            assert "KVM" in str(e)
        else:
            raise AssertionError("Firecracker cannot run Linux guests without KVM that runs them")
    if info.kvm and FirecrackerDriver().binary.is_file():
        forced = make_driver("firecracker", accel_override="kvm")
        assert isinstance(forced.driver, FirecrackerDriver) and forced.accel is Accel.KVM
    assert isinstance(make_driver("qemu", accel_override="tcg").driver, QemuDriver)
    try:
        make_driver("bhyve")
    except VmmConfigError as e:
        assert "bhyve" in str(e)
    else:
        raise AssertionError("unknown VMM kind accepted")


def test_copy_to_buffer_packs_the_dirty_pages_and_materializes_like_a_diff(tmp_path: Path) -> None:
    """The capture-buffer path: the same bytes as the diff-file path, packed in range order."""
    from aenv_node.vmm.capture_buffer import CaptureBuffer

    img = tmp_path / "image"
    write_pages(img, set(range(NPAGES)), 0x22)
    written = {1, 2, 3, 40, 62, 63}
    with open(img, "r+b") as f:
        m = mmap.mmap(f.fileno(), NPAGES * PAGE_SIZE, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    buf = CaptureBuffer(16 * PAGE_SIZE)
    try:
        for p in written:
            m[p * PAGE_SIZE : (p + 1) * PAGE_SIZE] = bytes([p]) * PAGE_SIZE
        maps = pagemap.find_mappings(os.getpid(), img)
        ranges = pagemap.dirty_ranges(os.getpid(), img)
        n = pagemap.copy_to_buffer(os.getpid(), maps, ranges, buf.address, buf.size)
        assert n == len(written) * PAGE_SIZE
        assert bytes(buf.view[:n]) == b"".join(bytes([p]) * PAGE_SIZE for p in sorted(written))
        diff = tmp_path / "diff"
        fd = os.open(diff, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, NPAGES * PAGE_SIZE)
            pagemap.copy_out(os.getpid(), maps, ranges, fd)
        finally:
            os.close(fd)
        memfile.materialize(img, [(diff, ranges)], tmp_path / "from-diff")
        memfile.materialize_packed(img, ranges, buf.view[:n], tmp_path / "from-buffer")
        assert (tmp_path / "from-buffer").read_bytes() == (tmp_path / "from-diff").read_bytes()
        small = CaptureBuffer(PAGE_SIZE)
        try:
            pagemap.copy_to_buffer(os.getpid(), maps, ranges, small.address, small.size)
        except SnapshotError as e:
            assert "do not fit" in str(e)
        else:
            raise AssertionError("expected SnapshotError: the pages do not fit")
        finally:
            small.close()
    finally:
        m.close()
        buf.close()
