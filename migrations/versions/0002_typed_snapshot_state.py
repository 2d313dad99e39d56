"""typed snapshot state: config keys SQL needs become columns, layer locations a nullable local path

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01 21:00:00

- snapshots: ``config`` held every fixed key as JSON (read with ``json_extract`` by the garbage collector).
  The keys SQL needs move to columns: vmstate_format, memory_location, memory_base_location (NULL where
  it was absent or empty), memory_base_layer, memory_from_layers, published, imported_parent_id and
  dirty_bytes. ``memory_layers`` is dropped from the JSON: the chain is ``snapshot_layers`` (kind memory).
  What stays in ``config`` is the versioned ``SnapshotConfig`` record (shape, access token, env vars, and
  for boot snapshots rootfs, kit hash and envd version).
- layers: ``location`` held a local path, ``repo:<digest>`` for a layer only in the repository, or the
  repository key (layers stored by ``aenv-node layer import``/``image seal``). It becomes two typed columns:
  ``local_path`` (NULL when the node has no file) and ``repository_key`` (NULL until the repository holds it).
- nodes: ``heartbeat_at`` was written once at start and never again; it goes (the cluster's heartbeats
  live in Redis).
- sandboxes: ``secure`` recorded a request field that changed nothing (every sandbox's envd requires its
  access token, as E2B's, which ignores the field too); it goes.

Downgrade restores the old shape from the columns.
"""
from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

revision: str = '0002'
down_revision: Union[str, None] = '0001'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None

_MOVED = ("format", "memory", "memory_base", "memory_base_layer", "memory_from_layers", "published",
          "imported_parent_id", "dirty_bytes", "memory_layers")


def upgrade() -> None:
    with op.batch_alter_table('snapshots', schema=None) as batch_op:
        batch_op.add_column(sa.Column('vmstate_format', sa.String(length=32), nullable=False, server_default=''))
        batch_op.add_column(sa.Column('memory_location', sa.Text(), nullable=True))
        batch_op.add_column(sa.Column('memory_base_location', sa.Text(), nullable=True))
        batch_op.add_column(sa.Column('memory_base_layer', sa.String(length=71), nullable=True))
        batch_op.add_column(sa.Column('memory_from_layers', sa.Boolean(), nullable=False,
                                      server_default=sa.false()))
        batch_op.add_column(sa.Column('published', sa.Boolean(), nullable=False, server_default=sa.false()))
        batch_op.add_column(sa.Column('imported_parent_id', sa.String(length=64), nullable=True))
        batch_op.add_column(sa.Column('dirty_bytes', sa.Integer(), nullable=True))
        batch_op.alter_column('config', existing_type=sa.JSON(), nullable=True)
    op.execute("""
        UPDATE snapshots SET
            vmstate_format = coalesce(json_extract(config, '$.format'), ''),
            memory_location = json_extract(config, '$.memory'),
            memory_base_location = nullif(json_extract(config, '$.memory_base'), ''),
            memory_base_layer = json_extract(config, '$.memory_base_layer'),
            memory_from_layers = coalesce(json_extract(config, '$.memory_from_layers'), 0),
            published = coalesce(json_extract(config, '$.published'), 0),
            imported_parent_id = json_extract(config, '$.imported_parent_id'),
            dirty_bytes = json_extract(config, '$.dirty_bytes')
        WHERE config IS NOT NULL AND json_valid(config)
    """)
    paths = ", ".join(f"'$.{k}'" for k in _MOVED)
    op.execute(f"""
        UPDATE snapshots SET config = json_set(json_remove(config, {paths}), '$.version', 1)
        WHERE config IS NOT NULL AND json_valid(config) AND json_extract(config, '$.shape') IS NOT NULL
    """)
    # a config without a shape cannot be restored from: no record
    op.execute("UPDATE snapshots SET config = NULL WHERE config IS NOT NULL AND "
               "(NOT json_valid(config) OR json_extract(config, '$.shape') IS NULL)")
    # the server defaults only served the rows that existed; the models give the values from now on
    with op.batch_alter_table('snapshots', schema=None) as batch_op:
        batch_op.alter_column('vmstate_format', existing_type=sa.String(length=32), server_default=None)
        batch_op.alter_column('memory_from_layers', existing_type=sa.Boolean(), server_default=None)
        batch_op.alter_column('published', existing_type=sa.Boolean(), server_default=None)

    with op.batch_alter_table('layers', schema=None) as batch_op:
        batch_op.add_column(sa.Column('local_path', sa.Text(), nullable=True))
        batch_op.add_column(sa.Column('repository_key', sa.Text(), nullable=True))
    op.execute("""
        UPDATE layers SET
            local_path = CASE WHEN location LIKE 'repo:%' OR location LIKE 'layers/sha256/%' THEN NULL
                              ELSE location END,
            repository_key = CASE
                WHEN location LIKE 'layers/sha256/%' THEN location
                WHEN location LIKE 'repo:sha256:%'
                    THEN 'layers/sha256/' || substr(location, 13, 2) || '/' || substr(location, 13)
                ELSE NULL END
    """)
    with op.batch_alter_table('layers', schema=None) as batch_op:
        batch_op.drop_column('location')

    with op.batch_alter_table('nodes', schema=None) as batch_op:
        batch_op.drop_column('heartbeat_at')

    with op.batch_alter_table('sandboxes', schema=None) as batch_op:
        batch_op.drop_column('secure')


def downgrade() -> None:
    with op.batch_alter_table('sandboxes', schema=None) as batch_op:
        batch_op.add_column(sa.Column('secure', sa.Boolean(), nullable=False, server_default=sa.true()))

    with op.batch_alter_table('nodes', schema=None) as batch_op:
        batch_op.add_column(sa.Column('heartbeat_at', sa.String(length=24), nullable=False,
                                      server_default='1970-01-01T00:00:00.000Z'))
    op.execute("UPDATE nodes SET heartbeat_at = started_at")

    with op.batch_alter_table('layers', schema=None) as batch_op:
        batch_op.add_column(sa.Column('location', sa.Text(), nullable=False, server_default=''))
    op.execute("UPDATE layers SET location = coalesce(local_path, repository_key, 'repo:' || digest)")
    op.execute("UPDATE layers SET location = 'repo:' || digest WHERE local_path IS NULL AND repository_key IS NOT NULL "
               "AND EXISTS (SELECT 1 FROM snapshot_layers sl WHERE sl.layer_digest = layers.digest)")
    with op.batch_alter_table('layers', schema=None) as batch_op:
        batch_op.drop_column('repository_key')
        batch_op.drop_column('local_path')

    op.execute("""
        UPDATE snapshots SET config = json_set(coalesce(json_remove(config, '$.version'), '{}'),
            '$.format', vmstate_format,
            '$.memory', memory_location,
            '$.memory_base', coalesce(memory_base_location, CASE WHEN kind = 'boot' THEN NULL ELSE '' END),
            '$.memory_layers', coalesce((SELECT json_group_array(layer_digest) FROM
                (SELECT layer_digest FROM snapshot_layers sl WHERE sl.snapshot_id = snapshots.id
                 AND sl.kind = 'memory' ORDER BY position)), json('[]')),
            '$.memory_from_layers', json(CASE WHEN memory_from_layers THEN 'true' ELSE 'false' END),
            '$.published', json(CASE WHEN published THEN 'true' ELSE 'false' END),
            '$.dirty_bytes', dirty_bytes)
    """)
    op.execute("UPDATE snapshots SET config = json_set(config, '$.memory_base_layer', memory_base_layer) "
               "WHERE memory_base_layer IS NOT NULL")
    op.execute("UPDATE snapshots SET config = json_set(config, '$.imported_parent_id', imported_parent_id) "
               "WHERE imported_parent_id IS NOT NULL")
    op.execute("UPDATE snapshots SET config = json_remove(config, '$.memory_base') "
               "WHERE json_extract(config, '$.memory_base') IS NULL")
    with op.batch_alter_table('snapshots', schema=None) as batch_op:
        batch_op.alter_column('config', existing_type=sa.JSON(), nullable=False)
        batch_op.drop_column('dirty_bytes')
        batch_op.drop_column('imported_parent_id')
        batch_op.drop_column('published')
        batch_op.drop_column('memory_from_layers')
        batch_op.drop_column('memory_base_layer')
        batch_op.drop_column('memory_base_location')
        batch_op.drop_column('memory_location')
        batch_op.drop_column('vmstate_format')
