"""The E2B template build API end to end, driven by the unmodified SDK's ``Template`` builder against a real
node and a real registry: FROM an image, COPY (uploaded through the node's own address), RUN, ENV, WORKDIR,
a start command and its ready check; then sandboxes of that template have the files, the environment and the
server already running. And the failures a user meets: each a build error with its reason in the status."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2b import BuildInfo, Sandbox, Template, wait_for_port
from e2b.exceptions import BuildException, SandboxException

from tests.images.oci.images import Images
from tests.images.oci.conftest import PASSWORD, USER
from tests.images.oci.servers import Registry, self_signed, start_registry, stop_registry_process
from tests.sandbox.conftest import NodeProcess, node_in_tmp, processes_mentioning, start_node, stop_node

pytestmark = [pytest.mark.vm, pytest.mark.slow]


def _busybox_image(images: Images, registry: Registry) -> str:
    """``busy:v1``: busybox with every applet linked in /bin, a root account, and a page to serve."""
    layout, work = images.layout, images.workdir
    subprocess.run(["umoci", "new", "--image", f"{layout}:busy"], check=True)
    bundle = work / "bundle-busy"
    subprocess.run(["umoci", "unpack", "--image", f"{layout}:busy", str(bundle)], check=True, capture_output=True)
    root = bundle / "rootfs"
    (root / "bin").mkdir(parents=True)
    shutil.copy("/bin/busybox", root / "bin" / "busybox")
    applets = subprocess.run(["/bin/busybox", "--list"], capture_output=True, text=True, check=True).stdout.split()
    for name in applets:
        if name != "busybox":
            (root / "bin" / name).symlink_to("busybox")
    (root / "etc").mkdir()
    (root / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    (root / "etc" / "group").write_text("root:x:0:\n")
    (root / "root").mkdir(mode=0o700)
    subprocess.run(["umoci", "repack", "--refresh-bundle", "--image", f"{layout}:busy", str(bundle)], check=True)
    subprocess.run(["umoci", "config", "--image", f"{layout}:busy", "--config.env", "PATH=/bin"], check=True)
    shutil.rmtree(bundle)
    subprocess.run(["chown", "-R", "65534:65534", str(layout)], check=True)
    images.skopeo_copy("busy", f"{registry.host}/busy:v1")
    return f"{registry.host}/busy:v1"


@pytest.fixture(scope="module")
def busy_image(images: Images, registry: Registry) -> str:
    return _busybox_image(images, registry)


@pytest.fixture(scope="module")
def auth_registry(oci_tmp: Path, images: Images, busy_image: str) -> Iterator[Registry]:
    """A registry with htpasswd (Basic) auth over TLS, its certificate from a private CA (the node trusts it by
    images.ca_bundle, not by insecure_registries), holding busy:v1."""
    workdir = oci_tmp / "tbuild-auth-registry"
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "htpasswd").write_bytes(subprocess.run(["htpasswd", "-Bbn", USER, PASSWORD], capture_output=True,
                                                      check=True).stdout)
    cert, key, _ = self_signed(workdir / "tls")
    reg = start_registry(workdir, auth={"htpasswd": {"realm": "tbuild", "path": str(workdir / "htpasswd")}},
                         tls=(cert, key))
    try:
        images.skopeo_copy("busy", f"{reg.host}/private/busy:v1", "--dest-creds", f"{USER}:{PASSWORD}")
        yield reg
    finally:
        stop_registry_process(reg.proc)


@pytest.fixture(scope="module")
def build_node(registry: Registry, auth_registry: Registry) -> Iterator[NodeProcess]:
    with node_in_tmp("aenv-tbuild-", AENV_IMAGES_INSECURE_REGISTRIES=registry.host,
                     AENV_IMAGES_CA_BUNDLE=str(auth_registry.root.parent / "tls" / "cert.pem"),
                     AENV_TEMPLATES_READY_TIMEOUT_S="20", AENV_TEMPLATES_BOOT_TIMEOUT_S="90",
                     AENV_TEMPLATES_MAX_CONCURRENT_BUILDS="1") as node:
        yield node


@pytest.fixture
def sdk(build_node: NodeProcess, monkeypatch: pytest.MonkeyPatch) -> NodeProcess:
    for k, v in build_node.sdk_env().items():
        monkeypatch.setenv(k, v)
    return build_node


def test_sdk_template_build_from_an_image_then_sandboxes_of_it(sdk: NodeProcess, auth_registry: Registry,
                                                                 tmp_path: Path) -> None:
    image = f"{auth_registry.host}/private/busy:v1"
    site = tmp_path / "site"
    site.mkdir()
    (site / "index.html").write_text("<h1>from a template</h1>\n")
    template = (
        Template(file_context_path=str(tmp_path)).from_image(image, username=USER, password=PASSWORD)
        .copy("site/", "/srv/www/")
        .run_cmd("echo built > /srv/www/built.txt && id -un > /srv/whoami")
        .set_envs({"GREETING": "hello from ENV"})
        .set_workdir("/srv/www")
        .set_start_cmd("httpd -f -p 8080 -h /srv/www", "wget -q -O /dev/null http://127.0.0.1:8080/index.html")
    )
    logs: list[str] = []
    info = Template.build(template, "busy-app", on_build_logs=lambda e: logs.append(e.message))
    text = "\n".join(logs)
    for expected in ("pulling", "layer 1/1", "provisioning: user user", "step 1/4 COPY site/ /srv/www/",
                     "step 2/4 RUN echo built", "start command: httpd", "ready after", "snapshotting"):
        assert expected in text, text
    assert Template.exists("busy-app")

    sb = Sandbox.create("busy-app")
    try:
        assert sb.commands.run("cat /srv/www/built.txt /srv/whoami").stdout == "built\nroot\n"
        assert sb.commands.run("echo $GREETING; pwd").stdout == "hello from ENV\n/srv/www\n"
        assert sb.files.read("/srv/www/index.html") == "<h1>from a template</h1>\n"
        # the server was started at build time and is in the snapshot: it answers at once, through the proxy
        r = httpx.get(sdk.url + "/index.html", headers={"E2b-Sandbox-Id": sb.sandbox_id, "E2b-Sandbox-Port": "8080"},
                      timeout=30)
        assert r.status_code == 200 and r.text == "<h1>from a template</h1>\n"
        assert sb.commands.run("id -un").stdout.strip() == "user"  # a sandbox's default user, as E2B's
    finally:
        sb.kill()

    [(status, source, digest)] = sdk.sql(
        f"SELECT status, source, source_digest FROM template_builds WHERE id = '{info.build_id}'")
    assert status == "ready" and source == image and digest.startswith("sha256:")
    # the registry password was used for that pull only: nowhere in the node's state, logs or build logs
    for path in sdk.state_dir.rglob("*"):
        if path.is_file() and path.stat().st_size < 64 << 20 and path.suffix not in (".layer",):
            assert PASSWORD.encode() not in path.read_bytes(), path


def test_wrong_registry_credentials_are_a_build_error(sdk: NodeProcess, auth_registry: Registry) -> None:
    t = Template().from_image(f"{auth_registry.host}/private/busy:v1", username=USER, password="wrong-password")
    with pytest.raises(BuildException, match="authentication|unauthorized|credentials"):
        Template.build(t, "wrong-creds")


def test_python_git_pip_node_in_base_and_a_python_server_from_it(sdk: NodeProcess) -> None:
    """The node's base has what E2B's has, and a template FROM it can serve with python3, ready by wait_for_port
    (which uses ss from the base's iproute2)."""
    sb = Sandbox.create()
    try:
        # (npm itself takes tens of seconds to start under TCG: its presence is enough here)
        r = sb.commands.run("python3 -c 'print(1)' && git --version && pip --version && node --version && "
                            "command -v npm && curl --version | head -1", timeout=300)
        assert r.stdout.startswith("1\ngit version ") and "pip " in r.stdout and "curl " in r.stdout
    finally:
        sb.kill()
    t = (Template().from_template("base").run_cmd("mkdir -p /home/user/www && echo served > /home/user/www/a.txt")
         .set_workdir("/home/user/www").set_start_cmd("python3 -m http.server 8080", wait_for_port(8080)))
    Template.build(t, "py-server")
    sb = Sandbox.create("py-server")
    try:
        r = httpx.get(sdk.url + "/a.txt", headers={"E2b-Sandbox-Id": sb.sandbox_id, "E2b-Sandbox-Port": "8080"},
                      timeout=30)
        assert r.status_code == 200 and r.text == "served\n"
    finally:
        sb.kill()


def _read(name: str, path: str) -> str:
    sb = Sandbox.create(name)
    try:
        return sb.files.read(path)
    finally:
        sb.kill()


def _wait_built(infos: list[BuildInfo], timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    for info in infos:
        while (st := Template.get_build_status(info)).status.value not in ("ready", "error"):
            assert time.monotonic() < deadline, st
            time.sleep(1)
        assert st.status.value == "ready", st.reason


def test_tags_name_builds_one_build_at_a_time_and_from_a_template_being_built(sdk: NodeProcess,
                                                                              busy_image: str) -> None:
    """``name:tag`` names a build; builds beyond templates.max_concurrent_builds (1 on this node) wait, status
    "waiting"; a build FROM a template whose first build is under way waits for it (holding no slot) instead of
    failing; tags move, are listed and removed, and a build no tag names any more is collected."""
    def stamp(v: str) -> Template:
        return Template().from_image(busy_image).run_cmd(f"echo {v} > /v")

    b1 = Template.build_in_background(stamp("one"), "tagged:v1")
    b2 = Template.build_in_background(stamp("two"), "tagged:v2", tags=["latest"])
    child = Template.build_in_background(Template().from_template("tagged:v1").set_user("root")
                                         .run_cmd("cat /v > /child"),
                                         "tagged-child")
    assert b2.tags == ["v2", "latest"]
    first = Template.get_build_status(b2, logs_offset=0)
    assert first.status.value == "waiting", first
    assert "waiting for a build slot" in "\n".join(e.message for e in first.log_entries)
    _wait_built([b1, b2, child])
    logs = "\n".join(e.message for e in Template.get_build_status(child, logs_offset=0).log_entries)
    assert "waiting for the build of tagged:v1 in progress" in logs and "FROM template tagged:v1" in logs
    # one at a time: each build began after the one before it ended
    spans = {b: sdk.sql(f"SELECT started_at, finished_at FROM template_builds WHERE id = '{b}'")[0]
             for b in (b1.build_id, b2.build_id, child.build_id)}
    assert spans[b1.build_id][1] <= spans[b2.build_id][0] and spans[b2.build_id][1] <= spans[child.build_id][0]

    assert _read("tagged:v1", "/v") == "one\n" and _read("tagged:v2", "/v") == "two\n"
    assert _read("tagged:latest", "/v") == "two\n"
    assert _read("tagged", "/v") == "two\n"  # no `default` tag: a bare name means the latest build
    assert _read("tagged-child", "/child") == "one\n"
    tags = {t.tag: t.build_id for t in Template.get_tags("tagged")}
    assert tags == {"v1": b1.build_id, "v2": b2.build_id, "latest": b2.build_id}
    assigned = Template.assign_tags("tagged:v1", ["prod"])
    assert assigned.build_id == b1.build_id and assigned.tags == ["prod"]
    assert _read("tagged:prod", "/v") == "one\n"

    with sdk.api() as c:
        listed = {t["aliases"][0]: t for t in c.get("/v2/templates", params={"limit": 1000}).json() if t["aliases"]}
        assert listed["tagged"]["buildID"] == b2.build_id and listed["tagged"]["buildCount"] == 2
        assert listed["tagged"]["spawnCount"] >= 5 and listed["tagged"]["lastSpawnedAt"]
        builds = c.get("/templates/tagged").json()["builds"]
        assert [b["buildID"] for b in builds] == [b2.build_id, b1.build_id]
        assert c.post("/templates/tags", json={"target": "tagged:nope", "tags": ["x"]}).status_code == 404
        r = c.post("/templates/tags", json={"target": "tagged:v1", "tags": ["Bad Tag"]})
        assert r.status_code == 400 and "'tags[0]' must be lowercase" in r.json()["message"]

    [(snap1,)] = sdk.sql(f"SELECT snapshot_id FROM template_builds WHERE id = '{b1.build_id}'")
    Template.remove_tags("tagged", ["v1", "prod"])
    assert {t.tag for t in Template.get_tags("tagged")} == {"v2", "latest"}
    with pytest.raises(SandboxException, match="404: .*no tag 'v1'"):
        Sandbox.create("tagged:v1")
    # the child stands on b1's layers, not on its snapshot: nothing keeps that snapshot now
    deadline = time.monotonic() + 60
    while sdk.sql(f"SELECT status FROM snapshots WHERE id = '{snap1}'") != [("collected",)]:
        assert time.monotonic() < deadline, sdk.sql(f"SELECT status FROM snapshots WHERE id = '{snap1}'")
        time.sleep(0.5)
    assert _read("tagged-child", "/child") == "one\n"


def test_js_sdk_template_build(sdk: NodeProcess, busy_image: str, tmp_path: Path) -> None:
    """The JS SDK's ``Template.build`` (its own hashing, tar upload and status polling) against the same API."""
    js_dir = Path(__file__).resolve().parents[1] / "js"
    assert shutil.which("node") and (js_dir / "node_modules" / "e2b").is_dir(), "run scripts/setup.sh"
    script = js_dir / "aenv_template_build.mjs"  # beside node_modules, so that `import 'e2b'` resolves
    shutil.copy(Path(__file__).parent / "js" / "template_build.mjs", script)
    try:
        r = subprocess.run(["node", str(script), busy_image, str(tmp_path), "js-app"], capture_output=True, text=True,
                           timeout=600, cwd=js_dir, env={**os.environ, **sdk.sdk_env()})
    finally:
        script.unlink()
    assert r.returncode == 0, r.stderr[-3000:]
    results = {row[0]: row[1:] for row in json.loads(r.stdout.strip().splitlines()[-1])}
    assert results == {"built": [True], "logs": [True], "exists": [True],
                       "files": ["copied by the js sdk\n", "js-built\n"], "env": ["yes\n"],
                       "server": ["copied by the js sdk\n"]}


def _aenv(node: NodeProcess, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    sdk = node.sdk_env()
    env = {**os.environ, "AENV_URL": sdk["E2B_API_URL"], "AENV_API_KEY": sdk["E2B_API_KEY"],
           "XDG_CONFIG_HOME": "/nonexistent-aenv-test"}
    return subprocess.run([sys.executable, "-m", "aenv_node.cli.client", *args], capture_output=True, text=True,
                          timeout=900, cwd=cwd or Path(__file__).resolve().parents[2], env=env)


def test_aenv_pull_and_build_from_a_dockerfile(sdk: NodeProcess, busy_image: str, tmp_path: Path) -> None:
    """``aenv pull`` shows each layer and step as the build goes and ends with the template's name; ``aenv
    build`` takes a Dockerfile (COPY from its context, RUN, ENV, WORKDIR), warns for what it ignores, and
    names the line of what it does not support."""
    r = _aenv(sdk, "pull", busy_image, "--name", "cli-pulled")
    assert r.returncode == 0, r.stderr
    assert "layer 1/1" in r.stderr + r.stdout and r.stdout.strip().splitlines()[-1] == "cli-pulled", r
    (tmp_path / "hello.txt").write_text("hello from the context\n")
    (tmp_path / "Dockerfile").write_text(
        f"FROM {busy_image}\nCOPY hello.txt /srv/hello.txt\nENV WHO=cli\nWORKDIR /srv\n"
        "RUN echo built-by-$WHO > /srv/built.txt\nEXPOSE 8080\n")
    r = _aenv(sdk, "build", str(tmp_path / "Dockerfile"), "--name", "cli-built", "--context", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "Dockerfile:6: EXPOSE ignored" in r.stderr, r.stderr
    sb = Sandbox.create("cli-built")
    try:
        assert sb.commands.run("cat hello.txt built.txt").stdout == "hello from the context\nbuilt-by-cli\n"
    finally:
        sb.kill()
    (tmp_path / "Dockerfile").write_text(f"FROM {busy_image}\nRUN true\nHEALTHCHECK CMD true\n")
    r = _aenv(sdk, "build", str(tmp_path / "Dockerfile"), "--name", "cli-bad")
    assert r.returncode != 0 and "Dockerfile:3" in r.stderr and "HEALTHCHECK" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    listed = json.loads(_aenv(sdk, "template", "ls", "--json").stdout)
    assert {"cli-pulled", "cli-built"} <= {a for t in listed for a in t.get("aliases", [])}
    # detached, then followed by its build id; a build that fails is one line with the node's reason
    r = _aenv(sdk, "pull", busy_image, "--name", "cli-detached", "-d")
    assert r.returncode == 0, r.stderr
    build_id = r.stdout.strip()
    r = _aenv(sdk, "template", "watch", build_id)
    assert (r.returncode, r.stdout) == (0, f"build {build_id} ready\n"), r.stderr
    r = _aenv(sdk, "pull", busy_image.replace("/busy:", "/nothing-here:"), "--name", "cli-nope")
    assert r.returncode == 1 and "not found" in r.stderr.splitlines()[-1], r.stderr


@pytest.mark.parametrize("case", ["unknown image", "failing RUN", "never ready"])
def test_build_failures_are_errors_with_the_reason(sdk: NodeProcess, busy_image: str, registry: Registry,
                                                   case: str) -> None:
    base = Template().from_image(busy_image)
    if case == "unknown image":
        t, reason, step = Template().from_image(f"{registry.host}/nope:v1"), "not found", "base"
    elif case == "failing RUN":
        t, reason, step = base.run_cmd("true").run_cmd("echo about to fail; exit 3"), "exit status 3: about to fail", "2"
    else:
        t, reason, step = base.set_start_cmd("sleep 1000", "false"), "ready command never succeeded within 20s", \
            "finalize"
    with pytest.raises(BuildException, match=reason):
        Template.build(t, f"broken-{case.replace(' ', '-').lower()}")
    rows = sdk.sql(f"SELECT b.status, b.error, b.id, t.id FROM template_builds b JOIN templates t "
                   f"ON t.id = b.template_id WHERE t.alias = 'broken-{case.replace(' ', '-').lower()}'")
    assert rows and rows[-1][0] == "error" and reason in rows[-1][1]
    with sdk.api() as c:  # where it stopped, as E2B names it (the SDK points its traceback at that instruction)
        st = c.get(f"/templates/{rows[-1][3]}/builds/{rows[-1][2]}/status").json()
    assert st["reason"]["step"] == step and reason in st["reason"]["message"]
    # no VM of the build is left
    out = subprocess.run(["pgrep", "-f", "aenv-build-tpl-"], capture_output=True, text=True).stdout
    assert not out.strip(), out
    with pytest.raises(SandboxException, match="409: .* has no successful build"):
        Sandbox.create(f"broken-{case.replace(' ', '-').lower()}")


def _stamps(name: str) -> tuple[str, str]:
    sb = Sandbox.create(name)
    try:
        a, b = sb.commands.run("cat /stamp1 /stamp2").stdout.split()
        return a, b
    finally:
        sb.kill()


def test_a_rebuild_reuses_each_unchanged_steps_layer(sdk: NodeProcess, busy_image: str) -> None:
    """Each step is a layer keyed by (its parent, the step, its inputs): the same definition again runs no step,
    a changed step reruns only from there, and skip_cache reruns everything."""
    image = busy_image
    runs = "SELECT chain_id FROM image_layers WHERE diff_id = 'aenv:step:RUN'"
    before = {r[0] for r in sdk.sql(runs)}

    def recipe(second: str) -> Template:
        return (Template().from_image(image).run_cmd("cat /proc/sys/kernel/random/uuid > /stamp1")
                .run_cmd(f"cat /proc/sys/kernel/random/uuid > /stamp2 # {second}"))

    def build(t: Template, **kw: object) -> str:
        logs: list[str] = []
        Template.build(t, "cached-app", on_build_logs=lambda e: logs.append(e.message), **kw)  # type: ignore[arg-type]
        return "\n".join(logs)

    build(recipe("v1"))
    first = _stamps("cached-app")
    log = build(recipe("v1"))
    assert "2 of 2 steps cached" in log and "step 2/2 RUN cat /proc/sys/kernel/random/uuid > /stamp2 # v1: cached" in log
    assert _stamps("cached-app") == first
    log = build(recipe("v2"))
    assert "1 of 2 steps cached" in log
    second = _stamps("cached-app")
    assert second[0] == first[0] and second[1] != first[1]
    log = build(recipe("v2"), skip_cache=True)
    assert "0 of 2 steps cached (forced rebuild)" in log
    third = _stamps("cached-app")
    assert third[0] != first[0] and third[1] != second[1]
    # the layers of every step ever built stay cached (image_layers names them), keyed by their chain
    rows = {r[0] for r in sdk.sql(runs)} - before
    assert len(rows) == 3, rows  # step 1, step 2 "v1", step 2 "v2" (the forced build replaced its chains' layers)


def test_deleting_a_template_in_use(sdk: NodeProcess, busy_image: str) -> None:
    """DELETE /templates/{id}: the name is free at once and creates from it are 404s; a sandbox already made from
    it keeps running (and pausing and resuming); its files go after that sandbox is killed."""
    Template.build(Template().from_image(busy_image).run_cmd("echo kept > /kept"), "del-me")
    sb = Sandbox.create("del-me")
    [(tid, snap)] = sdk.sql("SELECT id, boot_snapshot_id FROM templates WHERE alias = 'del-me'")
    with sdk.api() as c:
        assert c.delete("/templates/del-me").status_code == 204
        assert c.get("/templates/del-me").status_code == 404
        assert c.delete(f"/templates/{tid}").status_code == 404
        r = c.delete("/templates/base")
        assert r.status_code == 403 and "own templates" in r.json()["message"]
    with pytest.raises(SandboxException, match="404"):
        Sandbox.create("del-me")
    assert sb.commands.run("cat /kept").stdout == "kept\n"
    sb.pause()
    sb = Sandbox.connect(sb.sandbox_id)
    assert sb.commands.run("cat /kept").stdout == "kept\n"
    assert sdk.sql(f"SELECT status FROM snapshots WHERE id = '{snap}'") == [("deleted",)]
    sb.kill()
    deadline = time.monotonic() + 60
    while sdk.sql(f"SELECT status FROM snapshots WHERE id = '{snap}'") != [("collected",)]:
        assert time.monotonic() < deadline, sdk.sql(f"SELECT status FROM snapshots WHERE id = '{snap}'")
        time.sleep(0.5)
    [(detail,)] = sdk.sql(f"SELECT detail FROM events WHERE operation = 'template_delete' AND subject_id = '{tid}'")
    assert '"sandboxes_not_killed": 1' in detail


def test_a_build_cut_by_a_crash_is_failed_at_restart_and_its_vm_killed(registry: Registry, busy_image: str) -> None:
    state = Path(tempfile.mkdtemp(prefix="aenv-tcut-", dir="/var/tmp"))
    node = start_node(state, AENV_IMAGES_INSECURE_REGISTRIES=registry.host)
    try:
        with node.api() as c:
            r = c.post("/v3/templates", json={"name": "cut"})
            tid, bid = r.json()["templateID"], r.json()["buildID"]
            c.post(f"/v2/templates/{tid}/builds/{bid}", json={
                "fromImage": busy_image, "steps": [{"type": "RUN", "args": ["sleep 600"]}]}).raise_for_status()
            deadline = time.monotonic() + 300
            while "step 1/1 RUN sleep 600" not in str(c.get(f"/templates/{tid}/builds/{bid}/status").json()):
                assert time.monotonic() < deadline
                time.sleep(0.5)
        node.proc.kill()  # a crash: the build VM outlives the node
        node.proc.wait()
        assert processes_mentioning(str(state / "builds" / bid))
        converted = node.sql("SELECT l.local_path FROM image_layers i JOIN layers l ON l.digest = i.layer_digest")
        assert converted and all(Path(p).is_file() for (p,) in converted)
        # restarted with templates.cache_ttl_s = 0: what the cut build converted is let go at start
        node = start_node(state, port=int(node.url.rsplit(":", 1)[1]), AENV_IMAGES_INSECURE_REGISTRIES=registry.host,
                          AENV_TEMPLATES_CACHE_TTL_S="0")
        with node.api() as c:
            st = c.get(f"/templates/{tid}/builds/{bid}/status").json()
        assert st["status"] == "error" and "interrupted by a restart" in st["reason"]["message"]
        assert "step 1/1 RUN sleep 600" in str(st["logEntries"])  # the log outlived the crash
        assert not processes_mentioning(str(state / "builds" / bid))
        assert "template builds were cut by the last stop" in node.log()
        deadline = time.monotonic() + 120
        while node.sql("SELECT count(*) FROM image_layers") != [(0,)] or any(Path(p).exists() for (p,) in converted):
            assert time.monotonic() < deadline, node.sql("SELECT chain_id, last_used_at FROM image_layers")
            time.sleep(0.5)
        assert node.sql("SELECT count(*) FROM events WHERE operation = 'image_layer_expire'") == [(1,)]
    finally:
        stop_node(node.proc)
        shutil.rmtree(state, ignore_errors=True)

