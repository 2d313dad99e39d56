"""``python -m envd`` / ``python -m aenv_node.guest``: run envd in the foreground."""

from __future__ import annotations

import argparse
import logging
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="envd", description="E2B-compatible in-guest daemon")
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0)")
    parser.add_argument("--port", type=int, default=49983, help="port to listen on (default 49983)")
    parser.add_argument("--default-user", default="user", help="user for requests naming none, until /init sets one")
    parser.add_argument("--default-workdir", default=None, help="cwd/base path for requests naming none")
    parser.add_argument("--no-set-clock", action="store_true", help="never set the system clock from /init")
    parser.add_argument("--quiesce-path", default=None,
                        help="filesystem /quiesce freezes for a capture (the guest's root: /); default: sync only")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")
    parser.add_argument("--version", action="store_true", help="print the envd version and exit")
    args = parser.parse_args(argv)

    from .version import __envd_version__

    if args.version:
        print(__envd_version__)
        return 0
    logging.basicConfig(
        stream=sys.stderr,
        level=getattr(logging, args.log_level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    import trio

    from .server import EnvdConfig, serve_until_signalled

    config = EnvdConfig(
        host=args.host,
        port=args.port,
        default_user=args.default_user,
        default_workdir=args.default_workdir,
        set_clock=not args.no_set_clock,
        quiesce_path=args.quiesce_path,
    )
    trio.run(serve_until_signalled, config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
