"""Templates defined in this repository and built through the same recipe path as a user's: ``code-interpreter-v1``
(the ``e2b_code_interpreter`` SDK's default template), FROM the node's ``base``.

Its recipe: COPY the server package (``code_interpreter/``) with its pinned wheels (downloaded on the host by
``code_interpreter.wheels``; the build fetches nothing from inside the VM, so it works with ``net.egress = false``
and with a registry-only network), RUN a virtual environment installed from those wheels
offline, then the server as the start command, ready once ``/health`` answers. The archive the COPY step takes
is made here, keyed by the hash of what goes in it, so the step cache holds across restarts and a change to the
server or its requirements rebuilds only from that step.

A built-in template is current when its last ready build was made from this definition (``definition_key``:
the archive's hash) over the base template's current snapshot; otherwise the node rebuilds it after ``base``.
"""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
from pathlib import Path

from .code_interpreter import wheels
from .recipe import Recipe, Step

__all__ = ["CODE_INTERPRETER", "code_interpreter_recipe", "prepare_code_interpreter_files"]

CODE_INTERPRETER = "code-interpreter-v1"
_PACKAGE = Path(__file__).resolve().with_name("code_interpreter")
_GUEST_DIR = "/opt/aenv-ci"
_PORT = 49999


def _archive_members(wheel_dir: Path) -> list[tuple[str, Path]]:
    members = [(f"aenv-ci/wheels/{w.name}", w) for w in sorted(wheel_dir.glob("*.whl"))]
    members.append(("aenv-ci/requirements.txt", _PACKAGE / "requirements.txt"))
    for f in sorted(_PACKAGE.glob("*.py")):
        if f.name != "wheels.py":  # host side only
            members.append((f"aenv-ci/aenv_code_interpreter/{f.name}", f))
    return members


def prepare_code_interpreter_files(cache_dir: Path, files_dir: Path) -> str:
    """Make (once) the archive the COPY step takes, in ``files_dir`` under its hash; returns the hash. Downloads
    the wheels on the first call (PyPI, from the host). Blocking."""
    wheel_dir = wheels.download_wheels(cache_dir)
    members = _archive_members(wheel_dir)
    h = hashlib.sha256(b"aenv code-interpreter files v1\0")
    for name, path in members:
        h.update(name.encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    files_hash = h.hexdigest()
    final = files_dir / f"{files_hash}.tar"
    if final.is_file():
        return files_hash
    files_dir.mkdir(parents=True, exist_ok=True)
    tmp = files_dir / f".{files_hash}.{os.getpid()}.part"
    with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:
        for d in ("aenv-ci", "aenv-ci/wheels", "aenv-ci/aenv_code_interpreter"):
            info = tarfile.TarInfo(d)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        for name, path in members:
            data = path.read_bytes()
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    os.replace(tmp, final)
    return files_hash


#: how long the server's first kernel may take to start in the build VM
_KERNEL_START_S = 900


def code_interpreter_recipe(files_hash: str, base_template: str) -> Recipe:
    venv = f"{_GUEST_DIR}/venv"
    return Recipe(
        from_template=base_template,
        steps=(
            Step("COPY", ("aenv-ci/", f"{_GUEST_DIR}/", "root", ""), files_hash),
            Step("RUN", (f"python3 -m venv {venv} && {venv}/bin/pip install -q --no-index --disable-pip-version-check "
                         f"--find-links {_GUEST_DIR}/wheels -r {_GUEST_DIR}/requirements.txt "
                         f"&& rm -rf {_GUEST_DIR}/wheels && chmod -R a+rX {_GUEST_DIR}", "root")),
        ),
        # the first kernel start imports IPython and its stack cold: minutes under QEMU TCG on a busy host (only at
        # build time: every sandbox restores the snapshot with the kernel up)
        start_cmd=f"cd /home/user && AENV_CI_KERNEL_READY_TIMEOUT_S={_KERNEL_START_S} PYTHONPATH={_GUEST_DIR} "
                  f"exec {venv}/bin/python -m aenv_code_interpreter",
        ready_cmd=f"curl -sf http://127.0.0.1:{_PORT}/health",
        ready_timeout_s=_KERNEL_START_S + 60,
    )
