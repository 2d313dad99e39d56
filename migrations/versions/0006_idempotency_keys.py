"""Idempotency keys of sandbox creates

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-02 17:04:47

- idempotency_keys: a create's Idempotency-Key header -> the sandbox it made and a hash of its request, so a
  retry gets that sandbox back; removed with its sandbox, expired after a day.
"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa

revision: str = '0006'
down_revision: Union[str, None] = '0005'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    op.create_table('idempotency_keys',
    sa.Column('key', sa.String(length=255), nullable=False),
    sa.Column('request_hash', sa.String(length=64), nullable=False),
    sa.Column('sandbox_id', sa.String(length=64), nullable=False),
    sa.Column('created_at', sa.String(length=24), nullable=False),
    sa.ForeignKeyConstraint(['sandbox_id'], ['sandboxes.id'], name=op.f('fk_idempotency_keys_sandbox_id_sandboxes'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('key', name=op.f('pk_idempotency_keys'))
    )
    with op.batch_alter_table('idempotency_keys', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_idempotency_keys_created_at'), ['created_at'], unique=False)
        batch_op.create_index(batch_op.f('ix_idempotency_keys_sandbox_id'), ['sandbox_id'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('idempotency_keys', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_idempotency_keys_sandbox_id'))
        batch_op.drop_index(batch_op.f('ix_idempotency_keys_created_at'))
    op.drop_table('idempotency_keys')
