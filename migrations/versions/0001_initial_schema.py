"""initial schema: templates, sandboxes, snapshots, layers, cache, slots, events

Revision ID: 0001
Revises: 
Create Date: 2026-11-29 15:23:59.074019
"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa

revision: str = '0001'
down_revision: Union[str, None] = None
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None

def upgrade() -> None:

    op.create_table('cache_entries',
    sa.Column('layer_digest', sa.String(length=71), nullable=False),
    sa.Column('path', sa.Text(), nullable=False),
    sa.Column('size_bytes', sa.Integer(), nullable=False),
    sa.Column('cached_bytes', sa.Integer(), nullable=False),
    sa.Column('hits', sa.Integer(), nullable=False),
    sa.Column('misses', sa.Integer(), nullable=False),
    sa.Column('fetched_bytes', sa.Integer(), nullable=False),
    sa.Column('evicted_bytes', sa.Integer(), nullable=False),
    sa.Column('created_at', sa.String(length=24), nullable=False),
    sa.Column('last_access_at', sa.String(length=24), nullable=False),
    sa.PrimaryKeyConstraint('layer_digest', name=op.f('pk_cache_entries'))
    )
    with op.batch_alter_table('cache_entries', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_cache_entries_last_access_at'), ['last_access_at'], unique=False)

    op.create_table('events',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('ts', sa.String(length=24), nullable=False),
    sa.Column('sandbox_id', sa.String(length=64), nullable=True),
    sa.Column('subject', sa.String(length=16), nullable=False),
    sa.Column('subject_id', sa.String(length=64), nullable=True),
    sa.Column('operation', sa.String(length=32), nullable=False),
    sa.Column('from_state', sa.String(length=16), nullable=True),
    sa.Column('to_state', sa.String(length=16), nullable=True),
    sa.Column('duration_ms', sa.Float(), nullable=True),
    sa.Column('error', sa.Text(), nullable=True),
    sa.Column('detail', sa.JSON(), nullable=True),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_events'))
    )
    with op.batch_alter_table('events', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_events_operation'), ['operation'], unique=False)
        batch_op.create_index('ix_events_sandbox_id_ts', ['sandbox_id', 'ts'], unique=False)
        batch_op.create_index(batch_op.f('ix_events_ts'), ['ts'], unique=False)

    op.create_table('layers',
    sa.Column('digest', sa.String(length=71), nullable=False),
    sa.Column('kind', sa.String(length=8), nullable=False),
    sa.Column('size_bytes', sa.Integer(), nullable=False),
    sa.Column('virtual_size_bytes', sa.Integer(), nullable=False),
    sa.Column('location', sa.Text(), nullable=False),
    sa.Column('refcount', sa.Integer(), nullable=False),
    sa.Column('created_at', sa.String(length=24), nullable=False),
    sa.PrimaryKeyConstraint('digest', name=op.f('pk_layers'))
    )
    op.create_table('network_slots',
    sa.Column('slot_index', sa.Integer(), autoincrement=False, nullable=False),
    sa.Column('netns', sa.String(length=64), nullable=False),
    sa.Column('host_ip', sa.String(length=45), nullable=False),
    sa.Column('slot_ip', sa.String(length=45), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('sandbox_id', sa.String(length=64), nullable=True),
    sa.Column('updated_at', sa.String(length=24), nullable=False),
    sa.PrimaryKeyConstraint('slot_index', name=op.f('pk_network_slots'))
    )
    with op.batch_alter_table('network_slots', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_network_slots_sandbox_id'), ['sandbox_id'], unique=False)

    op.create_table('nodes',
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('hostname', sa.String(length=255), nullable=False),
    sa.Column('listen', sa.String(length=255), nullable=False),
    sa.Column('version', sa.String(length=32), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('started_at', sa.String(length=24), nullable=False),
    sa.Column('heartbeat_at', sa.String(length=24), nullable=False),
    sa.Column('stopped_at', sa.String(length=24), nullable=True),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_nodes'))
    )
    op.create_table('snapshots',
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('kind', sa.String(length=16), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('name', sa.String(length=128), nullable=True),
    sa.Column('parent_id', sa.String(length=64), nullable=True),
    sa.Column('source_sandbox_id', sa.String(length=64), nullable=True),
    sa.Column('template_id', sa.String(length=64), nullable=True),
    sa.Column('vmm', sa.String(length=16), nullable=False),
    sa.Column('vmstate_location', sa.Text(), nullable=True),
    sa.Column('config', sa.JSON(), nullable=False),
    sa.Column('memory_mb', sa.Integer(), nullable=False),
    sa.Column('created_at', sa.String(length=24), nullable=False),
    sa.Column('committed_at', sa.String(length=24), nullable=True),
    sa.ForeignKeyConstraint(['parent_id'], ['snapshots.id'], name=op.f('fk_snapshots_parent_id_snapshots'), ondelete='SET NULL'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_snapshots'))
    )
    with op.batch_alter_table('snapshots', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_snapshots_parent_id'), ['parent_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_snapshots_source_sandbox_id'), ['source_sandbox_id'], unique=False)

    op.create_table('sandboxes',
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('template_id', sa.String(length=64), nullable=False),
    sa.Column('node_id', sa.String(length=64), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('client_id', sa.String(length=64), nullable=False),
    sa.Column('alias', sa.String(length=128), nullable=True),
    sa.Column('cpu_count', sa.Integer(), nullable=False),
    sa.Column('memory_mb', sa.Integer(), nullable=False),
    sa.Column('disk_size_mb', sa.Integer(), nullable=False),
    sa.Column('envd_version', sa.String(length=32), nullable=False),
    sa.Column('envd_access_token', sa.String(length=128), nullable=True),
    sa.Column('traffic_access_token', sa.String(length=128), nullable=True),
    sa.Column('metadata', sa.JSON(), nullable=False),
    sa.Column('env_vars', sa.JSON(), nullable=False),
    sa.Column('auto_pause', sa.Boolean(), nullable=False),
    sa.Column('auto_resume', sa.Boolean(), nullable=False),
    sa.Column('secure', sa.Boolean(), nullable=False),
    sa.Column('allow_internet_access', sa.Boolean(), nullable=False),
    sa.Column('network_policy', sa.JSON(), nullable=False),
    sa.Column('snapshot_id', sa.String(length=64), nullable=True),
    sa.Column('parent_sandbox_id', sa.String(length=64), nullable=True),
    sa.Column('slot_index', sa.Integer(), nullable=True),
    sa.Column('vmm', sa.String(length=16), nullable=False),
    sa.Column('vmm_pid', sa.Integer(), nullable=True),
    sa.Column('workdir', sa.Text(), nullable=True),
    sa.Column('started_at', sa.String(length=24), nullable=False),
    sa.Column('end_at', sa.String(length=24), nullable=False),
    sa.Column('paused_at', sa.String(length=24), nullable=True),
    sa.Column('killed_at', sa.String(length=24), nullable=True),
    sa.Column('updated_at', sa.String(length=24), nullable=False),
    sa.Column('error', sa.Text(), nullable=True),
    sa.ForeignKeyConstraint(['snapshot_id'], ['snapshots.id'], name=op.f('fk_sandboxes_snapshot_id_snapshots'), ondelete='SET NULL'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_sandboxes'))
    )
    with op.batch_alter_table('sandboxes', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_sandboxes_end_at'), ['end_at'], unique=False)
        batch_op.create_index(batch_op.f('ix_sandboxes_state'), ['state'], unique=False)
        batch_op.create_index(batch_op.f('ix_sandboxes_template_id'), ['template_id'], unique=False)

    op.create_table('templates',
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('alias', sa.String(length=128), nullable=True),
    sa.Column('kind', sa.String(length=16), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('cpu_count', sa.Integer(), nullable=False),
    sa.Column('memory_mb', sa.Integer(), nullable=False),
    sa.Column('disk_size_mb', sa.Integer(), nullable=False),
    sa.Column('envd_version', sa.String(length=32), nullable=False),
    sa.Column('boot_snapshot_id', sa.String(length=64), nullable=True),
    sa.Column('created_at', sa.String(length=24), nullable=False),
    sa.Column('updated_at', sa.String(length=24), nullable=False),
    sa.ForeignKeyConstraint(['boot_snapshot_id'], ['snapshots.id'], name=op.f('fk_templates_boot_snapshot_id_snapshots'), ondelete='SET NULL'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_templates')),
    sa.UniqueConstraint('alias', name=op.f('uq_templates_alias'))
    )
    op.create_table('snapshot_layers',
    sa.Column('snapshot_id', sa.String(length=64), nullable=False),
    sa.Column('kind', sa.String(length=8), nullable=False),
    sa.Column('position', sa.Integer(), nullable=False),
    sa.Column('layer_digest', sa.String(length=71), nullable=False),
    sa.ForeignKeyConstraint(['layer_digest'], ['layers.digest'], name=op.f('fk_snapshot_layers_layer_digest_layers')),
    sa.ForeignKeyConstraint(['snapshot_id'], ['snapshots.id'], name=op.f('fk_snapshot_layers_snapshot_id_snapshots'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('snapshot_id', 'kind', 'position', name=op.f('pk_snapshot_layers'))
    )
    with op.batch_alter_table('snapshot_layers', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_snapshot_layers_layer_digest'), ['layer_digest'], unique=False)

    op.create_table('template_builds',
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('template_id', sa.String(length=64), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('source', sa.Text(), nullable=False),
    sa.Column('kit_hash', sa.String(length=64), nullable=False),
    sa.Column('started_at', sa.String(length=24), nullable=False),
    sa.Column('finished_at', sa.String(length=24), nullable=True),
    sa.Column('duration_ms', sa.Float(), nullable=True),
    sa.Column('error', sa.Text(), nullable=True),
    sa.Column('log_path', sa.Text(), nullable=True),
    sa.ForeignKeyConstraint(['template_id'], ['templates.id'], name=op.f('fk_template_builds_template_id_templates'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_template_builds'))
    )
    with op.batch_alter_table('template_builds', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_template_builds_template_id'), ['template_id'], unique=False)

def downgrade() -> None:

    with op.batch_alter_table('template_builds', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_template_builds_template_id'))

    op.drop_table('template_builds')
    with op.batch_alter_table('snapshot_layers', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_snapshot_layers_layer_digest'))

    op.drop_table('snapshot_layers')
    op.drop_table('templates')
    with op.batch_alter_table('snapshots', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_snapshots_source_sandbox_id'))
        batch_op.drop_index(batch_op.f('ix_snapshots_parent_id'))

    op.drop_table('snapshots')
    with op.batch_alter_table('sandboxes', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_sandboxes_template_id'))
        batch_op.drop_index(batch_op.f('ix_sandboxes_state'))
        batch_op.drop_index(batch_op.f('ix_sandboxes_end_at'))

    op.drop_table('sandboxes')
    op.drop_table('nodes')
    with op.batch_alter_table('network_slots', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_network_slots_sandbox_id'))

    op.drop_table('network_slots')
    op.drop_table('layers')
    with op.batch_alter_table('events', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_events_ts'))
        batch_op.drop_index('ix_events_sandbox_id_ts')
        batch_op.drop_index(batch_op.f('ix_events_operation'))

    op.drop_table('events')
    with op.batch_alter_table('cache_entries', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_cache_entries_last_access_at'))

    op.drop_table('cache_entries')

