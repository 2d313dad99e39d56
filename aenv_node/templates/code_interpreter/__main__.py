"""``python3 -m <package>``: run the code-interpreter server (see the package docstring)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from .server import serve

DEFAULT_PORT = 49999
DEFAULT_CWD = "/home/user"
DEFAULT_ENVD_URL = "http://127.0.0.1:49983"


def main(argv: list[str] | None = None) -> None:
    env = os.environ
    p = argparse.ArgumentParser(prog="code_interpreter", description="E2B-compatible code interpreter server")
    p.add_argument("--host", default=env.get("AENV_CI_HOST", "0.0.0.0"), help="listen address (AENV_CI_HOST)")
    p.add_argument("--port", type=int, default=int(env.get("AENV_CI_PORT", DEFAULT_PORT)), help="(AENV_CI_PORT)")
    p.add_argument("--cwd", default=env.get("AENV_CI_CWD", DEFAULT_CWD),
                   help="working directory of the default context and of contexts created without one (AENV_CI_CWD)")
    p.add_argument("--envd-url", default=env.get("AENV_CI_ENVD_URL", DEFAULT_ENVD_URL),
                   help="envd, whose GET /envs gives the sandbox's env vars; empty: none (AENV_CI_ENVD_URL)")
    p.add_argument("--log-level", default=env.get("AENV_CI_LOG_LEVEL", "INFO"))
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cwd = args.cwd
    if not os.path.isdir(cwd):
        logging.getLogger(__name__).warning("default cwd %s does not exist; using %s", cwd, os.getcwd())
        cwd = os.getcwd()
    asyncio.run(serve(args.host, args.port, cwd, args.envd_url or None))


if __name__ == "__main__":
    main()
