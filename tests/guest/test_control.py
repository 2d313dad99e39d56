"""/health, /init, /envs, /metrics and the access-token gate."""

from __future__ import annotations

import base64
import datetime
import hashlib
import time

from aenv_node.guest import __envd_version__

from .conftest import EnvdProcess, run_process


def test_health_envs_metrics(envd: EnvdProcess) -> None:
    with envd.client() as c:
        r = c.get("/health")
        assert r.status_code == 204 and r.content == b""
        assert c.get("/envs").json() == {}
        m = c.get("/metrics").json()
        assert set(m) >= {"ts", "cpu_count", "cpu_used_pct", "mem_total_mib", "mem_used_mib", "mem_total",
                          "mem_used", "disk_used", "disk_total"}
        assert m["mem_total"] > m["mem_used"] > 0 and m["disk_total"] > m["disk_used"] > 0
        assert 0 <= m["cpu_used_pct"] <= 100 and m["cpu_count"] >= 1 and abs(m["ts"] - time.time()) < 5
        assert c.post("/health").status_code == 405
        assert c.get("/nope").status_code == 404


def test_init_env_vars_user_workdir(fresh_envd: EnvdProcess) -> None:
    with fresh_envd.client() as c:
        r = c.post("/init", json={"envVars": {"A": "1", "B": "2"}, "defaultUser": "root", "defaultWorkdir": "/tmp"})
        assert r.status_code == 204 and r.headers["x-envd-version"] == __envd_version__
        assert c.get("/envs").json() == {"A": "1", "B": "2"}
        out, _, _, _ = run_process(c, 'echo "$A $B $(id -un) $PWD"', process={"envs": {"B": "override"}})
        assert out == b"1 override root /tmp\n"
        bad = c.post("/init", content=b"{bad")
        assert bad.status_code == 400 and bad.headers["x-envd-version"] == __envd_version__
        assert c.post("/init", content=b"").status_code == 204


def test_init_older_timestamp_is_ignored(fresh_envd: EnvdProcess) -> None:
    now = datetime.datetime.now(datetime.timezone.utc)
    with fresh_envd.client() as c:
        new = now.isoformat().replace("+00:00", "Z")
        old = (now - datetime.timedelta(seconds=1)).isoformat().replace("+00:00", "Z")
        assert c.post("/init", json={"envVars": {"V": "new"}, "timestamp": new}).status_code == 204
        assert c.post("/init", json={"envVars": {"V": "old"}, "timestamp": old}).status_code == 204
        assert c.get("/envs").json() == {"V": "new"}


def test_access_token_gate_and_rotation(fresh_envd: EnvdProcess) -> None:
    with fresh_envd.client() as c:
        assert c.post("/init", json={"accessToken": "t1"}).status_code == 204
        r = c.post("/process.Process/List", json={})
        assert r.status_code == 401 and r.json() == {
            "code": 401, "message": "unauthorized access, please provide a valid access token or method signing if supported"}
        assert c.post("/process.Process/List", json={}, headers={"x-access-token": "t1"}).status_code == 200
        assert c.get("/envs").status_code == 401
        assert c.get("/health").status_code == 204
        # Files: token header or signature required.
        assert c.get("/files", params={"path": "/etc/hostname"}).status_code == 401
        assert c.get("/files", params={"path": "/etc/hostname"}, headers={"x-access-token": "bad"}).status_code == 401
        assert c.get("/files", params={"path": "/etc/hostname", "username": "root"},
                     headers={"x-access-token": "t1"}).status_code == 200
        # Changing the token needs the current one.
        assert c.post("/init", json={"accessToken": "t2"}).status_code == 401
        assert c.post("/init", json={}).status_code == 401
        assert c.post("/init", json={"accessToken": "t1", "envVars": {"X": "1"}}).status_code == 204
        assert c.post("/init", json={"accessToken": "t2"}, headers={"x-access-token": "t1"}).status_code == 204
        assert c.post("/process.Process/List", json={}, headers={"x-access-token": "t1"}).status_code == 401
        assert c.post("/process.Process/List", json={}, headers={"x-access-token": "t2"}).status_code == 200


def _sign(path: str, op: str, user: str, token: str, exp: int | None = None) -> str:
    raw = f"{path}:{op}:{user}:{token}" + (f":{exp}" if exp is not None else "")
    return "v1_" + base64.b64encode(hashlib.sha256(raw.encode()).digest()).rstrip(b"=").decode()


def test_signed_file_urls(fresh_envd: EnvdProcess, workdir: str) -> None:
    path = f"{workdir}/signed.txt"
    with fresh_envd.client() as c:
        assert c.post("/init", json={"accessToken": "sekret"}).status_code == 204
        sig = _sign(path, "write", "", "sekret")
        r = c.post("/files", params={"path": path, "signature": sig}, files={"file": ("x", b"s")})
        assert r.status_code == 200, r.text
        read_sig = _sign(path, "read", "", "sekret")
        assert c.get("/files", params={"path": path, "signature": read_sig}).content == b"s"
        # a write signature does not read, and a signature binds the user
        assert c.get("/files", params={"path": path, "signature": sig}).status_code == 401
        assert c.get("/files", params={"path": path, "signature": read_sig, "username": "root"}).status_code == 401
        root_sig = _sign(path, "read", "root", "sekret")
        assert c.get("/files", params={"path": path, "signature": root_sig, "username": "root"}).status_code == 200
        exp = int(time.time()) + 60
        ok = _sign(path, "read", "", "sekret", exp)
        assert c.get("/files", params={"path": path, "signature": ok, "signature_expiration": exp}).status_code == 200
        past = int(time.time()) - 5
        expired = _sign(path, "read", "", "sekret", past)
        r = c.get("/files", params={"path": path, "signature": expired, "signature_expiration": past})
        assert r.status_code == 401 and "expired" in r.json()["message"]
        r = c.get("/files", params={"path": path})
        assert r.status_code == 401 and r.json()["message"] == "missing signature query parameter"


def test_cors(envd: EnvdProcess) -> None:
    with envd.client() as c:
        pre = c.options("/process.Process/List", headers={
            "origin": "https://app.example", "access-control-request-method": "POST",
            "access-control-request-headers": "content-type,x-access-token"})
        assert pre.status_code == 204
        assert pre.headers["access-control-allow-origin"] == "*"
        assert "x-access-token" in pre.headers["access-control-allow-headers"]
        r = c.post("/process.Process/List", json={}, headers={"origin": "https://app.example"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
        assert "access-control-allow-origin" not in c.get("/health").headers
