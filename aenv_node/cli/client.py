"""``aenv``: the client CLI for a node's API (the commands live in :mod:`aenv_node.cli.aenv`).

``aenv auth`` stores the server URL and API key in the user's config dir
(``$XDG_CONFIG_HOME/aenv/config.json``, mode 0600); other commands read them
(``AENV_URL`` / ``AENV_API_KEY`` and each command's ``--url``/``--key`` override). Errors are one line on
stderr and a non-zero exit code; the server's E2B error message is shown as is.

This module stays the entry point (``[project.scripts] aenv``, ``python -m aenv_node.cli.client``).
"""

from __future__ import annotations

from .aenv import cli, client_config_path, main

__all__ = ["cli", "client_config_path", "main"]

if __name__ == "__main__":  # pragma: no cover
    main()
