"""The guest kit's build: the steps that turn Debian packages into ``vmlinuz``/``vmlinux``, the initramfs and
the read-only tools drive, in a staging directory.

Why apart from :mod:`.kit`: this is the slow, tool-driven part (apt, dpkg-deb, pip, mkfs.ext4, the bundled
Python run through its own loader), and it knows nothing about where kits are kept or when one is rebuilt;
:func:`.kit.ensure_kit` decides that and calls :func:`build_kit` in a fresh directory.  Every module of this
package is part of the kit's content hash, so a change here rebuilds the kit.
"""

from __future__ import annotations

import io
import lzma
import os
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

from . import bzimage, debs, elf
from .cmdline import kernel_cmdline
from .cpio import CharDevice, write_newc
from .errors import KitBuildError, ToolMissingError
from .kit_spec import KIT_FORMAT, KitSpec

__all__ = ["Progress", "build_kit"]

Progress = Callable[[str], None]

_DATA_DIR = Path(__file__).resolve().parent / "data"


class _Step:
    """A timed build step: ``with step("name"):`` says when it starts and ends and records its duration."""

    def __init__(self, say: Progress, timings: dict[str, float]) -> None:
        self.say, self.timings = say, timings

    def __call__(self, name: str) -> _Step:
        self.name = name
        return self

    def __enter__(self) -> None:
        self.t0 = time.monotonic()
        self.say(f"{self.name} ...")

    def __exit__(self, exc_type, exc, tb) -> None:
        dt = time.monotonic() - self.t0
        self.timings[self.name] = round(dt, 3)
        if exc_type is None:
            self.say(f"{self.name}: done in {dt:.1f} s")


def build_kit(
    spec: KitSpec, kernel_pkg: str, versions: dict[str, str], digest: str, tmp: Path, out: Path, say: Progress
) -> dict:
    """Build the kit for ``spec`` into ``out`` (``tmp`` holds the downloads and unpacked trees); return its
    manifest.  ``kernel_pkg`` and ``versions`` are the resolved packages, ``digest`` the kit's hash."""
    t_start = time.monotonic()
    timings: dict[str, float] = {}
    step = _Step(say, timings)
    for tool in ("apt-get", "apt-cache", "dpkg-deb", "mkfs.ext4"):
        if shutil.which(tool) is None:
            raise ToolMissingError(f"{tool} is not installed (Debian packages apt, dpkg, e2fsprogs)")

    with step(f"apt-get download {len(versions)} packages"):
        files = debs.download(versions, tmp / "debs")
    kroot, broot, proot = tmp / "x-kernel", tmp / "x-busybox", tmp / "x-python"
    with step("unpack packages"):
        debs.extract(files[kernel_pkg], kroot)
        debs.extract(files[spec.busybox_package], broot)
        for pkg in spec.python_packages:
            debs.extract(files[pkg], proot)

    with step("kernel: vmlinuz + extract vmlinux"):
        kernel_version, vmlinuz = _find_kernel(kroot)
        shutil.copyfile(vmlinuz, out / "vmlinuz")
        bzimage.extract_vmlinux_file(out / "vmlinuz", out / "vmlinux")

    busybox = broot / "bin" / "busybox"
    with step("initramfs"):
        modules = _module_order(kroot / "lib" / "modules" / kernel_version, spec)
        initramfs_name = "initramfs.cpio.zst"
        _build_initramfs(tmp / "initramfs", out / initramfs_name, busybox, kroot, kernel_version, modules, spec)

    tools = tmp / "tools"
    with step("tools tree: python, libraries, busybox, init"):
        _stage_tools(tools, proot, busybox)
    with step("pip download requirements"):
        wheels = _install_requirements(spec, tools / _SITE_REL, tmp / "wheels")
    with step("envd"):
        _install_envd(spec.guest_dir, tools / _SITE_REL / "envd")
    with step("shared-library closure"):
        libs = _copy_library_closure(tools, proot)
    with step("byte-compile"):
        _compileall(tools)
    with step("check bundled python"):
        envd_import = _check_python(tools)
    if envd_import:
        if spec.require_envd:
            raise KitBuildError(f"`import envd` fails in the kit's Python ({envd_import}); fix {spec.guest_dir} "
                                f"or the packages in {spec.requirements}")  # fmt: skip
        say(f"WARNING: `import envd` fails in the kit's Python: {envd_import}")
    with step("mkfs.ext4 tools drive"):
        _mkfs_ro(tools, out / "tools.ext4", label="aenv-tools")

    sizes = {p.name: p.stat().st_size for p in out.iterdir() if p.is_file()}
    return {
        "hash": digest,
        "format": KIT_FORMAT,
        "kernel_package": kernel_pkg,
        "kernel_version": kernel_version,
        "initramfs": initramfs_name,
        "modules": modules,
        "packages": versions,
        "wheels": wheels,
        "libraries": libs,
        "envd_import_error": envd_import,
        "sizes": sizes,
        "timings_s": timings,
        "build_seconds": round(time.monotonic() - t_start, 2),
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "cmdline": kernel_cmdline(),
    }


def _find_kernel(kroot: Path) -> tuple[str, Path]:
    images = sorted((kroot / "boot").glob("vmlinuz-*"))
    if len(images) != 1:
        raise KitBuildError(f"expected one /boot/vmlinuz-* in the kernel package, found {images}")
    version = images[0].name.removeprefix("vmlinuz-")
    if not (kroot / "lib" / "modules" / version).is_dir():
        raise KitBuildError(f"kernel package has no /lib/modules/{version}")
    return version, images[0]


def _module_order(moddir: Path, spec: KitSpec) -> list[str]:
    """Module paths (relative to ``moddir``) for the wanted modules and their dependencies, dependencies first."""
    by_name: dict[str, Path] = {}
    for ko in moddir.rglob("*.ko*"):
        base = ko.name.split(".ko")[0].replace("-", "_")
        by_name.setdefault(base, ko)
    order: list[str] = []
    state: dict[str, str] = {}

    def visit(name: str) -> None:
        name = name.replace("-", "_")
        if state.get(name) == "done":
            return
        if state.get(name) == "visiting":
            raise KitBuildError(f"kernel module dependency cycle through {name}")
        ko = by_name.get(name)
        if ko is None:
            raise KitBuildError(f"kernel module {name} is not in the kernel package (built in? misspelt?)")
        state[name] = "visiting"
        deps = elf.module_info(_plain_module(ko)).get("depends", "")
        for dep in filter(None, deps.split(",")):
            visit(dep)
        state[name] = "done"
        order.append(name)

    builtin = (moddir / "modules.builtin").read_text() if (moddir / "modules.builtin").exists() else ""
    for name in spec.modules:
        if f"/{name}.ko" in builtin.replace("-", "_"):
            continue  # built into the kernel: nothing to load
        visit(name)
    for name in spec.optional_modules:
        if name.replace("-", "_") in by_name:
            visit(name)
    return [_plain_module(by_name[n]).relative_to(moddir).as_posix() for n in order]


def _plain_module(ko: Path) -> Path:
    """Decompress ``x.ko.xz``/``x.ko.zst`` in place (busybox insmod loads plain ``.ko`` files)."""
    if ko.suffix == ".ko":
        return ko
    plain = ko.with_name(ko.name.split(".ko")[0] + ".ko")
    if not plain.exists():
        data = ko.read_bytes()
        if ko.suffix == ".xz":
            data = lzma.decompress(data)
        elif ko.suffix == ".zst":
            import zstandard

            data = zstandard.ZstdDecompressor().decompressobj().decompress(data)
        else:
            raise KitBuildError(f"unknown kernel module compression: {ko.name}")
        plain.write_bytes(data)
    return plain


def _busybox_applets(busybox: Path, full: bool) -> list[str]:
    proc = subprocess.run(
        [str(busybox), "--list-full" if full else "--list"], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0 or not proc.stdout.strip():
        raise KitBuildError(f"cannot list busybox applets: {proc.stderr.strip()}")
    return proc.stdout.split()


def _build_initramfs(
    tree: Path,
    dest: Path,
    busybox: Path,
    kroot: Path,
    kernel_version: str,
    modules: list[str],
    spec: KitSpec,
) -> None:
    import zstandard  # a node dependency

    for d in ("bin", "sbin", "usr/bin", "usr/sbin", "dev", "proc", "sys", "newroot", "etc"):
        (tree / d).mkdir(parents=True, exist_ok=True)
    shutil.copy2(busybox, tree / "bin" / "busybox")
    for applet in _busybox_applets(busybox, full=True):
        link = tree / applet
        if link.exists() or link.is_symlink():
            continue
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(tree / "bin" / "busybox", link.parent))
    init = tree / "init"
    shutil.copyfile(_DATA_DIR / "initramfs-init.sh", init)
    init.chmod(0o755)
    moddir = kroot / "lib" / "modules" / kernel_version
    target = tree / "lib" / "modules" / kernel_version
    for rel in modules:
        (target / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(moddir / rel, target / rel)
    (tree / "lib" / "modules" / "load.list").write_text("".join(f"{m}\n" for m in modules))
    buf = io.BytesIO()
    write_newc(tree, buf, extra=[CharDevice("dev/console", 5, 1), CharDevice("dev/null", 1, 3, 0o666)])
    dest.write_bytes(zstandard.ZstdCompressor(level=spec.zstd_level).compress(buf.getvalue()))


_SITE_REL = Path("python/lib/python3/dist-packages")


def _stage_tools(tools: Path, proot: Path, busybox: Path) -> None:
    (tools / "bin").mkdir(parents=True)
    (tools / "bb").mkdir()
    (tools / "lib").mkdir()
    (tools / "python" / "bin").mkdir(parents=True)
    shutil.copy2(busybox, tools / "bin" / "busybox")
    for applet in _busybox_applets(busybox, full=False):
        (tools / "bb" / applet).symlink_to("../bin/busybox")
    for name, src in (("bin/python", "python-wrapper.sh"), ("init", "aenv-init.sh")):
        shutil.copyfile(_DATA_DIR / src, tools / name)
        (tools / name).chmod(0o755)
    shutil.copy2(proot / "usr" / "bin" / "python3.11", tools / "python" / "bin" / "python3.11")
    stdlib = tools / "python" / "lib" / "python3.11"
    shutil.copytree(proot / "usr" / "lib" / "python3.11", stdlib, symlinks=True)
    # Drop links out of the tree (Debian links sitecustomize.py to /etc/python3.11/, which would resolve to the
    # build host's or the guest image's file) and what a daemon never uses.
    for path in list(stdlib.rglob("*")):
        if path.is_symlink():
            target = os.readlink(path)
            if os.path.isabs(target) or not (path.parent / target).resolve().is_relative_to(stdlib.resolve()):
                path.unlink()
    for junk in ("ensurepip", "idlelib", "lib2to3/tests", "tkinter", "turtledemo"):
        shutil.rmtree(stdlib / junk, ignore_errors=True)
    (tools / _SITE_REL).mkdir(parents=True)
    ld = proot / "lib" / "x86_64-linux-gnu" / "ld-linux-x86-64.so.2"
    shutil.copyfile(ld.resolve() if ld.is_symlink() else ld, tools / "lib" / "ld-linux-x86-64.so.2")
    (tools / "lib" / "ld-linux-x86-64.so.2").chmod(0o755)


def _install_requirements(spec: KitSpec, site: Path, wheel_dir: Path) -> list[str]:
    """pip-download the wheels in requirements.txt (for CPython 3.11 on x86-64 glibc) and unpack them."""
    req = spec.requirements
    lines = [ln.split("#", 1)[0].strip() for ln in req.read_text().splitlines()] if req.is_file() else []
    if not any(lines):
        return []
    cmd = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "-q", "--only-binary=:all:",
           "--python-version", "3.11", "--implementation", "cp", "--abi", "cp311", "--abi", "abi3", "--abi", "none",
           "--platform", "manylinux_2_36_x86_64", "--platform", "manylinux2014_x86_64", "--platform", "any",
           "-d", str(wheel_dir), "-r", str(req)]  # fmt: skip
    if spec.pip_index_url:
        cmd += ["--index-url", spec.pip_index_url]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise KitBuildError(f"pip download of {req} failed: {proc.stderr.strip()[-2000:]}")
    names = []
    for whl in sorted(wheel_dir.glob("*.whl")):
        with zipfile.ZipFile(whl) as zf:
            zf.extractall(site)
        names.append(whl.name)
    for data in site.glob("*.data"):  # wheel .data dirs: purelib/platlib belong in site-packages
        for sub in ("purelib", "platlib"):
            if (data / sub).is_dir():
                shutil.copytree(data / sub, site, dirs_exist_ok=True)
        shutil.rmtree(data)
    return names


def _install_envd(guest_dir: Path, dest: Path) -> None:
    if not (guest_dir / "__init__.py").is_file():
        raise KitBuildError(f"envd sources not found: {guest_dir}/__init__.py is missing")
    shutil.copytree(guest_dir, dest, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "requirements.txt"))


def _copy_library_closure(tools: Path, proot: Path) -> list[str]:
    """Copy into ``tools/lib`` every shared library any ELF in the tree needs, transitively, by soname."""
    search = [proot / "lib" / "x86_64-linux-gnu", proot / "usr" / "lib" / "x86_64-linux-gnu", proot / "lib64"]
    libdir = tools / "lib"
    copied: set[str] = {"ld-linux-x86-64.so.2"}
    queue = [p for p in tools.rglob("*") if p.is_file() and not p.is_symlink() and elf.is_elf(p)]
    queue = [p for p in queue if p.name != "busybox"]
    missing: dict[str, str] = {}
    while queue:
        obj = queue.pop()
        for so in elf.needed_libraries(obj):
            if so in copied:
                continue
            src = next((d / so for d in search if (d / so).exists()), None)
            if src is None:
                missing.setdefault(so, obj.relative_to(tools).as_posix() if obj.is_relative_to(tools) else str(obj))
                continue
            dest = libdir / so
            shutil.copyfile(src.resolve(), dest)
            dest.chmod(0o755)
            copied.add(so)
            queue.append(dest)
    if missing:
        detail = ", ".join(f"{so} (needed by {who})" for so, who in sorted(missing.items()))
        raise KitBuildError(f"shared libraries not found in the unpacked packages: {detail}; add their packages "
                            "to KitSpec.python_packages")  # fmt: skip
    return sorted(copied)


def _host_python(tools: Path) -> list[str]:
    """Run the bundled Python on the build host through its own loader (the host is x86-64 Linux too)."""
    py = tools / "python" / "bin" / "python3.11"
    return [str(tools / "lib" / "ld-linux-x86-64.so.2"), "--library-path", str(tools / "lib"),
            "--argv0", str(py), str(py)]  # fmt: skip


def _compileall(tools: Path) -> None:
    """Byte-compile everything: the drive is read-only in the guest, and compiling on every start under
    emulation would cost seconds. ``unchecked-hash`` pycs are used without stat()ing the sources."""
    cmd = [*_host_python(tools), "-I", "-m", "compileall", "-q", "-j", "2", "--invalidation-mode", "unchecked-hash",
           "-s", str(tools), "-p", "/opt/aenv", "-x", r"/(test|tests|lib2to3)/", str(tools / "python" / "lib")]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env={"LANG": "C.UTF-8"})
    if proc.returncode != 0:
        raise KitBuildError(f"byte-compiling the tools drive failed: {(proc.stdout + proc.stderr).strip()[-2000:]}")


_CHECK = "import ssl, sqlite3, ctypes, decimal, json, asyncio, pty, termios, zlib, lzma, bz2, hashlib, socket, uuid"


def _check_python(tools: Path) -> str | None:
    """Run the bundled Python: the stdlib must import (else raise); returns the error of ``import envd``, if any."""
    env = {"LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.run([*_host_python(tools), "-I", "-c", _CHECK], capture_output=True, text=True, env=env,
                          check=False)  # fmt: skip
    if proc.returncode != 0:
        raise KitBuildError(f"the bundled Python does not start or lacks modules: {proc.stderr.strip()[-2000:]}")
    proc = subprocess.run([*_host_python(tools), "-I", "-B", "-c", "import envd"], capture_output=True, text=True,
                          env=env, check=False)  # fmt: skip
    if proc.returncode != 0:
        return proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit status {proc.returncode}"
    return None


def _tree_bytes(root: Path) -> tuple[int, int]:
    total, count = 0, 0
    for path in root.rglob("*"):
        count += 1
        if path.is_file() and not path.is_symlink():
            total += (path.stat().st_size + 4095) // 4096 * 4096
    return total, count


def _mkfs_ro(tree: Path, image: Path, *, label: str) -> None:
    """An ext4 image of ``tree`` sized to fit (no journal, no reserved blocks: it is only ever mounted ro)."""
    data, files = _tree_bytes(tree)
    size = (int(data * 1.15) + (16 << 20) + (1 << 20) - 1) // (1 << 20) << 20
    with image.open("wb") as f:
        f.truncate(size)
    cmd = ["mkfs.ext4", "-q", "-F", "-L", label, "-b", "4096", "-m", "0", "-O", "^has_journal",
           "-N", str(files + 2048), "-E", "root_owner=0:0", "-d", str(tree), str(image)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise KitBuildError(f"mkfs.ext4 of the tools drive failed: {proc.stderr.strip()[-2000:]}")
