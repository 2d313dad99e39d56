"""Tiny TCP probe the network tests run inside namespaces (via ``nsenter --net``).

    nsprobe.py serve NAME PORT [PORT...]   listen on 0.0.0.0 (PORT 0: any free port); print
                                           "ready PORT..." then answer every connection with
                                           "NAME <peer address>\\n"
    nsprobe.py connect HOST PORT TIMEOUT [SRC]
                                           print the server's answer (exit 0) or "FAIL <reason>"
                                           (exit 1); SRC: bind this source address first
    nsprobe.py web NAME PORT [CERT KEY]    like serve, on one port, over TLS when CERT/KEY are given;
                                           answers "NAME <peer> <local address>" after reading a line
    nsprobe.py ask HOST PORT TIMEOUT LINE [SNI]
                                           connect (TLS with server name SNI when given, certificate
                                           not checked), send LINE, print the answer as connect does
    nsprobe.py dns PORT NAME=ADDR...       a DNS server on UDP PORT answering those A records
                                           (NXDOMAIN for any other name)
    nsprobe.py resolve NAME SERVER         print NAME's A records asked of SERVER:53, or "FAIL <rcode>"
                                           (exit 1 only when no answer came)

Standard library only (dnspython for the two DNS modes), so it runs in any namespace with the test's
interpreter.
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


def web(name: str, port: int, cert: str | None = None, key: str | None = None) -> None:
    import ssl

    ctx = None
    if cert and key:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(cert, key)
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port))
    s.listen(64)
    print("ready", s.getsockname()[1], flush=True)
    while True:
        conn, peer = s.accept()
        try:
            conn.settimeout(5)
            if ctx is not None:
                conn = ctx.wrap_socket(conn, server_side=True)
            conn.recv(4096)
            conn.sendall(f"{name} {peer[0]} {conn.getsockname()[0]}\n".encode())
        except OSError:
            pass
        conn.close()


def ask(host: str, port: int, timeout: float, line: str, sni: str | None = None) -> int:
    import ssl

    try:
        with socket.create_connection((host, port), timeout=timeout) as raw:
            c = raw
            if sni:
                ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
                ctx.check_hostname = False
                ctx.verify_mode = ssl.CERT_NONE
                c = ctx.wrap_socket(raw, server_hostname=sni)
            c.settimeout(timeout)
            c.sendall(line.replace("\\r\\n", "\r\n").encode())
            data = b""
            while not data.endswith(b"\n"):
                chunk = c.recv(256)
                if not chunk:
                    break
                data += chunk
    except (OSError, ValueError) as e:
        print(f"FAIL {type(e).__name__}: {e}", flush=True)
        return 1
    print(data.decode().strip(), flush=True)
    return 0 if data else 1


def dns_server(port: int, records: list[str]) -> None:
    import dns.message
    import dns.rcode
    import dns.rrset

    table = dict(r.split("=", 1) for r in records)
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("0.0.0.0", port))
    print("ready", s.getsockname()[1], flush=True)
    while True:
        data, peer = s.recvfrom(65535)
        try:
            q = dns.message.from_wire(data)
        except Exception:
            continue
        r = dns.message.make_response(q)
        name = q.question[0].name.to_text().rstrip(".")
        if name in table:
            r.answer.append(dns.rrset.from_text(q.question[0].name, 30, "IN", "A", table[name]))
        else:
            r.set_rcode(dns.rcode.NXDOMAIN)
        s.sendto(r.to_wire(), peer)


def resolve(name: str, server: str) -> int:
    import dns.message
    import dns.query
    import dns.rcode

    try:
        r = dns.query.udp(dns.message.make_query(name, "A"), server, timeout=2)
    except Exception as e:
        print(f"FAIL {type(e).__name__}", flush=True)
        return 1
    if r.rcode() != dns.rcode.NOERROR:
        print(f"FAIL {dns.rcode.to_text(r.rcode())}", flush=True)
        return 0  # an answer: the server said no
    print(" ".join(sorted(a.address for rrset in r.answer for a in rrset)), flush=True)
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2], [int(p) for p in sys.argv[3:]])
    elif sys.argv[1] == "web":
        web(sys.argv[2], int(sys.argv[3]), *sys.argv[4:6])
    elif sys.argv[1] == "ask":
        sys.exit(ask(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), sys.argv[5], *sys.argv[6:7]))
    elif sys.argv[1] == "dns":
        dns_server(int(sys.argv[2]), sys.argv[3:])
    elif sys.argv[1] == "resolve":
        sys.exit(resolve(sys.argv[2], sys.argv[3]))
    elif sys.argv[1] == "connect":
        sys.exit(connect(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), *sys.argv[5:6]))
    else:
        sys.exit(f"unknown mode {sys.argv[1]!r}")
