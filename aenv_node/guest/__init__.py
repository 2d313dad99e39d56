"""envd: the daemon inside every sandbox, speaking the E2B envd protocol.

Runs inside the VM from the tools drive. It imports nothing from the node
(only relative imports inside this package and the pure-Python packages listed
in ``requirements.txt``), so the guest kit can install this folder as a
top-level package on its own (``python -m envd``).

Public face:

- ``__envd_version__``: the E2B envd version whose behaviour this envd offers
  (the node reports it as ``envdVersion``; the SDKs gate features on it).
- ``EnvdConfig`` and ``serve`` (from :mod:`.server`), loaded lazily so that
  reading the version costs no import of Trio.

Modules: ``http`` (HTTP/1.1 on h11), ``connect`` (Connect protocol),
``process``/``process_service`` (process.Process), ``filesystem_service``,
``entry``, ``inotify`` (filesystem.Filesystem), ``files`` + ``multipart``
(/files), ``control`` (/health, /init, /envs, /metrics), ``state``, ``users``,
``metrics``, ``errors``, ``server``.
"""

from __future__ import annotations

from typing import Any

from .version import __envd_version__

__all__ = ["__envd_version__", "EnvdConfig", "serve"]


def __getattr__(name: str) -> Any:
    if name in ("EnvdConfig", "serve"):
        from . import server

        return getattr(server, name)
    raise AttributeError(name)
