"""A tiny envd client run *inside* the test's network namespace (``ip netns exec NS python envd_client.py``).

Reads a JSON list of operations from argv[1], runs them against envd at 169.254.0.21:49983 with httpx (the
Connect JSON protocol for processes, plain HTTP for /files) and prints one JSON result per operation.
"""

from __future__ import annotations

import base64
import json
import struct
import sys
import time

import httpx

BASE = "http://169.254.0.21:49983"


def auth(user: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:".encode()).decode()}


def envelopes(body: bytes) -> list[tuple[int, dict]]:
    out, i = [], 0
    while i + 5 <= len(body):
        flags, size = body[i], struct.unpack(">I", body[i + 1 : i + 5])[0]
        out.append((flags, json.loads(body[i + 5 : i + 5 + size] or b"{}")))
        i += 5 + size
    return out


def run(client: httpx.Client, cmd: str, user: str = "user") -> dict:
    msg = json.dumps({"process": {"cmd": "/bin/bash", "args": ["-l", "-c", cmd]}, "stdin": False}).encode()
    r = client.post(
        f"{BASE}/process.Process/Start",
        content=b"\0" + struct.pack(">I", len(msg)) + msg,
        headers={"Content-Type": "application/connect+json", "Connect-Protocol-Version": "1",
                 "Connect-Timeout-Ms": "60000", **auth(user)},
    )
    if r.status_code != 200:
        return {"status": r.status_code, "error": r.text}
    stdout, stderr, end, pid = b"", b"", None, None
    for flags, m in envelopes(r.content):
        if flags & 0x02:
            if m.get("error"):
                return {"status": 200, "error": m["error"]}
            continue
        ev = m.get("event", {})
        if "start" in ev:
            pid = ev["start"].get("pid")
        data = ev.get("data", {})
        stdout += base64.b64decode(data.get("stdout", ""))
        stderr += base64.b64decode(data.get("stderr", ""))
        if "end" in ev:
            end = ev["end"]
    return {"status": 200, "pid": pid, "stdout": stdout.decode(errors="replace"),
            "stderr": stderr.decode(errors="replace"), "exit_code": (end or {}).get("exitCode", 0), "end": end}


def main() -> None:
    ops = json.loads(sys.argv[1])
    results = []
    with httpx.Client(timeout=90) as client:
        for op in ops:
            kind = op["op"]
            if kind == "health":
                deadline = time.monotonic() + op.get("wait", 0)
                while True:
                    try:
                        r = client.get(f"{BASE}/health", timeout=5)
                        results.append({"status": r.status_code})
                        break
                    except httpx.HTTPError as e:
                        if time.monotonic() > deadline:
                            results.append({"status": None, "error": repr(e)})
                            break
                        time.sleep(0.5)
            elif kind == "run":
                try:
                    results.append(run(client, op["cmd"], op.get("user", "user")))
                except httpx.HTTPError as e:  # e.g. the guest powering off mid-stream
                    if not op.get("ignore_errors"):
                        raise
                    results.append({"status": None, "error": repr(e)})
            elif kind == "write":
                r = client.post(f"{BASE}/files", params={"path": op["path"], "username": op.get("user", "user")},
                                files={"file": (op["path"], op["data"].encode())})
                results.append({"status": r.status_code, "body": r.json() if r.status_code == 200 else r.text})
            elif kind == "read":
                r = client.get(f"{BASE}/files", params={"path": op["path"], "username": op.get("user", "user")})
                results.append({"status": r.status_code, "data": r.text})
            else:
                raise SystemExit(f"unknown op {kind}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
