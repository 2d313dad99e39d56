"""Tiny TCP probe the network tests run inside namespaces (via ``nsenter --net``).

    nsprobe.py serve NAME PORT [PORT...]   listen on 0.0.0.0 (PORT 0: any free port); print
                                           "ready PORT..." then answer every connection with
                                           "NAME <peer address>\\n"
    nsprobe.py connect HOST PORT TIMEOUT [SRC]
                                           print the server's answer (exit 0) or "FAIL <reason>"
                                           (exit 1); SRC: bind this source address first

Standard library only, so it runs in any namespace with the test's interpreter.
"""

from __future__ import annotations

import selectors
import socket
import sys


def serve(name: str, ports: list[int]) -> None:
    sel = selectors.DefaultSelector()
    bound = []
    for port in ports:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("0.0.0.0", port))
        s.listen(64)
        sel.register(s, selectors.EVENT_READ)
        bound.append(s.getsockname()[1])
    print("ready", *bound, flush=True)
    while True:
        for key, _ in sel.select():
            conn, peer = key.fileobj.accept()  # type: ignore[union-attr]
            try:
                conn.sendall(f"{name} {peer[0]}\n".encode())
            except OSError:
                pass
            conn.close()


def connect(host: str, port: int, timeout: float, src: str | None = None) -> int:
    try:
        source = (src, 0) if src else None
        with socket.create_connection((host, port), timeout=timeout, source_address=source) as c:
            c.settimeout(timeout)
            data = b""
            while not data.endswith(b"\n"):
                chunk = c.recv(256)
                if not chunk:
                    break
                data += chunk
    except OSError as e:
        print(f"FAIL {type(e).__name__}: {e}", flush=True)
        return 1
    print(data.decode().strip(), flush=True)
    return 0 if data else 1


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2], [int(p) for p in sys.argv[3:]])
    elif sys.argv[1] == "connect":
        sys.exit(connect(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), *sys.argv[5:6]))
    else:
        sys.exit(f"unknown mode {sys.argv[1]!r}")
