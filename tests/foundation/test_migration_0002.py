"""Revision 0002 moves the snapshot config's fixed keys to columns and splits layer locations, for rows
written by revision 0001 (what a node upgraded in place has), and its downgrade gives them back."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

from sqlalchemy import select

from aenv_node.state import Database, Layer, LayerKind, Snapshot, SnapshotKind, SnapshotLayer
from aenv_node.storage.repository import layer_key

HEX = "ab" * 32
SHAPE = {"vcpus": 2, "mem_mib": 512, "kernel": "/k", "initrd": "/i", "cmdline": "c", "tools_img": "/t",
         "accel": "tcg", "free_page_reporting": True}


def _old_rows(path: Path) -> None:
    con = sqlite3.connect(path)
    ts = "2026-11-30T10:00:00.000Z"
    snaps = [
        ("snp_boot", "boot", {"shape": SHAPE, "format": "qemu-migration", "memory": "/s/boot/memory",
                              "memory_layers": [], "rootfs": "/r.ext4", "kit_hash": "kh", "envd_version": "0.6.4",
                              "memory_base_layer": "sha256:" + "cd" * 32}),
        ("snp_pause", "pause", {"shape": SHAPE, "format": "qemu-devices", "memory": "/s/pause/memory",
                                "memory_base": "/s/boot/memory", "memory_layers": ["sha256:" + HEX],
                                "access_token": "tok", "env_vars": {"A": "1"}, "dirty_bytes": 4096,
                                "published": True}),
        ("snp_imp", "pause", {"shape": SHAPE, "format": "qemu-devices", "memory": "/s/imp/memory",
                              "memory_base": "", "memory_layers": ["sha256:" + HEX], "memory_from_layers": True,
                              "imported_parent_id": "snp_far", "published": True, "env_vars": {}}),
    ]
    for sid, kind, cfg in snaps:
        con.execute("INSERT INTO snapshots (id, kind, status, vmm, config, memory_mb, created_at) "
                    "VALUES (?, ?, 'committed', 'qemu', ?, 512, ?)", (sid, kind, json.dumps(cfg), ts))
    for digest, loc in (("sha256:" + HEX, "/state/layers/" + HEX + ".layer"),
                        ("sha256:" + "ef" * 32, "repo:sha256:" + "ef" * 32),
                        ("sha256:" + "12" * 32, layer_key("sha256:" + "12" * 32))):
        con.execute("INSERT INTO layers (digest, kind, size_bytes, virtual_size_bytes, location, refcount, "
                    "created_at) VALUES (?, 'disk', 1, 1, ?, 0, ?)", (digest, loc, ts))
    con.execute("INSERT INTO snapshot_layers (snapshot_id, kind, position, layer_digest) "
                "VALUES ('snp_pause', 'memory', 0, ?)", ("sha256:" + HEX,))
    con.execute("INSERT INTO nodes (id, hostname, listen, version, state, started_at, heartbeat_at) "
                "VALUES ('n', 'h', 'l', 'v', 'running', ?, ?)", (ts, ts))
    con.commit()
    con.close()


def test_0002_migrates_existing_rows_and_back(tmp_path: Path) -> None:
    db = Database(tmp_path / "aenv.db")
    db.upgrade("0001")
    _old_rows(db.path)
    db.upgrade("head")
    with db.session() as s:
        boot, pause, imp = (s.get(Snapshot, i) for i in ("snp_boot", "snp_pause", "snp_imp"))
        assert boot is not None and pause is not None and imp is not None
        assert boot.kind is SnapshotKind.BOOT and boot.vmstate_format == "qemu-migration"
        assert boot.memory_location == "/s/boot/memory" and boot.memory_base_location is None
        assert boot.memory_base_layer == "sha256:" + "cd" * 32
        assert boot.config is not None and boot.config.rootfs == "/r.ext4" and boot.config.kit_hash == "kh"
        assert boot.config.shape.free_page_reporting is True and boot.config.version == 1
        assert pause.memory_base_location == "/s/boot/memory" and pause.dirty_bytes == 4096 and pause.published
        assert pause.config is not None and pause.config.access_token == "tok" and pause.config.env_vars == {"A": "1"}
        assert imp.memory_base_location is None and imp.memory_from_layers and imp.imported_parent_id == "snp_far"
    con = sqlite3.connect(db.path)
    try:
        # the moved keys are gone from the JSON: one place holds each value
        keys = set(json.loads(con.execute("SELECT config FROM snapshots WHERE id = 'snp_pause'").fetchone()[0]))
        assert keys == {"version", "shape", "access_token", "env_vars"}
        layers = {d: (p, k) for d, p, k in con.execute("SELECT digest, local_path, repository_key FROM layers")}
        assert layers["sha256:" + HEX] == ("/state/layers/" + HEX + ".layer", None)
        assert layers["sha256:" + "ef" * 32] == (None, layer_key("sha256:" + "ef" * 32))
        assert layers["sha256:" + "12" * 32] == (None, layer_key("sha256:" + "12" * 32))
        assert "heartbeat_at" not in {r[1] for r in con.execute("PRAGMA table_info(nodes)")}
    finally:
        con.close()
    with db.session() as s:
        assert {r.kind for r in s.scalars(select(Layer))} == {LayerKind.DISK}  # enum members, from the values
        # nothing referencing a snapshot was lost with the table rebuild (cascades must not fire)
        assert [(r.snapshot_id, r.layer_digest) for r in s.scalars(select(SnapshotLayer))] == [
            ("snp_pause", "sha256:" + HEX)]

    db.downgrade("0001")
    con = sqlite3.connect(db.path)
    try:
        cfg = json.loads(con.execute("SELECT config FROM snapshots WHERE id = 'snp_pause'").fetchone()[0])
        assert cfg["memory"] == "/s/pause/memory" and cfg["memory_base"] == "/s/boot/memory"
        assert cfg["format"] == "qemu-devices" and cfg["memory_layers"] == ["sha256:" + HEX]
        assert cfg["published"] is True and cfg["dirty_bytes"] == 4096 and cfg["access_token"] == "tok"
        boot = json.loads(con.execute("SELECT config FROM snapshots WHERE id = 'snp_boot'").fetchone()[0])
        assert "memory_base" not in boot and boot["memory_base_layer"] == "sha256:" + "cd" * 32
        imp = json.loads(con.execute("SELECT config FROM snapshots WHERE id = 'snp_imp'").fetchone()[0])
        assert imp["memory_base"] == "" and imp["memory_from_layers"] is True
        locs = dict(con.execute("SELECT digest, location FROM layers"))
        assert locs["sha256:" + HEX] == "/state/layers/" + HEX + ".layer"
        assert locs["sha256:" + "12" * 32] == layer_key("sha256:" + "12" * 32)
    finally:
        con.close()
