"""Templates from OCI images: pull + convert against skopeo + umoci, layer sharing between images, and a full
template build, a cached rebuild and a raw boot of the same root filesystem, all measured in the same run.

The image is realistic: the tree of the base rootfs the set-up script caches (the newest
``/var/lib/aenv/rootfs/base-*.ext4``, Debian bookworm with python3, Node.js, build tools; loop-mounted
read-only, copied with ``cp -a`` into a umoci bundle, ``lost+found`` left out) packed by ``umoci repack`` as one
gzip layer, then a small app layer (``umoci raw add-layer``: a few files, 8 MiB of random data, a whiteout of
``/etc/motd``) on top: ``bench/app:v1``. ``bench/app:v2`` shares the base layer and has a different app layer.
Both are pushed with ``skopeo copy`` (as nobody, HOME in the bench's temp dir) to Debian's ``docker-registry``
on a free loopback port (plain HTTP).

  a. pull + convert, per round (--rounds, medians), each side from scratch:
       floor  ``skopeo copy docker://<registry>/bench/app:v1 oci:<dir>:v1`` (as nobody) then
              ``umoci raw unpack`` of it into a directory (as root: owners kept): registry to a plain tree on
              the host's ext4, nothing else (no mtree, no runtime config, no fsync). umoci turned out slower
              than our convert, so a tighter floor is measured too, from the same skopeo copy:
       tar    GNU ``tar --numeric-owner -xzpf`` of each layer blob in turn (gzip in one thread, as our
              unpacker; whiteouts not interpreted: the app layer has one) into a fresh ext4 (made untimed) on a
              loop device over a plain sparse file, then its ``umount``: the kernel path our convert takes
              (an ext4 on a loop device), without our FUSE export, layer stack, seal and SQLite.
     A ``sync`` (untimed) precedes each timed phase, so one side's writeback does not land in the other's.
       ours   ``aenv_node.images.oci.pull`` into a fresh blob store, then ``ImageConverter.convert`` into a
              fresh state directory (SQLite, layers dir): digests verified and blobs fsynced; an empty ext4
              made and imported as the bottom layer; each OCI layer untarred (a subprocess) onto the kernel's
              ext4 mounted from the layer stack (FUSE export + loop device) and sealed as one block layer
              (checksums, digest); the provisioning layer (user, hosts, resolv.conf, mount points).
     The node's own record splits the convert: ``image_layers.convert_ms`` per block layer.
  b. sharing: in the same state directory, v2 pulled and converted after v1: the block-layer bytes that appeared
     in the layers directory (allocated and apparent) against the bytes of the one OCI layer that differs
     (compressed and uncompressed), and how many OCI layers were converted (expected: 1; the provisioning
     layer is per image, so one more block layer appears).
  c. a node (``aenv-node serve``, bench/_node.py, fresh state directory, its images cache a temp directory
     linking the shared kit and rootfs, so blobs it pulls go away with the run) builds, through the
     unmodified E2B SDK, ``Template().from_image(v1)`` + two RUN steps + a start command (an HTTP server) and
     a ready command: the wall time of ``Template.build`` (full build: pull, convert, boot, steps, start,
     ready, snapshot), then the same definition again (every step cached). Floor: a raw QEMU boot (the
     command of bench/guest_boot.py: same kit, 512 MiB, 2 vCPUs, tb-size 64 as the node's build VMs) of the
     converted image stack (image layers + provisioning, flattened into one raw file, through a qcow2
     overlay) to envd ``/health``, after the node has stopped. The node's own ``boot_s`` of each build
     (``events``, operation 'template_build') is reported beside it. Part c waits (up to
     --quiet-wait-min, checking every minute) until ``pgrep -f qemu-system`` finds no other VM, else it is
     skipped and the JSON says so. --no-build skips it.

Everything started here is stopped here (registry and node by PID; the rootfs mount, loop devices through
umount; temp dirs removed), on errors and ^C too. Writes bench/results/templates.json (--out); the last line
printed is a one-line summary.

Run (root): .venv/bin/python bench/templates.py [--rounds N] [--out bench/results/templates.json] [--no-build]
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import io
import json
import os
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from aenv_node.images.oci import pull  # noqa: E402
from aenv_node.state import Database  # noqa: E402
from aenv_node.templates import ImageConverter  # noqa: E402
from bench._node import run_node, sigterm_as_interrupt  # noqa: E402
from bench._stats import utc_now  # noqa: E402
from tests.images.oci.servers import Registry, start_registry, stop_registry_process  # noqa: E402
from _results import result_path  # noqa: E402

IMAGE_CACHE = Path("/var/lib/aenv")
NOBODY = 65534
REPO = "bench/app"
APP_DATA_BYTES = 8 << 20
TAR_MTIME = 1_700_000_000
TB_SIZE_MIB = 64  # vmm.tcg_tb_size_mb: what the node's build VMs get
ALIAS = "bench-app"


# ---- helpers -------------------------------------------------------------------------------------------------


def run(*argv: str | Path, env: dict[str, str] | None = None) -> float:
    """Run a command; seconds taken. Raises with its stderr on failure."""
    t = time.perf_counter()
    p = subprocess.run([str(a) for a in argv], capture_output=True, env=env)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(str(a) for a in argv)} failed ({p.returncode}): "
                           f"{p.stderr.decode(errors='replace').strip()[-2000:]}")
    return time.perf_counter() - t


def skopeo(home: Path, *args: str) -> float:
    """skopeo as nobody, HOME in the bench's temp dir (as root it would leave a cache in /var/lib/containers)."""
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": str(home), "XDG_RUNTIME_DIR": str(home / "run"),
           "XDG_DATA_HOME": str(home / "share")}
    return run("setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--",
               "skopeo", "--insecure-policy", *args, env=env)


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def r3(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def mib(n: float | None) -> float | None:
    return None if n is None else round(n / 2**20, 2)


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def mounted(path: Path) -> bool:
    return any(line.split()[1] == str(path) for line in Path("/proc/mounts").read_text().splitlines())


def dir_files(d: Path) -> dict[str, tuple[int, int]]:
    """name -> (apparent bytes, allocated bytes) of the regular files in ``d``."""
    out: dict[str, tuple[int, int]] = {}
    if d.is_dir():
        for p in d.iterdir():
            st = p.lstat()
            if p.is_file() and not p.is_symlink():
                out[p.name] = (st.st_size, st.st_blocks * 512)
    return out


def newest_rootfs() -> Path:
    found = sorted(glob.glob(str(IMAGE_CACHE / "rootfs" / "base-*.ext4")), key=lambda p: Path(p).stat().st_mtime)
    if not found:
        sys.exit(f"no {IMAGE_CACHE}/rootfs/base-*.ext4: run the set-up script (or start a node) first")
    return Path(found[-1])


# ---- the images ----------------------------------------------------------------------------------------------


def _tar_add(tf: tarfile.TarFile, name: str, data: bytes | None = None, mode: int = 0o644) -> None:
    info = tarfile.TarInfo(name)
    info.mtime, info.uid, info.gid, info.uname, info.gname = TAR_MTIME, 0, 0, "root", "root"
    if data is None:
        info.type, info.mode = tarfile.DIRTYPE, 0o755
        tf.addfile(info)
    else:
        info.size, info.mode = len(data), mode
        tf.addfile(info, io.BytesIO(data))


SERVER_PY = b"""import http.server, os
os.chdir("/srv/www")
http.server.test(http.server.SimpleHTTPRequestHandler, port=8080, bind="0.0.0.0")
"""


def app_layer(path: Path, version: str, motd_whiteout: bool) -> int:
    """An app layer tar (PAX, as Go writers make them): /app with a few files and 8 MiB of random data, a
    whiteout of /etc/motd when the base has one. Its size in bytes (the uncompressed layer)."""
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tf:
        _tar_add(tf, "app")
        _tar_add(tf, "app/VERSION", f"{version}\n".encode())
        _tar_add(tf, "app/server.py", SERVER_PY)
        _tar_add(tf, "app/assets.bin", os.urandom(APP_DATA_BYTES))
        _tar_add(tf, "app/conf")
        _tar_add(tf, "app/conf/app.json", json.dumps({"version": version, "port": 8080}).encode() + b"\n")
        if motd_whiteout:
            _tar_add(tf, "etc")
            _tar_add(tf, "etc/.wh.motd", b"")
    return path.stat().st_size


def _layout_image(layout: Path, tag: str) -> dict[str, Any]:
    """Layers (compressed size, digest) and diff ids of ``tag`` in an OCI layout."""
    digest = _index_manifest(layout, tag)

    def blob(digest: str) -> dict[str, Any]:
        return dict(json.loads((layout / "blobs" / "sha256" / digest.removeprefix("sha256:")).read_text()))

    manifest = blob(digest)
    config = blob(manifest["config"]["digest"])
    return {"manifest_digest": digest,
            "layers": [{"digest": ly["digest"], "compressed_bytes": ly["size"], "diff_id": d}
                       for ly, d in zip(manifest["layers"], config["rootfs"]["diff_ids"])]}


def make_images(work: Path, rootfs: Path) -> dict[str, Any]:
    """bench/app:v1 and :v2 in an OCI layout under ``work/images`` (see the module docstring)."""
    images, mnt = work / "images", work / "mnt"
    layout, bundle = images / "layout", images / "bundle"
    images.mkdir()
    mnt.mkdir()
    t0 = time.perf_counter()
    run("umoci", "init", "--layout", layout)
    run("umoci", "new", "--image", f"{layout}:base")
    run("umoci", "unpack", "--image", f"{layout}:base", bundle)
    run("mount", "-o", "ro,loop,noload", rootfs, mnt)
    try:
        copy_s = run("cp", "-a", f"{mnt}/.", f"{bundle}/rootfs/")
    finally:
        if mounted(mnt):
            run("umount", mnt)  # the loop device goes with it (autoclear)
    tree = bundle / "rootfs"
    shutil.rmtree(tree / "lost+found", ignore_errors=True)
    has = {name: (tree / rel).exists() or (tree / rel).is_symlink()
           for name, rel in (("python3", "usr/bin/python3"), ("bash", "bin/bash"), ("motd", "etc/motd"))}
    entries = files_bytes = 0
    for _dirpath, dirnames, filenames in os.walk(tree):
        entries += len(dirnames) + len(filenames)
        for f in filenames:
            p = Path(_dirpath) / f
            if not p.is_symlink():
                files_bytes += p.lstat().st_size
    repack_s = run("umoci", "repack", "--image", f"{layout}:base", bundle)
    shutil.rmtree(bundle)
    run("umoci", "config", "--image", f"{layout}:base", "--config.env",
        "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "--config.cmd", "/bin/bash")
    tars = {}
    for version in ("v1", "v2"):
        tar = images / f"app-{version}.tar"
        tars[version] = app_layer(tar, version, has["motd"])
        run("umoci", "raw", "add-layer", "--image", f"{layout}:base", "--tag", version, tar)
        tar.unlink()
    # skopeo runs as nobody: it must read the layout and write its HOME under the images dir
    (images / "skopeo-home" / "run").mkdir(parents=True)
    run("chown", "-R", f"{NOBODY}:{NOBODY}", images)
    made_s = time.perf_counter() - t0
    info = {"rootfs": str(rootfs), "tree_entries": entries, "tree_file_bytes": files_bytes, "has": has,
            "copy_tree_s": r3(copy_s), "umoci_repack_s": r3(repack_s), "made_in_s": r3(made_s)}
    for version in ("v1", "v2"):
        info[version] = _layout_image(layout, version)
        info[version]["layers"][-1]["uncompressed_bytes"] = tars[version]
    return info


def push_images(work: Path, host: str) -> float:
    images = work / "images"
    t = 0.0
    for version in ("v1", "v2"):
        t += skopeo(images / "skopeo-home", "copy", "-q", "--dest-tls-verify=false",
                    f"oci:{images / 'layout'}:{version}", f"docker://{host}/{REPO}:{version}")
    return t


# ---- a. the floor: skopeo + umoci ----------------------------------------------------------------------------


def floor_round(work: Path, host: str, d: Path) -> dict[str, float]:
    d.mkdir(parents=True)
    d.chmod(0o755)
    oci = d / "oci"
    oci.mkdir()
    os.chown(oci, NOBODY, NOBODY)
    copy_s = skopeo(work / "images" / "skopeo-home", "copy", "-q", "--src-tls-verify=false",
                    f"docker://{host}/{REPO}:v1", f"oci:{oci}:v1")
    run("sync")
    unpack_s = run("umoci", "raw", "unpack", "--image", f"{oci}:v1", d / "rootfs")
    # the tighter floor: GNU tar (gzip, one thread, as our unpacker) extracting each layer blob in turn
    layers = [ly["digest"] for ly in json.loads(
        (oci / "blobs" / "sha256" / _index_manifest(oci, "v1").removeprefix("sha256:")).read_text())["layers"]]
    shutil.rmtree(d / "rootfs")
    fs, mnt = d / "fs.ext4", d / "fs.mnt"
    with fs.open("wb") as f:
        f.truncate(4 << 30)
    run("mkfs.ext4", "-q", "-F", "-b", "4096", "-E", "lazy_itable_init=0,lazy_journal_init=0", fs)
    mnt.mkdir()
    run("mount", "-o", "loop,noatime", fs, mnt)
    try:
        run("sync")
        tar_s = sum(run("tar", "--numeric-owner", "-xzpf", oci / "blobs" / "sha256" / dg.removeprefix("sha256:"),
                        "-C", mnt) for dg in layers)
    finally:
        umount_s = run("umount", mnt)  # writes the filesystem's dirty blocks into the file (as our seal needs)
    run("sync")
    tar_s += umount_s
    return {"skopeo_copy_s": copy_s, "umoci_unpack_s": unpack_s, "total_s": copy_s + unpack_s,
            "tar_xzf_s": tar_s, "skopeo_plus_tar_s": copy_s + tar_s}


def _index_manifest(layout: Path, tag: str) -> str:
    index = json.loads((layout / "index.json").read_text())
    return str(next(m["digest"] for m in index["manifests"]
                    if m.get("annotations", {}).get("org.opencontainers.image.ref.name") == tag))


# ---- a + b. ours: pull() + ImageConverter.convert() ----------------------------------------------------------


def _layer_rows(db: Database) -> dict[str, dict[str, Any]]:
    with db.engine.connect() as c:
        rows = c.exec_driver_sql(
            "SELECT il.chain_id, il.diff_id, il.convert_ms, l.local_path, l.size_bytes FROM image_layers il "
            "JOIN layers l ON l.digest = il.layer_digest").fetchall()
        stats = {r[0]: json.loads(r[1]) if isinstance(r[1], str) else r[1] for r in c.exec_driver_sql(
            "SELECT subject_id, detail FROM events WHERE operation = 'image_layer'").fetchall()}
    return {r[0]: {"diff_id": r[1], "convert_ms": r[2], "path": r[3], "bytes": r[4],
                   "tar": (stats.get(r[0]) or {}).get("tar")} for r in rows}


async def ours_round(host: str, d: Path) -> dict[str, Any]:
    db = Database(d / "aenv.db")
    db.upgrade()
    try:
        conv = ImageConverter(db, layers_dir=d / "layers", work_root=d / "work", run_root=d / "run")

        async def pull_one(tag: str) -> Any:
            return await pull(f"{host}/{REPO}:{tag}", store_dir=d / "oci", registries=(),
                              insecure_registries=(host,), concurrency=4, progress=lines.append)

        lines: list[str] = []
        await trio.run_process(["sync"])
        t0 = time.perf_counter()
        v1 = await pull_one("v1")
        t1 = time.perf_counter()
        c1 = await conv.convert(v1, progress=lines.append)
        t2 = time.perf_counter()
        rows = _layer_rows(db)
        kinds = ["empty ext4"] + [f"OCI layer {i}" for i in range(1, len(v1.layers) + 1)] + ["provisioning"]
        steps = {k: {"convert_ms": rows[ch]["convert_ms"], "block_layer_bytes": rows[ch]["bytes"],
                     "tar": rows[ch]["tar"]} for k, ch in zip(kinds, c1.chain)}
        a = {"pull_s": t1 - t0, "convert_s": t2 - t1, "total_s": t2 - t0, "converted": c1.converted,
             "convert_steps": steps, "disk_size_bytes": c1.size}

        # b. v2 after v1: what appears in the layers directory
        before = dir_files(d / "layers")
        lines.clear()
        t3 = time.perf_counter()
        v2 = await pull_one("v2")
        t4 = time.perf_counter()
        c2 = await conv.convert(v2, progress=lines.append)
        t5 = time.perf_counter()
        after = dir_files(d / "layers")
        added = {n: v for n, v in after.items() if n not in before}
        rows = _layer_rows(db)
        new_chains = [ch for ch in c2.chain if ch not in c1.chain]
        by_file = {Path(rows[ch]["path"]).name: ("provisioning" if rows[ch]["diff_id"].startswith("aenv:provision")
                                                 else "OCI layer") for ch in new_chains}
        b = {"pull_s": t4 - t3, "convert_s": t5 - t4, "converted": c2.converted,
             "already_converted_lines": sum("already converted" in ln for ln in lines),
             "blobs_already_present": sum("already present" in ln for ln in lines),
             "shared_block_layers": sum(1 for ch in c2.chain if ch in c1.chain),
             "added_files": [{"kind": by_file.get(n, "?"), "apparent_bytes": v[0], "allocated_bytes": v[1]}
                             for n, v in sorted(added.items())],
             "new_chains": len(new_chains)}
        return {"a": a, "b": b}
    finally:
        db.close()


# ---- c. builds through the node --------------------------------------------------------------------------------


def other_vms() -> list[str]:
    out = subprocess.run(["pgrep", "-af", "qemu-system"], capture_output=True, text=True).stdout
    return [ln[:160] for ln in out.splitlines() if ln.strip()]


def wait_quiet(minutes: float) -> list[str]:
    """Wait until no qemu-system process runs (checked every minute, up to ``minutes``); what still runs."""
    deadline = time.monotonic() + minutes * 60
    while True:
        busy = other_vms()
        if not busy or time.monotonic() >= deadline:
            return busy
        print(f"  another VM is running ({len(busy)} qemu-system processes); checking again in a minute",
              flush=True)
        time.sleep(60)


def _ts(e: Any) -> float:
    return float(e.timestamp.timestamp())


def log_phases(entries: list[Any]) -> dict[str, float | None]:
    """Phases of one build from its log's timestamps (the node's, to the millisecond)."""

    def first(*needles: str) -> float | None:
        for e in entries:
            if all(n in e.message for n in needles):
                return _ts(e)
        return None

    def last(needle: str) -> float | None:
        hits = [_ts(e) for e in entries if needle in e.message]
        return hits[-1] if hits else None

    marks = {"start": first("building "), "pulled": first("pulled ", "layers)"),
             "converted": last("provisioning:"), "vm_up": first("build VM up"),
             "start_cmd": first("start command:"), "ready": first("ready after"), "snapshot": first("snapshotting"),
             "done": first("ready in ", "(boot ")}

    def span(a: str, b: str) -> float | None:
        start, end = marks[a], marks[b]
        return r3(end - start) if start is not None and end is not None else None

    return {"pull_s": span("start", "pulled"), "convert_s": span("pulled", "converted"),
            "to_vm_up_s": span("converted", "vm_up"), "steps_s": span("vm_up", "start_cmd"),
            "start_to_ready_s": span("start_cmd", "ready"), "snapshot_and_commit_s": span("snapshot", "done"),
            "log_total_s": span("start", "done")}


def converted_stack(state: Path, image_ref_digest: str) -> list[Path]:
    """The block layers the image's first build booted: image layers bottom up, then provisioning."""
    from aenv_node.templates.convert import chain_id
    from aenv_node.templates.provision import PROVISION_VERSION

    con = sqlite3.connect(f"file:{state / 'aenv.db'}?mode=ro", uri=True, timeout=10)
    try:
        (top,) = con.execute("SELECT top_chain_id FROM images WHERE digest = ?", (image_ref_digest,)).fetchone()
        chains = []
        ch: str | None = top
        while ch is not None:
            chains.append(ch)
            ch = con.execute("SELECT parent_chain_id FROM image_layers WHERE chain_id = ?", (ch,)).fetchone()[0]
        chains.reverse()
        chains.append(chain_id(top, f"aenv:provision:v{PROVISION_VERSION}"))
        paths = []
        for ch in chains:
            (p,) = con.execute("SELECT l.local_path FROM image_layers il JOIN layers l ON l.digest = il.layer_digest"
                               " WHERE il.chain_id = ?", (ch,)).fetchone()
            paths.append(Path(p))
        return paths
    finally:
        con.close()


def raw_boot(layers: list[Path], work: Path) -> dict[str, Any]:
    """The floor: the stack flattened into a raw file, booted by raw QEMU to envd /health (guest_boot.py)."""
    from aenv_node.images import ensure_kit
    from aenv_node.storage import LayerReader, materialize
    from bench.guest_boot import run_full

    flat = work / "flat.raw"
    readers = [LayerReader.open(p) for p in layers]
    try:
        size = max(r.virtual_size for r in readers)
        t = time.perf_counter()
        materialize(readers, flat, size=size, fsync=False)
        flatten_s = time.perf_counter() - t
    finally:
        for r in readers:
            r.close()
    kit = ensure_kit(IMAGE_CACHE)
    try:
        out = run_full(kit, flat, work, TB_SIZE_MIB, 300)
    finally:
        flat.unlink(missing_ok=True)
    return {"health_s": out["health_s"], "console_marker_s": out["marker_s"], "flatten_s": flatten_s,
            "disk_bytes": size, "layers": len(layers)}


def template_definition(Template: Any, ref: str, python3: bool) -> Any:
    py = "python3" if python3 else "/opt/aenv/bin/python"  # the tools drive's Python when the image has none
    return (Template().from_image(ref)
            .run_cmd("mkdir -p /srv/www && cp /app/VERSION /srv/www/index.html && date -u > /srv/www/built.txt")
            .run_cmd("head -c 4M /dev/urandom > /srv/blob && sha256sum /srv/blob > /srv/blob.sha256")
            .set_start_cmd(f"{py} /app/server.py", "bash -c 'echo > /dev/tcp/127.0.0.1/8080'"))


def build_part(work: Path, host: str, image_info: dict[str, Any]) -> dict[str, Any]:
    cache = work / "images-cache"  # the node's OCI blobs land here; kit and rootfs are the shared ones
    cache.mkdir()
    for name in ("kit", "rootfs"):
        (cache / name).symlink_to(IMAGE_CACHE / name)
    # (bench/_node.py leaves code-interpreter-v1 off: only base is built at start)
    env = {"AENV_IMAGES_INSECURE_REGISTRIES": host, "AENV_TEMPLATES_READY_TIMEOUT_S": "120"}
    ref = f"{host}/{REPO}:v1"
    stop: list[Any] = []
    out: dict[str, Any] = {"image": ref}
    with run_node(image_cache=str(cache), extra_env=env, stop_hook=stop) as node:
        out["node_start_to_base_ready_s"] = r3(node.template_ready_s)
        print(f"  node up, base template ready after {node.template_ready_s:.1f} s", flush=True)
        os.environ.update(node.sdk_env())
        from e2b import Template

        definition = template_definition(Template, ref, bool(image_info["has"]["python3"]))
        builds = []
        for label in ("full", "cached"):
            entries: list[Any] = []
            t = time.perf_counter()
            info = Template.build(definition, ALIAS, on_build_logs=entries.append)
            wall = time.perf_counter() - t
            rows = node.sql("SELECT detail, duration_ms FROM events WHERE operation = 'template_build' "
                            "AND to_state = 'ready' ORDER BY id")
            detail = next((json.loads(d) if isinstance(d, str) else d for d, _ in rows
                           if (json.loads(d) if isinstance(d, str) else d).get("build_id") == info.build_id), {})
            dur = next((ms for d, ms in rows
                        if (json.loads(d) if isinstance(d, str) else d).get("build_id") == info.build_id), None)
            cached = next((e.message for e in entries if "steps cached" in e.message), None)
            builds.append({"label": label, "wall_s": r3(wall), "node_build_s": r3(dur / 1000 if dur else None),
                           "boot_s": detail.get("boot_s"), "capture_ms": detail.get("capture_ms"),
                           "steps_cached": cached, "phases": log_phases(entries), "build_id": info.build_id,
                           "log": [f"{e.timestamp.isoformat()[11:23]} {e.level} {e.message}" for e in entries]})
            print(f"  {label} build: {wall:.1f} s (node boot {detail.get('boot_s')} s; {cached})", flush=True)
        out["builds"] = builds
        digest = node.sql("SELECT source_digest FROM template_builds WHERE id = ?", (builds[0]["build_id"],))[0][0]
        out["image_digest"] = digest
        stop[0]()  # the node stops; its state stays until the block ends (the layers to boot raw)
        layers = converted_stack(node.state_dir, digest)
        floor_work = work / "raw-boot"
        floor_work.mkdir()
        out["raw_boot"] = {k: r3(v) if isinstance(v, float) else v for k, v in raw_boot(layers, floor_work).items()}
        print(f"  raw QEMU boot of the converted stack to envd /health: {out['raw_boot']['health_s']:.1f} s",
              flush=True)
    floor = out["raw_boot"]["health_s"]
    out["ratios"] = {f"{b['label']}_build_over_raw_boot": round(b["wall_s"] / floor, 2) for b in builds}
    return out


# ---- main --------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def workspace() -> Iterator[Path]:
    work = Path(tempfile.mkdtemp(prefix="aenv-bench-templates-", dir="/var/tmp"))
    work.chmod(0o755)  # skopeo (as nobody) reads and writes below
    try:
        yield work
    finally:
        for line in reversed(Path("/proc/mounts").read_text().splitlines()):
            target = line.split()[1]
            if target.startswith(f"{work}/"):
                if subprocess.run(["umount", target], capture_output=True).returncode != 0:
                    subprocess.run(["umount", "-l", target], capture_output=True)
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="rounds of pull + convert vs the floor (medians)")
    ap.add_argument("--rootfs", type=Path, default=None, help="ext4 root filesystem to make the image from "
                    "(default: the newest /var/lib/aenv/rootfs/base-*.ext4)")
    ap.add_argument("--no-build", action="store_true", help="skip part c (the node, its VMs)")
    ap.add_argument("--quiet-wait-min", type=float, default=15, help="how long part c waits for other VMs to end")
    ap.add_argument("--out", type=Path, default=result_path("templates"))
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root (loop devices, mounts, a node)")
    for tool in ("umoci", "skopeo", "docker-registry", "setpriv", "qemu-img"):
        if shutil.which(tool) is None:
            sys.exit(f"{tool} is not installed")
    rootfs = args.rootfs or newest_rootfs()
    result: dict[str, Any] = {"bench": "templates", "started_at": utc_now(), "rounds": args.rounds,
                              "loadavg_start": loadavg(), "cpus": os.cpu_count()}
    with sigterm_as_interrupt(), workspace() as work:
        print(f"image from {rootfs} ...", flush=True)
        image = make_images(work, rootfs)
        result["image"] = image
        v1, v2 = image["v1"]["layers"], image["v2"]["layers"]
        sizes = " + ".join(f"{mib(ly['compressed_bytes'])} MiB" for ly in v1)
        print(f"  tree: {image['tree_entries']} entries, {mib(image['tree_file_bytes'])} MiB of files; layers "
              f"{sizes} (gzip); made in {image['made_in_s']:.0f} s", flush=True)
        registry: Registry = start_registry(work / "registry")
        try:
            result["push_s"] = r3(push_images(work, registry.host))
            floors, ours = [], []
            for i in range(args.rounds):
                floors.append(floor_round(work, registry.host, work / f"floor-{i}"))
                shutil.rmtree(work / f"floor-{i}")
                d = work / f"ours-{i}"
                ours.append(trio.run(ours_round, registry.host, d))
                shutil.rmtree(d)
                f, o = floors[-1], ours[-1]["a"]
                print(f"round {i + 1}: floor {f['total_s']:.1f} s (skopeo {f['skopeo_copy_s']:.1f} + umoci "
                      f"{f['umoci_unpack_s']:.1f}); ours {o['total_s']:.1f} s (pull {o['pull_s']:.1f} + convert "
                      f"{o['convert_s']:.1f}) = {o['total_s'] / f['total_s']:.2f}x; tar -xzf into loop ext4 "
                      f"{f['tar_xzf_s']:.1f} s (ours {o['total_s'] / f['skopeo_plus_tar_s']:.2f}x skopeo+tar)",
                      flush=True)

            def med(rows: list[dict[str, Any]], key: str) -> float:
                return round(median([r[key] for r in rows]), 3)

            oa = [o["a"] for o in ours]
            floor_med = {k: med(floors, k) for k in ("skopeo_copy_s", "umoci_unpack_s", "total_s", "tar_xzf_s",
                                                     "skopeo_plus_tar_s")}
            ours_med = {k: med(oa, k) for k in ("pull_s", "convert_s", "total_s")}
            steps = {k: round(median([o["convert_steps"][k]["convert_ms"] for o in oa]), 1)
                     for k in oa[0]["convert_steps"]}
            result["pull_convert"] = {
                "floor_median": floor_med, "ours_median": ours_med, "convert_steps_ms_median": steps,
                "last_round_steps": oa[-1]["convert_steps"], "converted": oa[-1]["converted"],
                "ratio_total": round(ours_med["total_s"] / floor_med["total_s"], 2),
                "ratio_pull_over_skopeo": round(ours_med["pull_s"] / floor_med["skopeo_copy_s"], 2),
                "ratio_convert_over_umoci_unpack": round(ours_med["convert_s"] / floor_med["umoci_unpack_s"], 2),
                "ratio_total_over_skopeo_plus_tar": round(ours_med["total_s"] / floor_med["skopeo_plus_tar_s"], 2),
                "ratio_convert_over_tar_xzf": round(ours_med["convert_s"] / floor_med["tar_xzf_s"], 2),
                "floor_rounds": [{k: r3(v) for k, v in f.items()} for f in floors],
                "ours_rounds": [{k: r3(o[k]) for k in ("pull_s", "convert_s", "total_s")} for o in oa],
            }
            b = ours[-1]["b"]
            differ = v2[-1]
            oci_added = [f for f in b["added_files"] if f["kind"] == "OCI layer"]
            b_out = {**b, "pull_s": r3(b["pull_s"]), "convert_s": r3(b["convert_s"]),
                     "differing_layer_compressed_bytes": differ["compressed_bytes"],
                     "differing_layer_uncompressed_bytes": differ["uncompressed_bytes"],
                     "shared_oci_layers": sum(1 for x, y in zip(v1, v2) if x["diff_id"] == y["diff_id"]),
                     "oci_block_layer_allocated_over_uncompressed": round(
                         sum(f["allocated_bytes"] for f in oci_added) / differ["uncompressed_bytes"], 2)
                     if oci_added else None}
            result["sharing"] = b_out
            print(f"sharing: v2 after v1 converted {b['converted']} OCI layer(s) ({b['shared_block_layers']} block "
                  f"layers shared), added "
                  + ", ".join(f"{f['kind']} {mib(f['allocated_bytes'])} MiB" for f in b["added_files"])
                  + f" on disk for a differing layer of {mib(differ['uncompressed_bytes'])} MiB "
                  f"({mib(differ['compressed_bytes'])} MiB gzip), in {b['pull_s'] + b['convert_s']:.1f} s",
                  flush=True)

            if args.no_build:
                result["build"] = {"skipped": "--no-build"}
            else:
                busy = wait_quiet(args.quiet_wait_min)
                if busy:
                    result["build"] = {"skipped": f"other VMs still running after {args.quiet_wait_min} min",
                                       "qemu": busy}
                    print(f"part c skipped: {len(busy)} qemu-system processes still running", flush=True)
                else:
                    result["build"] = build_part(work, registry.host, image)
        finally:
            stop_registry_process(registry.proc)

    result["loadavg_end"] = loadavg()
    result["finished_at"] = utc_now()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")

    pc, sh, bd = result["pull_convert"], result["sharing"], result["build"]
    om, fm = pc["ours_median"], pc["floor_median"]
    summary = (f"templates: pull+convert {om['total_s']:.1f} s (pull {om['pull_s']:.1f} + convert "
               f"{om['convert_s']:.1f}) vs skopeo+umoci {fm['total_s']:.1f} s = {pc['ratio_total']:.2f}x "
               f"(vs skopeo+tar into loop ext4 {fm['skopeo_plus_tar_s']:.1f} s: "
               f"{pc['ratio_total_over_skopeo_plus_tar']:.2f}x); v2 after v1: {sh['converted']} layer converted, "
               f"+{mib(sum(f['allocated_bytes'] for f in sh['added_files']))} MiB on disk for a "
               f"{mib(sh['differing_layer_uncompressed_bytes'])} MiB layer")
    if "builds" in bd:
        full, cached = bd["builds"]
        summary += (f"; build {full['wall_s']:.1f} s, cached rebuild {cached['wall_s']:.1f} s vs raw boot "
                    f"{bd['raw_boot']['health_s']:.1f} s ({bd['ratios']['full_build_over_raw_boot']:.1f}x / "
                    f"{bd['ratios']['cached_build_over_raw_boot']:.1f}x)")
    else:
        summary += f"; builds not run ({bd.get('skipped')})"
    summary += f"; load {result['loadavg_start'][0]} at start"
    print(summary)


if __name__ == "__main__":
    main()
