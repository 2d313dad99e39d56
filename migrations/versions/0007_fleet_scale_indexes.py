"""Indexes a node holding ten thousand sandboxes needs

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-06 18:30:00

- ix_sandboxes_started_at_id (sandboxes.started_at, id): the order of GET /v2/sandboxes and its keyset
  (x-next-token); a page reads its rows from the index from the token on, instead of sorting every sandbox.
- ix_snapshots_memory_base_layer: every collection that removes something recomputes layers.refcount with
  one correlated count of snapshots naming the layer as their memory base per layer; without it each count
  scanned every snapshot (layers x snapshots: minutes, holding the write lock, with 10,000 paused sandboxes).
"""
from typing import Sequence, Union

from alembic import op

revision: str = '0007'
down_revision: Union[str, None] = '0006'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    with op.batch_alter_table('sandboxes', schema=None) as batch_op:
        batch_op.create_index('ix_sandboxes_started_at_id', ['started_at', 'id'], unique=False)
    with op.batch_alter_table('snapshots', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_snapshots_memory_base_layer'), ['memory_base_layer'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('snapshots', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_snapshots_memory_base_layer'))
    with op.batch_alter_table('sandboxes', schema=None) as batch_op:
        batch_op.drop_index('ix_sandboxes_started_at_id')
