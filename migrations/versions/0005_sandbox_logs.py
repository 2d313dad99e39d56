"""Sandbox logs: the guest console and envd lines E2B's logs routes serve

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-02 16:48:27

- sandbox_logs: one row per line (ts, level, source, logger, message), removed with its sandbox; the index on
  (sandbox_id, ts) serves the routes' cursor and the per-sandbox bound (oldest lines dropped first).
"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa

revision: str = '0005'
down_revision: Union[str, None] = '0004'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    op.create_table('sandbox_logs',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('sandbox_id', sa.String(length=64), nullable=False),
    sa.Column('ts', sa.String(length=24), nullable=False),
    sa.Column('level', sa.String(length=8), nullable=False),
    sa.Column('source', sa.String(length=16), nullable=False),
    sa.Column('logger', sa.String(length=64), nullable=True),
    sa.Column('message', sa.Text(), nullable=False),
    sa.ForeignKeyConstraint(['sandbox_id'], ['sandboxes.id'], name=op.f('fk_sandbox_logs_sandbox_id_sandboxes'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_sandbox_logs'))
    )
    with op.batch_alter_table('sandbox_logs', schema=None) as batch_op:
        batch_op.create_index('ix_sandbox_logs_sandbox_id_ts', ['sandbox_id', 'ts'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('sandbox_logs', schema=None) as batch_op:
        batch_op.drop_index('ix_sandbox_logs_sandbox_id_ts')
    op.drop_table('sandbox_logs')
