"""Firecracker under its jailer (``JailerConfig``): what the jail holds, and how it is made, kept and removed.

The jailer (Firecracker's own, v1.12.1) makes ``<chroot_base>/firecracker/<id>/root``, copies the Firecracker
binary in, joins the network namespace it is given (``--netns``), pivot_roots into the chroot in a mount
namespace of its own, makes ``/dev/kvm`` and ``/dev/net/tun`` there and execs Firecracker as ``uid:gid``. It keeps
the pid (no ``--daemonize``, no ``--new-pid-ns``), so the pid file, the take-over and the per-VMM cgroup work as
they do unjailed: the shell before it joins the cgroup (``cgroup.py``), and with no ``--cgroup`` option the
jailer makes and joins none of its own.

Everything Firecracker opens must be inside the chroot before it runs (``Jail.prepare`` / ``Jail.inside``):

* files (kernel, initrd, its config, snapshot files): hard links, so a restored memory image is the same inode
  and its page cache is still shared by every VM mapping it. A file on another filesystem (a FUSE-exported disk,
  a guest kit on another disk) cannot be linked: it is bind-mounted instead, in a mount namespace the VMM's
  wrapper makes (``BindMounts``), which goes with the process: no mount is ever left on the host;
* block devices (ublk disks): a device node of the jail's own (mknod), owned by its uid; the host's node and
  its mode stay as they are;
* drives, at the paths an unjailed Firecracker sees them (``DRIVE_DIR/vdN``): a snapshot names its drives by
  path, so every restore finds its own disk there, and snapshots move between jailed and unjailed nodes;
* the API socket, at the path it has unjailed (``VmConfig.socket_path``) but inside the chroot, with a symlink
  at that path on the host: Firecracker's command line then names the sandbox or build as it does unjailed
  (the reconciler recognises a VMM by it), and the path we connect to stays short (unix socket paths are
  limited to 107 bytes; connect follows the symlink).

The jail's uid must be able to read the inputs (checked before start, the file named) and owns what it writes
(writable drives, its log and metrics). Capture files, written in the chroot, are renamed out (the destination
must be on the chroot's filesystem: a copy would lose a Diff's holes) and given back to the node's user, so no
jailed VMM can write an image that another VM maps.

A jailed Firecracker has no CAP_NET_ADMIN, so it may attach only a tap owned by its uid and gid: ``own_tap``
makes the slot's tap so before it starts.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import stat
import struct
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from ...netns import call_in_netns
from ..driver import VmConfig
from ..errors import SnapshotError, VmmConfigError, VmmStartError

__all__ = ["DEFAULT_JAILER", "DRIVE_DIR", "BindMounts", "Jail", "JailerConfig", "own_tap", "sweep_jails"]

DEFAULT_JAILER = Path("/opt/aenv/bin/jailer")
#: where Firecracker sees its drives, jailed or not (unjailed: symlinks in its own mount namespace, see
#: ``process.StableLinks``): the snapshot records these paths, so every restore finds its own disk under them
DRIVE_DIR = Path("/run/aenv-vm")
#: files the chroot keeps for a post-mortem: moved to the workdir when the jail goes
_LOGS = ("firecracker.log", "metrics.json")

# mount --bind each SRC over DST (options ro or rw), then exec the rest: run inside ``unshare --mount``
_BIND_SCRIPT = (
    'while [ "$1" != -- ]; do mount --bind -o "$1" "$2" "$3" || exit 125; shift 3; done; shift; exec "$@"'
)


@dataclass(frozen=True)
class JailerConfig:
    """Run Firecracker under ``jailer``: chroot ``<chroot_base>/firecracker/<VmConfig.name>/root``, as ``uid:gid``
    (node config ``vmm.jailer*``).

    VM names must then be unique among the node's running VMs (the name is the chroot). Capture targets must be
    on the chroot base's filesystem; inputs elsewhere are bind-mounted instead of linked (module docstring).
    """

    binary: Path = DEFAULT_JAILER
    chroot_base: Path = Path("/srv/jailer")
    uid: int = 65534
    gid: int = 65534


@dataclass(frozen=True)
class BindMounts:
    """Files bind-mounted into a chroot in the VMM's own mount namespace (``unshare --mount``, private): they
    exist for that process alone and go with it. ``binds``: (source, target, read_only)."""

    binds: tuple[tuple[Path, Path, bool], ...]

    def exec_prefix(self) -> list[str]:
        argv = ["unshare", "--mount", "--propagation", "private", "--", "/bin/sh", "-c", _BIND_SCRIPT, "sh"]
        for src, dst, read_only in self.binds:
            argv += ["ro" if read_only else "rw", str(src), str(dst)]
        return [*argv, "--"]


class Jail:
    """Where Firecracker's files are, for it and for us. Without a jailer: the host's paths, and no jail."""

    def __init__(self, config: VmConfig, jailer: JailerConfig | None, exec_name: str) -> None:
        self.config = config
        self.jailer = jailer
        self.exec_name = exec_name
        #: the path we connect to (a symlink into the chroot when jailed)
        self.api_socket = config.socket_path
        #: the path Firecracker binds: the same string, jailed or not
        self.api_socket_inside = os.path.abspath(config.socket_path)
        self.root: Path | None = None
        if jailer is not None:
            self.root = Path(os.path.abspath(jailer.chroot_base)) / exec_name / config.name / "root"
        #: the chroot is this jail's to remove: made by ``prepare``, or taken over (``adopt``); a start refused
        #: because another VM of the name runs must leave that one's chroot alone
        self.owned = False
        self._placed: dict[Path, str] = {}
        self._binds: list[tuple[Path, Path, bool]] = []

    # ---- before the start -----------------------------------------------------------------------------

    def argv(self, exec_file: Path, fc_args: list[str]) -> list[str]:
        """The jailer's command line running ``exec_file`` with ``fc_args``."""
        j = self._jailer()
        argv = [
            str(j.binary), "--id", self.config.name, "--exec-file", str(exec_file),
            "--uid", str(j.uid), "--gid", str(j.gid), "--chroot-base-dir", str(j.chroot_base),
        ]  # fmt: skip
        if self.config.netns is not None:
            argv += ["--netns", str(self.config.netns)]
        return [*argv, "--", *fc_args]

    def prepare(self) -> None:
        """Make a fresh chroot (a dead VMM's of the same name goes first) with the API socket's directory."""
        if self.root is None:
            return
        jail_dir = self.root.parent
        if os.path.lexists(jail_dir):
            if _live_in(jail_dir, self.exec_name):
                raise VmmConfigError(f"a Firecracker VM named {self.config.name!r} still runs in {jail_dir}: "
                                     "jailed VM names must be unique among running VMs")
            shutil.rmtree(jail_dir)
        self.owned = True
        self.root.mkdir(parents=True)
        j = self._jailer()
        sock_dir = self.root / Path(self.api_socket_inside).parent.relative_to("/")
        sock_dir.mkdir(parents=True, exist_ok=True)
        os.chown(sock_dir, j.uid, j.gid)
        os.chmod(sock_dir, 0o700)

    def adopt(self) -> None:
        """The jail of a VM taken over (``FirecrackerDriver.attach``): its chroot is there, and ours to remove."""
        self.owned = True

    def host_file(self, name: str) -> Path:
        """A file Firecracker writes: in the workdir, or in the chroot under the jailer."""
        return (self.root / name) if self.root is not None else self.config.workdir / name

    def own_file(self, path: Path) -> None:
        """A file Firecracker writes (its log, metrics): owned by the jail's uid."""
        if self.jailer is not None:
            os.chown(path, self.jailer.uid, self.jailer.gid)

    def inside(self, path: Path, *, writable: bool = False) -> str:
        """The path Firecracker must be given for host file ``path``; under the jailer the file is put into the
        chroot (under ``/files/<its host path>``) the first time it is asked for."""
        if self.root is None:
            return str(path)
        path = Path(os.path.abspath(path))
        if path.is_relative_to(self.root):
            return "/" + str(path.relative_to(self.root))
        if path in self._placed:
            return self._placed[path]
        real = path.resolve()
        rel = Path("files") / str(real).lstrip("/")
        self._place(real, self.root / rel, writable=writable)
        self._placed[path] = "/" + str(rel)
        return self._placed[path]

    def drive(self, index: int, source: Path, *, writable: bool) -> str:
        """The path Firecracker is given for drive ``index``: ``DRIVE_DIR/vd<index>``, jailed or not."""
        inside = DRIVE_DIR / f"vd{index}"
        if self.root is not None:
            self._place(source.resolve(), self.root / inside.relative_to("/"), writable=writable)
        return str(inside)

    def _place(self, src: Path, dst: Path, *, writable: bool) -> None:
        j = self._jailer()
        try:
            st = os.stat(src)
        except OSError as e:
            raise VmmConfigError(f"cannot put {src} into the jail: {e.strerror}") from e
        dst.parent.mkdir(parents=True, exist_ok=True)
        if stat.S_ISBLK(st.st_mode):  # a node of its own: the host's keeps its owner and mode
            os.mknod(dst, stat.S_IFBLK | (0o600 if writable else 0o400), st.st_rdev)
            os.chown(dst, j.uid, j.gid)
            return
        if not stat.S_ISREG(st.st_mode):
            raise VmmConfigError(f"{src} is neither a regular file nor a block device: Firecracker cannot use it")
        if writable and not _may(st, j, stat.S_IWUSR, stat.S_IWGRP, stat.S_IWOTH):
            try:
                os.chown(src, j.uid, j.gid)
            except OSError as e:
                raise VmmConfigError(f"the jail's uid {j.uid} must own {src}, which Firecracker writes, and it "
                                     f"cannot be chowned ({e.strerror})") from e
        elif not _may(st, j, stat.S_IRUSR, stat.S_IRGRP, stat.S_IROTH):
            raise VmmConfigError(f"{src} is not readable by the jail's uid {j.uid} / gid {j.gid} "
                                 f"(owner {st.st_uid}:{st.st_gid}, mode {stat.S_IMODE(st.st_mode):o})")
        try:
            os.link(src, dst)
        except OSError as e:
            if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
                raise VmmConfigError(f"cannot hard-link {src} into the jail {self.root}: {e.strerror}") from e
            dst.touch()  # the mount point of a bind mount, made in the VMM's own mount namespace
            self._binds.append((src, dst, not writable))

    def bind_mounts(self) -> BindMounts | None:
        """What must be bind-mounted (files ``_place`` could not link), or None."""
        return BindMounts(tuple(self._binds)) if self._binds else None

    def link_socket(self) -> None:
        """The host's path to the API socket: a symlink to where Firecracker binds it in the chroot."""
        if self.root is None:
            return
        target = self.root / self.api_socket_inside.lstrip("/")
        self.api_socket.parent.mkdir(parents=True, exist_ok=True)
        self.api_socket.unlink(missing_ok=True)
        os.symlink(target, self.api_socket)

    # ---- while it runs --------------------------------------------------------------------------------

    def check_capture_target(self, *targets: Path) -> None:
        """Capture files are renamed out of the chroot: their directory must be on its filesystem."""
        if self.root is None:
            return
        dev = os.stat(self.root).st_dev
        for t in targets:
            if os.stat(t.parent).st_dev != dev:
                raise SnapshotError(f"{t} is not on the filesystem of the jailer's chroot base "
                                    f"{self._jailer().chroot_base}: a jailed capture is renamed out of the chroot")

    def take_out(self, src: Path, dst: Path) -> None:
        """Move a capture file Firecracker wrote in the chroot to ``dst``, owned by us again, and readable (not
        writable) by the jailed VMMs that will restore it, whatever their umask made of it."""
        os.replace(src, dst)
        os.chown(dst, os.geteuid(), os.getegid())
        os.chmod(dst, 0o644)

    # ---- after ----------------------------------------------------------------------------------------

    def cleanup(self) -> None:
        """Remove the jail (its VMM is gone), keeping Firecracker's log and metrics in the workdir."""
        if self.root is None or not self.owned:
            return
        for name in _LOGS:
            try:
                shutil.move(self.root / name, self.config.workdir / name)
            except OSError:
                pass
        shutil.rmtree(self.root.parent, ignore_errors=True)
        try:
            if os.readlink(self.api_socket).startswith(str(self.root)):
                self.api_socket.unlink()
        except OSError:
            pass

    def _jailer(self) -> JailerConfig:
        if self.jailer is None:
            raise AssertionError("not a jailed VM")
        return self.jailer


def _may(st: os.stat_result, j: JailerConfig, user: int, group: int, other: int) -> bool:
    """Whether the jail's uid/gid (and no supplementary group: the jailer drops them) has the access bit."""
    if st.st_uid == j.uid:
        return bool(st.st_mode & user)
    if st.st_gid == j.gid:
        return bool(st.st_mode & group)
    return bool(st.st_mode & other)


def _live_exes() -> set[tuple[int, int]]:
    """(device, inode) of every running process's executable."""
    out = set()
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                st = os.stat(f"/proc/{d}/exe")
            except OSError:  # gone, a zombie, or a kernel thread
                continue
            out.add((st.st_dev, st.st_ino))
    return out


def _live_in(jail_dir: Path, exec_name: str, live: set[tuple[int, int]] | None = None) -> bool:
    """Whether a process runs the Firecracker copy the jailer put into ``jail_dir``."""
    try:
        st = os.stat(jail_dir / "root" / exec_name)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) in (_live_exes() if live is None else live)


def sweep_jails(chroot_base: Path, exec_name: str, keep: Collection[str] = ()) -> list[str]:
    """Remove the chroots under ``chroot_base`` whose VMM is gone (a node killed hard, a data plane stopped with
    its VMMs), except those named in ``keep`` (VMs being started or held); their names."""
    base = chroot_base / exec_name
    try:
        names = sorted(p.name for p in base.iterdir() if p.is_dir())
    except FileNotFoundError:
        return []
    live = _live_exes()
    gone = []
    for name in names:
        if name in keep or _live_in(base / name, exec_name, live):
            continue
        shutil.rmtree(base / name, ignore_errors=True)
        gone.append(name)
    return gone


# ---- the tap ------------------------------------------------------------------------------------------

_TUNSETIFF = 0x400454CA
_TUNSETOWNER = 0x400454CC
_TUNSETGROUP = 0x400454CE
_IFF_TAP = 0x0002
_IFF_NO_PI = 0x1000


def _open_tun_in(netns: Path | None) -> int:
    """/dev/net/tun opened in ``netns``: a tun file belongs to the namespace it was opened in (``netns.py``)."""
    if netns is None:
        return os.open("/dev/net/tun", os.O_RDWR | os.O_CLOEXEC)
    return call_in_netns(netns, lambda: os.open("/dev/net/tun", os.O_RDWR | os.O_CLOEXEC), name="aenv-own-tap")


def own_tap(netns: Path | None, tap: str, uid: int, gid: int) -> None:
    """Make the (persistent) tap device ``tap`` in ``netns`` attachable by ``uid``/``gid`` without CAP_NET_ADMIN.
    Blocking: run it in a thread. Only while no process holds the tap (it is attached for a moment)."""
    try:
        fd = _open_tun_in(netns)
    except OSError as e:
        raise VmmStartError(f"cannot open /dev/net/tun in {netns}: {e}") from e
    try:
        fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH22x", tap.encode(), _IFF_TAP | _IFF_NO_PI))
        fcntl.ioctl(fd, _TUNSETOWNER, uid)
        fcntl.ioctl(fd, _TUNSETGROUP, gid)
    except OSError as e:
        raise VmmStartError(f"cannot hand tap {tap} in {netns} to uid {uid} / gid {gid}: {e.strerror}") from e
    finally:
        os.close(fd)
