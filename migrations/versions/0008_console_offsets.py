"""Console read offsets in the state

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-07 01:30:00

- console_offsets: how far the node has read a sandbox run's console into sandbox_logs, written in the
  transaction that stores those lines (it was a file beside the console, written after the lines' commit: a
  node killed between the two stored a round's lines twice when it took the run over).
"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa

revision: str = '0008'
down_revision: Union[str, None] = '0007'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    op.create_table('console_offsets',
    sa.Column('sandbox_id', sa.String(length=64), nullable=False),
    sa.Column('run', sa.Text(), nullable=False),
    sa.Column('bytes_read', sa.Integer(), nullable=False),
    sa.ForeignKeyConstraint(['sandbox_id'], ['sandboxes.id'], name=op.f('fk_console_offsets_sandbox_id_sandboxes'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('sandbox_id', name=op.f('pk_console_offsets'))
    )


def downgrade() -> None:
    op.drop_table('console_offsets')
