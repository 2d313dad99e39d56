"""/files over raw HTTP: multipart, octet-stream, gzip both ways, metadata, ranges, errors."""

from __future__ import annotations

import gzip
import os

import httpx

from .conftest import EnvdProcess, GuestUser, rpc


def test_multipart_single_with_path_and_ownership(envd: EnvdProcess, workdir: str, test_user: GuestUser) -> None:
    target = os.path.join(workdir, "deep", "er", "f.bin")
    data = os.urandom(200_000)
    with envd.client() as c:
        r = c.post("/files", params={"path": target}, files={"file": ("ignored-name", data)})
        assert r.status_code == 200, r.text
        assert r.json() == [{"name": "f.bin", "type": "file", "path": target}]
        g = c.get("/files", params={"path": target})
    assert g.status_code == 200 and g.content == data
    assert g.headers["content-type"] == "application/octet-stream"
    with open(target, "rb") as fh:
        assert fh.read() == data
    for p in (target, os.path.dirname(target)):
        st = os.stat(p)
        assert (st.st_uid, st.st_gid) == (test_user.uid, test_user.gid)
    assert os.stat(target).st_mode & 0o777 == 0o644


def test_multipart_many_files_use_filenames(envd: EnvdProcess, workdir: str) -> None:
    files = [("file", (os.path.join(workdir, f"m{i}.txt"), f"content {i}".encode())) for i in range(3)]
    files.append(("other", ("x", b"ignored field")))
    with envd.client() as c:
        r = c.post("/files", files=files)
    assert r.status_code == 200, r.text
    assert [e["name"] for e in r.json()] == ["m0.txt", "m1.txt", "m2.txt"]
    for i in range(3):
        assert open(os.path.join(workdir, f"m{i}.txt")).read() == f"content {i}"


def test_multipart_same_path_twice_is_rejected(envd: EnvdProcess, workdir: str) -> None:
    p = os.path.join(workdir, "dup.txt")
    with envd.client() as c:
        r = c.post("/files", files=[("file", (p, b"1")), ("file", (p, b"2"))])
    assert r.status_code == 400 and "cannot upload multiple files to the same path" in r.json()["message"]


def test_relative_path_and_root_user(envd: EnvdProcess, workdir: str, test_user: GuestUser) -> None:
    rel = os.path.relpath(os.path.join(workdir, "rel.txt"), test_user.home)
    with envd.client() as c:
        r = c.post("/files", params={"path": rel}, files={"file": ("x", b"rel")})
        assert r.json()[0]["path"] == os.path.join(workdir, "rel.txt")
        r = c.post("/files", params={"path": os.path.join(workdir, "root.txt"), "username": "root"},
                   files={"file": ("x", b"r")})
        assert r.status_code == 200
    assert os.stat(os.path.join(workdir, "root.txt")).st_uid == 0


def test_octet_stream_gzip_upload_and_download(envd: EnvdProcess, workdir: str) -> None:
    data = os.urandom(1_500_000) + b"a" * 1_000_000
    target = os.path.join(workdir, "raw.bin")

    def chunks():
        body = gzip.compress(data)
        for i in range(0, len(body), 65536):
            yield body[i:i + 65536]

    with envd.client() as c:
        r = c.post("/files", params={"path": target}, content=chunks(),
                   headers={"content-type": "application/octet-stream", "content-encoding": "gzip"})
        assert r.status_code == 200, r.text
        assert open(target, "rb").read() == data
        with c.stream("GET", "/files", params={"path": target}, headers={"accept-encoding": "gzip"}) as resp:
            assert resp.headers["content-encoding"] == "gzip"
            raw = b"".join(resp.iter_raw())
        assert gzip.decompress(raw) == data
        r = c.post("/files", content=b"x", headers={"content-type": "application/octet-stream"})
        assert r.status_code == 400 and "path query parameter is required" in r.json()["message"]
        r = c.post("/files", params={"path": target}, content=b"not gzip",
                   headers={"content-type": "application/octet-stream", "content-encoding": "gzip"})
        assert r.status_code == 400 and r.json()["code"] == 400
        r = c.post("/files", params={"path": target}, content=b"x", headers={"content-type": "text/plain"})
        assert r.status_code == 400 and "unsupported content type" in r.json()["message"]


def test_metadata_headers_are_xattrs(envd: EnvdProcess, workdir: str) -> None:
    target = os.path.join(workdir, "meta.txt")
    with envd.client() as c:
        r = c.post("/files", params={"path": target}, content=b"m",
                   headers={"content-type": "application/octet-stream", "X-Metadata-Color": "blue", "x-metadata-k": "v"})
        assert r.json() == [{"name": "meta.txt", "type": "file", "path": target, "metadata": {"color": "blue", "k": "v"}}]
        assert os.getxattr(target, "user.e2b.color") == b"blue"
        stat = c.post("/filesystem.Filesystem/Stat", json={"path": target}).json()["entry"]
        assert stat["metadata"] == {"color": "blue", "k": "v"}
        # an overwrite replaces the whole set
        r = c.post("/files", params={"path": target}, content=b"m2",
                   headers={"content-type": "application/octet-stream", "X-Metadata-k": "w"})
        assert r.json()[0]["metadata"] == {"k": "w"}
        r = c.post("/files", params={"path": target}, content=b"m3", headers={"content-type": "application/octet-stream"})
        assert "metadata" not in r.json()[0]
        r = c.post("/files", params={"path": target}, content=b"m",
                   headers={"content-type": "application/octet-stream", "X-Metadata-k": "caf\u00e9".encode()})
        assert r.status_code == 400


def test_download_errors_and_range(envd: EnvdProcess, workdir: str) -> None:
    target = os.path.join(workdir, "r.txt")
    with open(target, "wb") as fh:
        fh.write(b"0123456789")
    with envd.client() as c:
        r = c.get("/files", params={"path": os.path.join(workdir, "missing")})
        assert r.status_code == 404 and r.json()["code"] == 404 and "does not exist" in r.json()["message"]
        r = c.get("/files", params={"path": workdir})
        assert r.status_code == 400 and "is a directory" in r.json()["message"]
        r = c.get("/files", params={"path": target, "username": "no-such-user-zz"})
        assert r.status_code == 401
        r = c.get("/files", params={"path": target}, headers={"range": "bytes=2-4"})
        assert r.status_code == 206 and r.content == b"234" and r.headers["content-range"] == "bytes 2-4/10"
        r = c.get("/files", params={"path": target}, headers={"range": "bytes=-3"})
        assert r.content == b"789"
        assert c.get("/files", params={"path": target}, headers={"range": "bytes=20-"}).status_code == 416
        r = c.post("/files", params={"path": workdir}, files={"file": ("x", b"x")})
        assert r.status_code == 400 and "path is a directory" in r.json()["message"]
        r = c.get("/files", params={"path": "/etc/hostname.txt.html"})
        assert r.status_code == 404


def test_keep_alive_many_requests_one_connection(envd: EnvdProcess, workdir: str) -> None:
    target = os.path.join(workdir, "ka.txt")
    with envd.client(limits=httpx.Limits(max_connections=1)) as c:
        for i in range(30):
            assert c.post("/files", params={"path": target}, files={"file": ("x", str(i).encode())}).status_code == 200
            assert c.get("/files", params={"path": target}).text == str(i)
            assert c.get("/health").status_code == 204


def test_hostile_paths_behave_as_e2b_envd(envd: EnvdProcess, workdir: str, test_user: GuestUser) -> None:
    """NUL bytes are refused (400, invalid_argument), ``..`` is cleaned lexically before use (it cannot climb
    above /), and a symlink is followed like any path: envd acts for the sandbox's users, who own the guest (E2B
    gives them sudo), so a link is no way around a boundary that does not exist inside one sandbox."""
    secret = os.path.join(workdir, "secret.txt")
    with open(secret, "w") as f:
        f.write("behind a link")
    os.symlink(secret, os.path.join(workdir, "link.txt"))
    with envd.client() as c:
        for path in (f"{workdir}/a\x00b", "\x00", f"{workdir}/\x00/x"):
            r = c.get("/files", params={"path": path})
            assert r.status_code == 400 and "invalid characters" in r.json()["message"], (path, r.text)
            r = c.post("/files", params={"path": path}, files={"file": ("x", b"no")})
            assert r.status_code == 400, (path, r.text)
            r = rpc(c, "filesystem.Filesystem/Stat", {"path": path})
            assert r.status_code == 400 and r.json()["code"] == "invalid_argument", (path, r.text)
        # ".." is resolved before use: far too many of them end at /, never above
        climb = workdir + "/.." * 64 + workdir + "/secret.txt"
        assert c.get("/files", params={"path": climb}).content == b"behind a link"
        r = c.post("/files", params={"path": f"{workdir}/sub/../up.txt"}, files={"file": ("x", b"up")})
        assert r.status_code == 200 and r.json()[0]["path"] == f"{workdir}/up.txt"
        assert not os.path.exists(os.path.join(workdir, "sub"))
        # a symlink reads and stats through to its target, and reports itself as one
        assert c.get("/files", params={"path": f"{workdir}/link.txt"}).content == b"behind a link"
        st = rpc(c, "filesystem.Filesystem/Stat", {"path": f"{workdir}/link.txt"}).json()["entry"]
        assert st["symlinkTarget"] == secret and st["isSymlink"] is True
        # a path that does not exist, through a file as if it were a directory: 404 / 400, nothing made
        r = c.get("/files", params={"path": f"{secret}/child"})
        assert r.status_code in (400, 404), r.text
        r = c.post("/files", params={"path": f"{secret}/child"}, files={"file": ("x", b"no")})
        assert r.status_code == 400, r.text
    assert open(secret).read() == "behind a link"
