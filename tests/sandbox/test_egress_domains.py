"""Egress by domain name and guest DNS, end to end: a real guest behind the session node, whose only uplink is
the fake internet of ``internet.py`` (a DNS server and web servers in a namespace this test session made)."""

from __future__ import annotations

import pytest
from e2b import ALL_TRAFFIC, Sandbox

from .conftest import NodeProcess
from .internet import Internet

pytestmark = pytest.mark.vm

#: run in the guest: connect to NAME (resolved by the guest) or ADDRESS on PORT, TLS with SNI NAME on 443,
#: send an HTTP request for Host NAME, print the server's first line or FAIL
GUEST = r"""
import socket, ssl, sys
name, port = sys.argv[1], int(sys.argv[2])
address = sys.argv[3] if len(sys.argv) > 3 else name
try:
    c = socket.create_connection((address, port), timeout=5)
    if port == 443:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        c = ctx.wrap_socket(c, server_hostname=name)
    c.settimeout(5)
    c.sendall(("GET / HTTP/1.1\r\nHost: %s\r\n\r\n" % name).encode())
    print(c.recv(200).decode().strip() or "FAIL closed")
except Exception as e:
    print("FAIL", type(e).__name__)
"""


def _ask(sb: Sandbox, name: str, port: int, address: str = "") -> str:
    return sb.commands.run(f"python3 /tmp/ask.py {name} {port} {address}", timeout=60).stdout.strip()


def test_a_domain_allowlist_lets_one_name_through_and_blocks_another(sdk_env: NodeProcess,
                                                                      internet: Internet) -> None:
    sb = Sandbox.create(network={"allow_out": ["allowed.test"], "deny_out": [ALL_TRAFFIC]})
    try:
        sb.files.write("/tmp/ask.py", GUEST)
        # DNS works through the node (the guest's resolv.conf names a server that does not exist here)
        assert sb.commands.run("getent hosts allowed.test").stdout.split()[0] == internet.ip
        # the allowed name, over HTTP (Host) and TLS (SNI): through the node's proxy, from the host's address
        assert _ask(sb, "allowed.test", 80) == f"web {internet.host_ip} {internet.ip}"
        assert _ask(sb, "allowed.test", 443) == f"tls {internet.host_ip} {internet.ip}"
        # another name: closed, on both protocols
        assert _ask(sb, "other.test", 80).startswith("FAIL")
        assert _ask(sb, "other.test", 443).startswith("FAIL")
        # claiming the allowed name at another address reaches the allowed name's server, not that address
        assert _ask(sb, "allowed.test", 80, internet.ip2) == f"web {internet.host_ip} {internet.ip}"

        # PUT /sandboxes/{id}/network: no rules, everything public is open, directly (masqueraded)
        with sdk_env.api() as api:
            assert api.put(f"/sandboxes/{sb.sandbox_id}/network", json={}).status_code == 204
            assert _ask(sb, "other.test", 80) == f"web {internet.host_ip} {internet.ip2}"
            # deny everything: no name resolves any more (DNS is no way out of an isolated sandbox)
            r = api.put(f"/sandboxes/{sb.sandbox_id}/network", json={"denyOut": [ALL_TRAFFIC]})
            assert r.status_code == 204
        assert sb.commands.run("getent hosts allowed.test || echo none").stdout.strip() == "none"
        assert _ask(sb, "allowed.test", 80, internet.ip).startswith("FAIL")
    finally:
        sb.kill()
    assert "egress of slot" in sdk_env.log()  # the proxy said why it closed the denied ones
