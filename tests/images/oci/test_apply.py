"""Applying OCI layer tars onto a directory (aenv_node.images.oci.apply), as root, in temporary directories.

Hand-written tars cover each entry type and the whiteout rules; hostile tars must not change anything outside
the root (a sentinel directory next to it is compared, ctimes included, before and after); a small umoci image
(two repacks and a hand-made layer added verbatim) is applied layer by layer and compared entry by entry with
what ``umoci unpack`` makes of it; the ``python -m`` entry point is run in a subprocess.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import stat
import struct
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from aenv_node.images.oci.apply import ApplyStats, LayerApplyError, apply_layer, apply_layer_in_subprocess

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="applies owners, devices and security xattrs: needs root")

REPO = Path(__file__).resolve().parents[3]
MTIME = 1_600_000_000
# a VFS_CAP_REVISION_2 capability set: cap_net_bind_service permitted and effective
CAPS = struct.pack("<IIIII", 0x02000001, 1 << 10, 0, 0, 0)


class Layer:
    """A layer tar written with Python's tarfile (PAX by default)."""

    def __init__(self, fmt: int = tarfile.PAX_FORMAT) -> None:
        self._buf = io.BytesIO()
        self._tf = tarfile.open(fileobj=self._buf, mode="w", format=fmt, encoding="utf-8", errors="surrogateescape")

    def add(
        self,
        name: str,
        kind: bytes = tarfile.REGTYPE,
        *,
        data: bytes = b"",
        mode: int = 0o644,
        uid: int = 0,
        gid: int = 0,
        mtime: int = MTIME,
        linkname: str = "",
        dev: tuple[int, int] = (0, 0),
        xattrs: dict[str, bytes] | None = None,
        pax: dict[str, str] | None = None,
    ) -> Layer:
        ti = tarfile.TarInfo(name)
        ti.type, ti.mode, ti.uid, ti.gid, ti.mtime, ti.linkname = kind, mode, uid, gid, mtime, linkname
        ti.devmajor, ti.devminor = dev
        headers = dict(pax or {})
        for k, v in (xattrs or {}).items():
            headers["SCHILY.xattr." + k] = v.decode("utf-8", "surrogateescape")
        ti.pax_headers = headers
        if kind == tarfile.REGTYPE:
            ti.size = len(data)
            self._tf.addfile(ti, io.BytesIO(data))
        else:
            self._tf.addfile(ti)
        return self

    def dir(self, name: str, mode: int = 0o755, **kw: Any) -> Layer:
        return self.add(name, tarfile.DIRTYPE, mode=mode, **kw)

    def file(self, name: str, data: bytes = b"", **kw: Any) -> Layer:
        return self.add(name, data=data, **kw)

    def symlink(self, name: str, target: str, **kw: Any) -> Layer:
        return self.add(name, tarfile.SYMTYPE, linkname=target, mode=0o777, **kw)

    def link(self, name: str, target: str) -> Layer:
        return self.add(name, tarfile.LNKTYPE, linkname=target)

    def whiteout(self, name: str) -> Layer:
        return self.add(name, mode=0, mtime=0)

    def bytes(self) -> bytes:
        self._tf.close()
        return self._buf.getvalue()


@pytest.fixture
def work() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="aenv-apply-test-"))
    try:
        yield d
    finally:
        shutil.rmtree(d)


@pytest.fixture
def root(work: Path) -> Path:
    r = work / "root"
    r.mkdir()
    return r


def apply(root: Path, layer: Layer | bytes) -> ApplyStats:
    return apply_layer(io.BytesIO(layer if isinstance(layer, bytes) else layer.bytes()), root)


def _xattrs(p: bytes) -> list[tuple[str, bytes]]:
    return sorted((n, os.getxattr(p, n, follow_symlinks=False)) for n in os.listxattr(p, follow_symlinks=False))


def tree(top: Path, *, dir_mtimes: bool = False, ctimes: bool = False) -> dict[bytes, dict[str, Any]]:
    """Every entry under ``top`` (``top`` itself as b"."), never following symlinks: type, mode, owner, size,
    content hash, symlink target, device numbers, xattrs, hard-link group, mtime (of directories on request)."""
    out: dict[bytes, dict[str, Any]] = {}
    inodes: dict[int, list[bytes]] = {}
    topb = os.fsencode(top)
    paths = [topb]
    for dirpath, dirnames, filenames in os.walk(topb):
        paths += [os.path.join(dirpath, n) for n in dirnames + filenames]
    for p in paths:
        rel = os.path.relpath(p, topb)
        st = os.lstat(p)
        e: dict[str, Any] = {
            "type": stat.S_IFMT(st.st_mode),
            "mode": oct(stat.S_IMODE(st.st_mode)),
            "owner": (st.st_uid, st.st_gid),
            "xattrs": _xattrs(p),
        }
        if stat.S_ISREG(st.st_mode):
            e["size"] = st.st_size
            e["sha256"] = hashlib.sha256(Path(os.fsdecode(p)).read_bytes()).hexdigest()
            inodes.setdefault(st.st_ino, []).append(rel)
        if stat.S_ISLNK(st.st_mode):
            e["target"] = os.readlink(p)
        if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
            e["rdev"] = (os.major(st.st_rdev), os.minor(st.st_rdev))
        if dir_mtimes or not stat.S_ISDIR(st.st_mode):
            e["mtime_ns"] = st.st_mtime_ns
        if ctimes:
            e["ctime_ns"] = st.st_ctime_ns
        out[rel] = e
    for group in inodes.values():
        for rel in group:
            out[rel]["links"] = sorted(group)
    return out


# --- entry types --------------------------------------------------------------------------------------------


def test_files_dirs_symlinks_hardlinks(root: Path) -> None:
    apply(root, Layer().dir("lower").file("lower/base", b"lower data", mode=0o640, uid=7, gid=8))
    stats = apply(
        root,
        Layer()
        .dir("etc", mode=0o750, uid=3, gid=4)
        .file("etc/conf", b"hello\n" * 1000, mode=0o600, uid=1000, gid=1001, pax={"mtime": "1600000000.123456789"})
        .symlink("etc/abs", "/nonexistent/../x")  # verbatim, dangling, never followed
        .symlink("etc/rel", "conf")
        .link("etc/conf2", "etc/conf")  # to this layer
        .link("lowerlink", "/lower/base")  # to a lower layer (a leading '/' is confined like member names)
        .link("etc/abs-link", "etc/abs"),  # to a symlink: links the symlink itself
    )
    assert stats == ApplyStats(
        entries=7, files=1, directories=1, symlinks=2, hardlinks=3, bytes_written=6000, devices=0, whiteouts=0
    )
    st = os.stat(root / "etc/conf")
    assert (root / "etc/conf").read_bytes() == b"hello\n" * 1000
    assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, st.st_mtime_ns) == (0o600, 1000, 1001, 1600000000123456789)
    d = os.stat(root / "etc")
    assert (stat.S_IMODE(d.st_mode), d.st_uid, d.st_gid, d.st_mtime_ns) == (0o750, 3, 4, MTIME * 10**9)
    assert os.readlink(root / "etc/abs") == "/nonexistent/../x"
    assert os.lstat(root / "etc/abs").st_mtime_ns == MTIME * 10**9
    assert os.readlink(root / "etc/rel") == "conf"
    assert os.stat(root / "etc/conf2").st_ino == st.st_ino and st.st_nlink == 2
    assert os.stat(root / "lowerlink").st_ino == os.stat(root / "lower/base").st_ino
    assert os.lstat(root / "etc/abs-link").st_ino == os.lstat(root / "etc/abs").st_ino


FORMATS = pytest.mark.parametrize("fmt", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT], ids=["pax", "gnu"])


@FORMATS
def test_devices_and_fifo(root: Path, fmt: int) -> None:
    stats = apply(
        root,
        Layer(fmt)
        .add("dev/null", tarfile.CHRTYPE, dev=(1, 3), mode=0o666)
        .add("dev/loop9", tarfile.BLKTYPE, dev=(7, 9), mode=0o660, gid=6)
        .add("run/fifo", tarfile.FIFOTYPE, mode=0o620, uid=5),
    )
    assert stats.devices == 3
    t = tree(root)
    assert (t[b"dev/null"]["type"], t[b"dev/null"]["rdev"], t[b"dev/null"]["mode"]) == (stat.S_IFCHR, (1, 3), "0o666")
    assert t[b"dev/null"]["mtime_ns"] == MTIME * 10**9
    loop = t[b"dev/loop9"]
    assert (loop["type"], loop["rdev"], loop["owner"]) == (stat.S_IFBLK, (7, 9), (0, 6))
    assert (t[b"run/fifo"]["type"], t[b"run/fifo"]["mode"], t[b"run/fifo"]["owner"]) == (stat.S_IFIFO, "0o620", (5, 0))
    assert t[b"dev"]["mode"] == "0o755"  # an implicit parent


def test_setuid_setgid_sticky_with_non_root_owner(root: Path) -> None:
    apply(
        root,
        Layer()
        .file("bin/su", b"\x7fELF", mode=0o4755, uid=1000, gid=1000, xattrs={"security.capability": CAPS})
        .file("bin/wall", b"x", mode=0o2755, uid=0, gid=5)
        .dir("tmp", mode=0o1777, uid=1000, gid=1000)
        .dir("shared", mode=0o3775, uid=1000, gid=1000),
    )
    t = tree(root)
    assert (t[b"bin/su"]["mode"], t[b"bin/su"]["owner"]) == ("0o4755", (1000, 1000))
    assert t[b"bin/su"]["xattrs"] == [("security.capability", CAPS)]  # survives the chown and the chmod
    assert (t[b"bin/wall"]["mode"], t[b"bin/wall"]["owner"]) == ("0o2755", (0, 5))
    assert (t[b"tmp"]["mode"], t[b"tmp"]["owner"]) == ("0o1777", (1000, 1000))
    assert t[b"shared"]["mode"] == "0o3775"


def test_xattrs(root: Path) -> None:
    binary = bytes(range(256))
    stats = apply(
        root,
        Layer()
        .dir("d", xattrs={"user.dir": b"1"})
        .file("d/f", b"data", xattrs={"user.foo": b"bar", "user.bin": binary, "security.capability": CAPS})
        .symlink("d/s", "f", xattrs={"user.nope": b"x", "trusted.t": b"on-symlink"})
        .add("d/p", tarfile.FIFOTYPE, xattrs={"trusted.fifo": b"y"}),
    )
    t = tree(root)
    assert t[b"d"]["xattrs"] == [("user.dir", b"1")]
    assert t[b"d/f"]["xattrs"] == sorted([("user.foo", b"bar"), ("user.bin", binary), ("security.capability", CAPS)])
    assert t[b"d/s"]["xattrs"] == [("trusted.t", b"on-symlink")]  # user.* is not allowed on symlinks: skipped
    assert t[b"d/p"]["xattrs"] == [("trusted.fifo", b"y")]
    assert stats.xattrs == 6
    # a directory entry over an existing directory replaces its xattrs
    apply(root, Layer().dir("d", xattrs={"user.other": b"2"}))
    assert tree(root)[b"d"]["xattrs"] == [("user.other", b"2")]


@FORMATS
def test_long_and_non_utf8_names(root: Path, fmt: int) -> None:
    long_path = "/".join(["d" * 99, "e" * 99, "f" * 100])  # 300 characters
    target = "../" + "t" * 197  # 200 characters
    raw = b"caf\xe9-\xff.bin"  # not UTF-8
    name = raw.decode("utf-8", "surrogateescape")
    apply(
        root,
        Layer(fmt)
        .file(long_path, b"long")
        .symlink("s" * 150, target)
        .file("héllo/日本語.txt", b"utf8")
        .file(name, b"raw")
        .link("hl-" + "h" * 200, long_path),
    )
    assert len(long_path) == 300 and len(target) == 200
    assert (root / long_path).read_bytes() == b"long"
    assert os.readlink(root / ("s" * 150)) == target
    assert (root / "héllo" / "日本語.txt").read_bytes() == b"utf8"
    assert raw in os.listdir(os.fsencode(root))
    assert "héllo".encode() in os.listdir(os.fsencode(root))
    assert os.stat(root / ("hl-" + "h" * 200)).st_ino == os.stat(root / long_path).st_ino


# --- whiteouts ----------------------------------------------------------------------------------------------


def _lower(root: Path) -> None:
    apply(
        root,
        Layer()
        .dir("a")
        .file("a/gone")
        .file("a/kept")
        .dir("a/tree")
        .dir("a/tree/deep")
        .file("a/tree/deep/f")
        .symlink("a/tree/s", "/")
        .dir("opq")
        .file("opq/lower1")
        .dir("opq/lowerdir")
        .file("opq/lowerdir/x")
        .dir("opq/both")
        .file("opq/both/lower"),
    )


def test_whiteouts_of_a_file_and_a_tree(root: Path) -> None:
    _lower(root)
    stats = apply(root, Layer().whiteout("a/.wh.gone").whiteout("a/.wh.tree").whiteout("a/.wh.missing"))
    assert stats.whiteouts == 3
    assert sorted(os.listdir(root / "a")) == ["kept"]


@FORMATS
@pytest.mark.parametrize("marker_at", [0, 2, 5], ids=["first", "middle", "last"])
def test_opaque_keeps_this_layers_entries_wherever_the_marker_is(root: Path, marker_at: int, fmt: int) -> None:
    _lower(root)
    entries: list[tuple[str, ...]] = [
        ("dir", "opq"),
        ("file", "opq/new1"),
        ("file", "opq/both/upper"),  # 'both' came from below: only this layer's child stays in it
        ("dir", "opq/newdir"),
        ("file", "opq/newdir/f"),
    ]
    entries.insert(marker_at, ("whiteout", "opq/.wh..wh..opq"))
    layer = Layer(fmt)
    for kind, name in entries:
        getattr(layer, kind)(name)
    apply(root, layer)
    assert sorted(os.listdir(root / "opq")) == ["both", "new1", "newdir"]
    assert os.listdir(root / "opq/both") == ["upper"]
    assert os.listdir(root / "opq/newdir") == ["f"]
    assert sorted(os.listdir(root / "a")) == ["gone", "kept", "tree"]  # elsewhere untouched


def test_whiteout_does_not_hide_its_own_layer(root: Path) -> None:
    _lower(root)
    apply(root, Layer().file("a/new").whiteout("a/.wh.new").file("a/tree/deep/g").whiteout("a/.wh.tree"))
    assert (root / "a/new").exists()
    # the whited-out directory keeps only what this layer put in it
    left = [p.relative_to(root / "a/tree").as_posix() for p in sorted((root / "a/tree").rglob("*"))]
    assert left == ["deep", "deep/g"]


# --- replacing ----------------------------------------------------------------------------------------------


def test_replacements(root: Path, work: Path) -> None:
    outside = work / "outside"
    outside.mkdir()
    apply(
        root,
        Layer()
        .dir("was-dir")
        .dir("was-dir/sub")
        .file("was-dir/sub/f")
        .file("was-file", b"old")
        .symlink("was-symlink", str(outside))
        .symlink("file-over-symlink", str(outside / "target"))
        .dir("kept", mode=0o700)
        .file("kept/child", b"c")
        .file("shared", b"v1")
        .link("other-name", "shared"),
    )
    apply(
        root,
        Layer()
        .file("was-dir", b"now a file")
        .dir("was-file", mode=0o711)
        .dir("was-symlink", mode=0o777, uid=1234)
        .file("file-over-symlink", b"mine")
        .dir("kept", mode=0o755, uid=9)
        .file("shared", b"v2"),
    )
    assert (root / "was-dir").read_bytes() == b"now a file"
    assert (root / "was-file").is_dir() and not (root / "was-file").is_symlink()
    assert (root / "was-symlink").is_dir() and not (root / "was-symlink").is_symlink()
    assert (root / "file-over-symlink").read_bytes() == b"mine" and not (outside / "target").exists()
    assert (stat.S_IMODE(outside.stat().st_mode), outside.stat().st_uid) == (0o755, 0)
    assert (root / "kept/child").read_bytes() == b"c"
    assert (stat.S_IMODE((root / "kept").stat().st_mode), (root / "kept").stat().st_uid) == (0o755, 9)
    # a replaced file is unlinked, not rewritten: the other hard link keeps the old content
    assert (root / "shared").read_bytes() == b"v2" and (root / "other-name").read_bytes() == b"v1"


def test_directory_mtimes_are_set_last(root: Path) -> None:
    apply(
        root,
        Layer()
        .dir("a", pax={"mtime": "1500000000.5"})
        .dir("a/b", mtime=1_400_000_000)
        .file("a/b/f")
        .file("a/g")
        .add(".", tarfile.DIRTYPE, mode=0o755, mtime=1_300_000_000),
    )
    assert os.stat(root / "a").st_mtime_ns == 1_500_000_000_500_000_000
    assert os.stat(root / "a/b").st_mtime_ns == 1_400_000_000 * 10**9
    assert os.stat(root).st_mtime_ns == 1_300_000_000 * 10**9


def test_symlinked_parent_resolves_inside_the_root(root: Path) -> None:
    apply(root, Layer().dir("usr").dir("usr/bin").symlink("bin", "usr/bin").symlink("lib", "/usr/lib"))
    apply(root, Layer().file("bin/tool", b"t").file("lib/libx.so", b"l"))
    assert (root / "usr/bin/tool").read_bytes() == b"t"
    assert (root / "usr/lib/libx.so").read_bytes() == b"l"  # the missing target directory is created
    assert os.readlink(root / "bin") == "usr/bin"


# --- malformed streams --------------------------------------------------------------------------------------


def test_malformed_streams(root: Path) -> None:
    good = Layer().file("a", b"x" * 5000).file("b", b"y").bytes()
    with pytest.raises(LayerApplyError, match="not a tar"):
        apply(root, b"")
    with pytest.raises(LayerApplyError, match="not a tar"):
        apply(root, b"garbage" * 200)
    with pytest.raises(LayerApplyError, match="'a'"):
        apply(root, good[:3000])  # cut inside a's data
    with pytest.raises(LayerApplyError, match="truncated"):
        apply(root, good[: 512 * 11 + 100])  # cut inside b's header
    with pytest.raises(LayerApplyError, match="invalid header"):
        apply(root, good[: 512 * 11] + b"\x01" * 512 + bytes(1024))  # a corrupt header after 'a'
    with pytest.raises(LayerApplyError, match="unsupported tar type"):
        apply(root, Layer().add("vol", b"V"))
    assert apply(root, bytes(10240)).entries == 0  # an empty layer
    assert apply(root, good[: 512 * 13]).files == 2  # no end-of-archive blocks: accepted
    stream = io.BytesIO(good + bytes(100_000))
    apply_layer(stream, root)
    assert stream.read() == b""  # read to its end (a hashing caller sees every byte)


# --- hostile layers -----------------------------------------------------------------------------------------


@pytest.fixture
def sentinel(work: Path) -> Iterator[Path]:
    s = work / "sentinel"
    (s / "dir").mkdir(parents=True)
    (s / "f").write_bytes(b"sentinel")
    (s / "dir/g").write_bytes(b"g")
    os.symlink("f", s / "link")
    before = tree(s, dir_mtimes=True, ctimes=True)
    passwd = os.stat("/etc/passwd")
    yield s
    assert tree(s, dir_mtimes=True, ctimes=True) == before
    after = os.stat("/etc/passwd")
    assert (after.st_nlink, after.st_ctime_ns) == (passwd.st_nlink, passwd.st_ctime_ns)
    assert sorted(os.listdir(work)) == ["root", "sentinel"]


@pytest.mark.parametrize(
    "layer, message",
    [
        (Layer().file("../x"), "escapes the root"),
        (Layer().file("a/../../x"), "escapes the root"),
        (Layer().file("../sentinel/f", b"pwned"), "escapes the root"),
        (Layer().dir("../sentinel", mode=0o777), "escapes the root"),
        (Layer().link("x", "../../x"), "escapes the root"),
        (Layer().link("x", "/etc/passwd"), "does not exist"),
        (Layer().symlink("esc", "/").link("x", "esc/etc/passwd"), "does not exist"),
        (Layer().symlink("loop", "loop").file("loop/x"), "too many levels"),
        (Layer().file("f").file("f/x"), "not a directory"),
        (Layer().whiteout("a/.wh.."), "not a valid whiteout"),
    ],
    ids=["dotdot", "a-dotdot-dotdot", "dotdot-sentinel", "dotdot-dir", "link-dotdot", "link-etc-passwd",
         "link-via-symlink", "symlink-loop", "file-as-parent", "whiteout-dotdot"],
)
def test_hostile_entries_are_rejected(root: Path, sentinel: Path, layer: Layer, message: str) -> None:
    with pytest.raises(LayerApplyError, match=message):
        apply(root, layer)


def test_hostile_paths_are_confined(root: Path, sentinel: Path) -> None:
    s = str(sentinel)  # an absolute path that exists outside the root
    # a symlink already in the tree, pointing outside
    apply(root, Layer().symlink("lower-esc", s).symlink("lower-up", "../../../../.."))
    stats = apply(
        root,
        Layer()
        .file("/abs", b"abs")
        .file("lower-esc/f", b"pwned")
        .file("lower-up/sentinel/f", b"pwned")
        .symlink("root-link", "/")  # created earlier in this same layer
        .file("root-link/sentinel/dir/g", b"pwned")
        .symlink("up", "../..")
        .dir("up/sentinel", mode=0o777, uid=1234)
        .add("up/sentinel/node", tarfile.FIFOTYPE)
        .link("lower-esc/hl", "abs")
        .whiteout("lower-esc/.wh.link")
        .whiteout("lower-up/sentinel/dir/.wh..wh..opq")
        .symlink(s[1:] + "/link", "/etc/shadow")
        .file("root-link" + s + "/new", b"new")
        .file("link-to-outside-file", b"x")  # replaced below: the file outside stays as it is
        .symlink("link-to-outside-file", s + "/f")
        .file("link-to-outside-file", b"pwned"),
    )
    assert stats.entries == 16
    assert (root / "abs").read_bytes() == b"abs"
    inner = root / s.lstrip("/")  # where the absolute symlink lands, resolved inside the root
    assert (inner / "f").read_bytes() == b"pwned"
    assert os.stat(inner / "hl").st_ino == os.stat(root / "abs").st_ino
    assert os.readlink(inner / "link") == "/etc/shadow"
    assert (inner / "new").read_bytes() == b"new"
    assert (root / "sentinel/f").read_bytes() == b"pwned"
    assert (root / "sentinel/dir/g").read_bytes() == b"pwned"  # kept: it is this layer's
    assert stat.S_IMODE(os.stat(root / "sentinel").st_mode) == 0o777
    assert stat.S_ISFIFO(os.lstat(root / "sentinel/node").st_mode)
    assert (root / "link-to-outside-file").read_bytes() == b"pwned"


# --- against umoci ------------------------------------------------------------------------------------------


def _umoci(*args: str | Path, cwd: Path) -> None:
    subprocess.run(["umoci", *map(str, args)], cwd=cwd, check=True, capture_output=True)


def _layer_blobs(layout: Path, tag: str) -> list[Path]:
    index = json.loads((layout / "index.json").read_text())
    (desc,) = [m for m in index["manifests"] if m["annotations"]["org.opencontainers.image.ref.name"] == tag]
    manifest = json.loads((layout / "blobs/sha256" / desc["digest"].split(":")[1]).read_text())
    return [layout / "blobs/sha256" / layer["digest"].split(":")[1] for layer in manifest["layers"]]


@pytest.mark.skipif(shutil.which("umoci") is None, reason="umoci is not installed")
def test_same_tree_as_umoci_unpack(work: Path) -> None:
    _umoci("init", "--layout", "L", cwd=work)
    _umoci("new", "--image", "L:t", cwd=work)
    _umoci("unpack", "--image", "L:t", "b", cwd=work)
    r = work / "b/rootfs"
    # layer 1: every entry type
    for d in ("etc", "usr/bin", "usr/lib", "opt/tree/deep", "opq/sub", "tmp", "home/user"):
        (r / d).mkdir(parents=True, exist_ok=True)
    (r / "etc/hosts").write_text("127.0.0.1 localhost\n")
    (r / "usr/bin/tool").write_bytes(os.urandom(70_000))
    os.chmod(r / "usr/bin/tool", 0o755)
    (r / "usr/bin/su").write_bytes(b"su")
    os.chown(r / "usr/bin/su", 1000, 1000)
    os.chmod(r / "usr/bin/su", 0o4755)
    os.setxattr(r / "usr/bin/su", "security.capability", CAPS)
    (r / "usr/bin/wall").write_bytes(b"wall")
    os.chown(r / "usr/bin/wall", 0, 5)
    os.chmod(r / "usr/bin/wall", 0o2755)
    os.chmod(r / "tmp", 0o1777)
    os.chown(r / "home/user", 1000, 1000)
    (r / "home/user/.profile").write_text("x")
    os.chown(r / "home/user/.profile", 1000, 1000)
    os.setxattr(r / "etc/hosts", "user.foo", b"bar")
    os.setxattr(r / "opt", "user.dir", b"1")
    os.symlink("usr/bin", r / "bin")
    os.symlink("/usr/lib", r / "lib")
    os.symlink("../hosts-" + "x" * 190, r / "etc/long-link")
    os.link(r / "usr/bin/tool", r / "usr/bin/tool-alias")
    os.mknod(r / "etc/null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
    os.mknod(r / "etc/loop", stat.S_IFBLK | 0o660, os.makedev(7, 0))
    os.mkfifo(r / "etc/fifo", 0o600)
    (r / "opt/tree/deep/f").write_text("f")
    (r / "opt/gone").write_text("g")
    (r / "opq/a").write_text("a")
    (r / "opq/sub/b").write_text("b")
    (r / "héllo-日本").write_text("utf8")
    (r / os.fsdecode(b"caf\xe9")).write_text("latin1")
    (r / "/".join(["d" * 90, "e" * 90, "f" * 90])).parent.mkdir(parents=True)
    (r / "/".join(["d" * 90, "e" * 90, "f" * 90])).write_text("long")
    _umoci("repack", "--refresh-bundle", "--image", "L:t", "b", cwd=work)
    # layer 2: deletions (whiteouts), replacements, metadata changes
    (r / "opt/gone").unlink()
    shutil.rmtree(r / "opt/tree")
    (r / "opt/tree").write_text("a file where a directory was")
    os.removexattr(r / "opt", "user.dir")
    os.chmod(r / "etc", 0o700)
    (r / "etc/hosts").unlink()
    (r / "etc/hosts").write_text("replaced\n")
    (r / "usr/bin/tool-alias").unlink()
    _umoci("repack", "--refresh-bundle", "--image", "L:t", "b", cwd=work)
    # layer 3, written by hand and added verbatim: an opaque directory (entries before and after the marker),
    # a hard link to a lower file, a file through a symlinked parent, a directory replacing a symlink
    (work / "l3.tar").write_bytes(
        Layer()
        .dir("opq", mode=0o750)
        .file("opq/before", b"before")
        .whiteout("opq/.wh..wh..opq")
        .file("opq/after", b"after")
        .link("hard-to-lower", "usr/bin/tool")
        .file("bin/via-symlink", b"v")
        .dir("lib", mode=0o755)
        .whiteout("home/user/.wh..profile")
        .bytes()
    )
    _umoci("raw", "add-layer", "--image", "L:t", work / "l3.tar", cwd=work)
    _umoci("unpack", "--image", "L:t", "expected", cwd=work)

    mine = work / "mine"
    mine.mkdir()
    blobs = _layer_blobs(work / "L", "t")
    assert len(blobs) == 3
    totals = ApplyStats()
    for blob in blobs:
        with gzip.open(blob) as g:
            stats = apply_layer(g, mine)
        for k, v in vars(stats).items():
            setattr(totals, k, getattr(totals, k) + v)
    assert totals.whiteouts >= 5 and totals.hardlinks >= 2 and totals.devices == 3

    expected, got = tree(work / "expected/rootfs"), tree(mine)
    assert sorted(got) == sorted(expected)
    for path in expected:
        assert got[path] == expected[path], path
    assert got[b"opq"]["mode"] == "0o750" and sorted(os.listdir(mine / "opq")) == ["after", "before"]


# --- the subprocess entry point -----------------------------------------------------------------------------


def _run(root: Path, data: bytes, *args: str) -> subprocess.CompletedProcess[bytes]:
    cmd = [sys.executable, "-m", "aenv_node.images.oci.apply", *(args or (str(root),))]
    return subprocess.run(cmd, input=data, capture_output=True, cwd=REPO, timeout=60)


def test_main_applies_stdin_and_prints_stats(root: Path) -> None:
    proc = _run(root, Layer().dir("d").file("d/f", b"abc").symlink("s", "d/f").bytes())
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == b""
    stats = json.loads(proc.stdout)
    assert stats == vars(ApplyStats(entries=3, files=1, directories=1, symlinks=1, bytes_written=3))
    assert (root / "d/f").read_bytes() == b"abc" and os.readlink(root / "s") == "d/f"


def test_main_errors_are_one_line(root: Path) -> None:
    for data in (b"not a tar at all" * 100, Layer().file("../escape").bytes()):
        proc = _run(root, data)
        assert proc.returncode == 1 and proc.stdout == b""
        lines = proc.stderr.decode().splitlines()
        assert len(lines) == 1 and lines[0].startswith("apply layer: "), proc.stderr
    assert _run(root, b"", "--help").returncode == 2
    assert os.listdir(root) == []


async def test_apply_layer_in_subprocess(root: Path, work: Path) -> None:
    tar = work / "layer.tar"
    tar.write_bytes(Layer().file("x", b"1234").bytes())
    stats = await apply_layer_in_subprocess(tar, root)
    assert (stats.files, stats.bytes_written, (root / "x").read_bytes()) == (1, 4, b"1234")
    tar.write_bytes(Layer().link("y", "missing").bytes())
    with open(tar, "rb") as f, pytest.raises(LayerApplyError, match="apply layer: .*'y'.*does not exist"):
        await apply_layer_in_subprocess(f, root)
