"""Host side: the wheels of ``requirements.txt`` for the guest, downloaded once per content of that file.

A code-interpreter template build COPYs this package and a wheel directory into the image, then installs the wheels
offline inside the VM (it has no network), with a pip there::

    pip install --no-index --find-links /opt/aenv-ci/wheels -r /opt/aenv-ci/aenv_code_interpreter/requirements.txt

or, for a guest without pip (Debian's ``python3`` comes without it), unpacks them on the host with
:func:`unpack_wheels` and COPYs that directory, to be put on ``PYTHONPATH`` before the package's parent::

    PYTHONPATH=/opt/aenv-ci/site:/opt/aenv-ci python3 -m aenv_code_interpreter

Standard library only: it runs on the host under any interpreter, and is harmless when copied into the guest with the
rest of the package.  ``python -m aenv_node.templates.code_interpreter.wheels CACHE_DIR [--unpack SITE_DIR]`` prints
the wheel directory.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

__all__ = ["REQUIREMENTS", "download_wheels", "pinned", "platform_tags", "requirements_hash", "unpack_wheels"]

REQUIREMENTS = Path(__file__).resolve().with_name("requirements.txt")
#: The guest's interpreter and C library: Debian bookworm's python3 (3.11) and glibc 2.36.
GUEST_PYTHON = "3.11"
GUEST_GLIBC_MINOR = 36
_COMPLETE = ".complete"


def requirements_hash(requirements: Path = REQUIREMENTS) -> str:
    return hashlib.sha256(requirements.read_bytes()).hexdigest()[:16]


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pinned(requirements: Path = REQUIREMENTS) -> dict[str, str]:
    """``{normalized name: version}`` of the ``name==version`` lines."""
    out = {}
    for line in requirements.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, sep, version = line.partition("==")
            if not sep:
                raise ValueError(f"{requirements}: {line!r} is not pinned (name==version)")
            out[_norm(name.strip())] = version.strip()
    return out


def platform_tags() -> list[str]:
    # pip does not widen an explicit ``--platform manylinux_2_36_x86_64`` to the older glibc tags, so list them all
    tags = [f"manylinux_2_{minor}_x86_64" for minor in range(GUEST_GLIBC_MINOR, 16, -1)]
    return tags + ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64", "linux_x86_64", "any"]


def _wheel_name(path: Path) -> tuple[str, str]:
    name, version = path.name.split("-")[:2]
    return _norm(name), version


def download_wheels(
    cache_dir: Path, *, requirements: Path = REQUIREMENTS, index_url: str | None = None, python: str = sys.executable
) -> Path:
    """The directory of the wheels for ``requirements`` (CPython 3.11, x86-64 glibc), under ``cache_dir``.

    Downloaded by ``pip download`` (with ``python``'s pip) into a temporary directory, checked to be exactly the
    pinned set (a dependency that is not pinned means requirements.txt is not the whole closure) and renamed into
    place, so a directory that exists is complete; a second call with the same file content downloads nothing.
    """
    cache_dir = Path(cache_dir)
    dest = cache_dir / f"code-interpreter-wheels-{requirements_hash(requirements)}"
    if (dest / _COMPLETE).is_file():
        return dest
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = cache_dir / f".{dest.name}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        cmd = [python, "-m", "pip", "download", "--disable-pip-version-check", "-q", "--only-binary=:all:",
               "--python-version", GUEST_PYTHON, "--implementation", "cp", "--abi", "cp311", "--abi", "abi3",
               "--abi", "none"]  # fmt: skip
        for tag in platform_tags():
            cmd += ["--platform", tag]
        if index_url:
            cmd += ["--index-url", index_url]
        cmd += ["-d", str(tmp), "-r", str(requirements)]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"pip download -r {requirements} failed:\n{proc.stderr.strip()[-3000:]}")
        got = dict(_wheel_name(w) for w in tmp.glob("*.whl"))
        want = pinned(requirements)
        if got != want:
            extra = sorted(f"{n}=={v}" for n, v in got.items() if want.get(n) != v)
            missing = sorted(f"{n}=={v}" for n, v in want.items() if got.get(n) != v)
            raise RuntimeError(
                f"the wheels pip downloaded are not the pinned set of {requirements}: "
                f"not pinned: {extra or 'none'}; pinned but not downloaded: {missing or 'none'}"
            )
        (tmp / _COMPLETE).write_text("".join(sorted(w.name + "\n" for w in tmp.glob("*.whl"))))
        if dest.exists() and not (dest / _COMPLETE).is_file():
            shutil.rmtree(dest)  # left by an older, interrupted layout
        try:
            tmp.rename(dest)
        except OSError:
            if not (dest / _COMPLETE).is_file():  # lost a race to a concurrent download: theirs is as good
                raise
        return dest
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def unpack_wheels(wheel_dir: Path, site_dir: Path) -> list[str]:
    """Unpack every wheel of ``wheel_dir`` into ``site_dir`` (a directory to put on ``PYTHONPATH``), as pip would
    for the library part: ``*.data/purelib`` and ``platlib`` merged in, scripts and data files left out."""
    site_dir = Path(site_dir)
    site_dir.mkdir(parents=True, exist_ok=True)
    names = []
    for whl in sorted(Path(wheel_dir).glob("*.whl")):
        with zipfile.ZipFile(whl) as zf:
            zf.extractall(site_dir)
        names.append(whl.name)
    for data in site_dir.glob("*.data"):
        for sub in ("purelib", "platlib"):
            if (data / sub).is_dir():
                shutil.copytree(data / sub, site_dir, dirs_exist_ok=True)
        shutil.rmtree(data)
    return names


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    p.add_argument("cache_dir", type=Path)
    p.add_argument("--unpack", type=Path, metavar="SITE_DIR", help="also unpack the wheels into SITE_DIR")
    p.add_argument("--index-url")
    args = p.parse_args(argv)
    wheels = download_wheels(args.cache_dir, index_url=args.index_url)
    if args.unpack:
        unpack_wheels(wheels, args.unpack)
    print(wheels)


if __name__ == "__main__":
    main()
