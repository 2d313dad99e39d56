"""Sandbox traffic to any port, Host routing, and what a sandbox cannot reach."""

from __future__ import annotations

import socket
import subprocess
import time

import httpx
import pytest
from e2b import Sandbox

from .conftest import DOMAIN

pytestmark = pytest.mark.vm


def _wait_port(node, sid: str, port: int, path: str = "/") -> httpx.Response:
    deadline = time.monotonic() + 30
    while True:
        r = httpx.get(node.url + path, headers={"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": str(port)})
        if r.status_code != 502 or time.monotonic() > deadline:
            return r
        time.sleep(0.3)


def test_any_port_by_header_and_by_host(sdk_env) -> None:
    sb = Sandbox.create()
    try:
        sb.files.write("/home/user/www/index.html", "<h1>from the guest</h1>")
        sb.commands.run("cd /home/user/www && /opt/aenv/bin/python -m http.server 8080 >/dev/null 2>&1",
                        background=True)
        r = _wait_port(sdk_env, sb.sandbox_id, 8080, "/index.html")
        assert r.status_code == 200 and r.text == "<h1>from the guest</h1>"
        host = f"8080-{sb.sandbox_id}.{DOMAIN}"
        r = httpx.get(sdk_env.url + "/index.html", headers={"Host": host})
        assert r.status_code == 200 and "from the guest" in r.text
        r = httpx.get(sdk_env.url + "/", headers={"E2b-Sandbox-Id": sb.sandbox_id,
                                                    "E2b-Sandbox-Port": "8081"})
        assert r.status_code == 502 and "port is not open" in r.json()["message"]
    finally:
        sb.kill()
    r = httpx.get(sdk_env.url + "/health", headers={"E2b-Sandbox-Id": sb.sandbox_id,
                                                      "E2b-Sandbox-Port": "49983"})
    assert r.status_code == 502
    assert r.json() == {"code": 502, "message": f"The sandbox {sb.sandbox_id} was not found"}


def test_envd_needs_the_access_token(sdk_env) -> None:
    sb = Sandbox.create()
    try:
        headers = {"E2b-Sandbox-Id": sb.sandbox_id, "E2b-Sandbox-Port": "49983",
                   "Connect-Protocol-Version": "1", "Content-Type": "application/json"}
        r = httpx.post(sdk_env.url + "/process.Process/List", headers=headers, content=b"{}")
        assert r.status_code == 401
        r = httpx.post(sdk_env.url + "/process.Process/List", content=b"{}",
                       headers={**headers, "X-Access-Token": sb._envd_access_token})
        assert r.status_code == 200
    finally:
        sb.kill()


# an ICMP echo through a raw socket (root only; the base image has no ping): REACHED if a reply comes in 2 s
_RAW_PING = (
    "/opt/aenv/bin/python -c 'import socket, struct, sys\n"
    "def csum(b):\n"
    "    s = sum(struct.unpack(\"!%dH\" % (len(b) // 2), b)); s = (s >> 16) + (s & 0xffff); s += s >> 16\n"
    "    return ~s & 0xffff\n"
    "pkt = struct.pack(\"!BBHHH\", 8, 0, 0, 7, 1) + b\"aenvping\"\n"
    "pkt = pkt[:2] + struct.pack(\"!H\", csum(pkt)) + pkt[4:]\n"
    "s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP); s.settimeout(2)\n"
    "s.sendto(pkt, (sys.argv[1], 0))\n"
    "try:\n"
    "    while True:\n"
    "        data, src = s.recvfrom(1024)\n"
    "        if src[0] == sys.argv[1] and data[20] == 0: print(\"REACHED\"); break\n"
    "except OSError: print(\"BLOCKED\")\n"
    "' {0}"
)


def test_isolation_from_other_sandboxes_host_and_api(sdk_env) -> None:
    a = Sandbox.create()
    b = Sandbox.create()
    server = socket.socket()
    server.bind(("0.0.0.0", 0))
    server.listen()
    host_port = server.getsockname()[1]
    try:
        b.commands.run("/opt/aenv/bin/python -m http.server 9000 >/dev/null 2>&1", background=True)
        assert _wait_port(sdk_env, b.sandbox_id, 9000).status_code == 200
        b_addr, a_host = sdk_env.sql(
            f"SELECT (SELECT slot_ip FROM network_slots WHERE slot_index = (SELECT slot_index FROM sandboxes WHERE id = '{b.sandbox_id}')), "
            f"(SELECT host_ip FROM network_slots WHERE slot_index = (SELECT slot_index FROM sandboxes WHERE id = '{a.sandbox_id}'))")[0]
        assert b_addr and a_host
        api_port = sdk_env.url.rsplit(":", 1)[1]
        probe = ("timeout 3 bash -c 'echo > /dev/tcp/{0}/{1}' 2>/dev/null && echo OPEN || echo CLOSED")
        for target, port in ((b_addr, 9000), (b_addr, 49983), (a_host, host_port), (a_host, api_port),
                             ("169.254.0.22", host_port)):
            out = a.commands.run(probe.format(target, port)).stdout.strip()
            assert out == "CLOSED", f"sandbox reached {target}:{port}"
        # the cloud metadata address, and the same targets from root with raw sockets (ICMP) and over IPv6
        out = a.commands.run(probe.format("169.254.169.254", 80), user="root").stdout.strip()
        assert out == "CLOSED", "sandbox reached the cloud metadata address"
        for target in (b_addr, a_host):
            out = a.commands.run(_RAW_PING.format(target), user="root").stdout.strip()
            assert out == "BLOCKED", f"sandbox pinged {target} from root: {out}"
        v6 = a.commands.run("ip -6 -o addr show scope global 2>/dev/null; ip -6 route show default 2>/dev/null; true",
                            user="root").stdout
        assert v6.strip() == "", f"the guest has a global IPv6 address or route: {v6}"
        out = a.commands.run(probe.format("127.0.0.1", 49983)).stdout.strip()
        assert out == "OPEN"  # its own envd, to show the probe can succeed
        out = a.commands.run(_RAW_PING.format("127.0.0.1"), user="root").stdout.strip()
        assert out == "REACHED", out  # and that the raw ping works at all in the guest
    finally:
        server.close()
        a.kill()
        b.kill()


def test_kill_leaves_nothing_behind(sdk_env) -> None:
    sb = Sandbox.create()
    sid = sb.sandbox_id
    workdir = sdk_env.state_dir / "sandboxes" / sid
    assert workdir.is_dir()
    pid = sdk_env.sql(f"SELECT vmm_pid FROM sandboxes WHERE id = '{sid}'")[0][0]
    assert pid and open(f"/proc/{pid}/cmdline", "rb").read().count(sid.encode())
    sb.kill()
    assert sdk_env.sql(f"SELECT state, vmm_pid, slot_index FROM sandboxes WHERE id = '{sid}'") == \
        [("killed", None, None)]
    ops = sdk_env.sql(f"SELECT operation, from_state, to_state FROM events WHERE sandbox_id = '{sid}' ORDER BY id")
    assert ops == [("create", None, "creating"), ("create", "creating", "running"),
                   ("kill", "running", "killing"), ("kill", "killing", "killed")]
    assert not workdir.exists()
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert sid not in ps
    assert sid not in open("/proc/mounts").read()
    run_dirs = subprocess.run(["find", "/run/aenv", "-name", sid], capture_output=True, text=True).stdout
    assert run_dirs == ""
    in_use = sdk_env.sql(f"SELECT count(*) FROM network_slots WHERE sandbox_id = '{sid}'")[0][0]
    assert in_use == 0


def test_secure_false_is_ignored_every_sandbox_is_secured(sdk_env) -> None:
    """As E2B's API (its ``secure`` is "ignored: all system communication with the sandbox is always
    secured"), a create that asks for ``secure: false`` still gets an envd access token, and envd requires it."""
    with httpx.Client(base_url=sdk_env.url, headers={"X-API-KEY": sdk_env.api_key}, timeout=60) as api:
        r = api.post("/sandboxes", json={"templateID": "base", "timeout": 120, "secure": False})
        assert r.status_code == 201, r.text
        sid, token = r.json()["sandboxID"], r.json()["envdAccessToken"]
        try:
            assert token
            headers = {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "49983",
                       "Connect-Protocol-Version": "1", "Content-Type": "application/json"}
            r = httpx.post(sdk_env.url + "/process.Process/List", headers=headers, content=b"{}")
            assert r.status_code == 401
            r = httpx.post(sdk_env.url + "/process.Process/List", content=b"{}",
                           headers={**headers, "X-Access-Token": token})
            assert r.status_code == 200
        finally:
            assert api.delete(f"/sandboxes/{sid}").status_code == 204


def test_allow_public_traffic_false_requires_the_traffic_token_on_other_ports(sdk_env) -> None:
    """``network.allowPublicTraffic: false`` arms a traffic access token: the proxy requires it (header
    ``E2B-Traffic-Access-Token``) on every port but envd's, which keeps its own token check."""
    with httpx.Client(base_url=sdk_env.url, headers={"X-API-KEY": sdk_env.api_key}, timeout=60) as api:
        r = api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 120,
                                            "network": {"allowPublicTraffic": False}})
        assert r.status_code == 201, r.text
        created = r.json()
    sid, traffic, envd = created["sandboxID"], created["trafficAccessToken"], created["envdAccessToken"]
    assert traffic and envd and traffic != envd
    sb = Sandbox.connect(sid)
    try:
        sb.files.write("/home/user/www/index.html", "guarded")
        sb.commands.run("cd /home/user/www && /opt/aenv/bin/python -m http.server 8080 >/dev/null 2>&1",
                        background=True)
        headers = {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "8080"}
        deadline = time.monotonic() + 30
        while True:
            r = httpx.get(sdk_env.url + "/index.html", headers={**headers, "E2B-Traffic-Access-Token": traffic})
            if r.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        assert r.status_code == 200 and r.text == "guarded"
        r = httpx.get(sdk_env.url + "/index.html", headers=headers)
        assert r.status_code == 403 and "traffic access token" in r.json()["message"]
        r = httpx.get(sdk_env.url + "/index.html", headers={**headers, "E2B-Traffic-Access-Token": "wrong"})
        assert r.status_code == 403
    finally:
        sb.kill()
