"""OCI images and converted layers

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-02 07:31:49

- images: one row per OCI image pulled (its manifest digest, canonical name, config and top chain).
- image_layers: the block layer converted from each OCI layer, keyed by its chain id, so images sharing base
  layers share block layers and a second pull of a shared base converts nothing.
- template_builds.source_digest: the manifest digest an OCI source resolved to.

New tables and a nullable column: existing rows need nothing; downgrade drops them.
"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa

revision: str = '0003'
down_revision: Union[str, None] = '0002'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    op.create_table('images',
    sa.Column('digest', sa.String(length=71), nullable=False),
    sa.Column('canonical', sa.Text(), nullable=False),
    sa.Column('reference', sa.Text(), nullable=False),
    sa.Column('config', sa.JSON(), nullable=False),
    sa.Column('layer_count', sa.Integer(), nullable=False),
    sa.Column('compressed_bytes', sa.Integer(), nullable=False),
    sa.Column('top_chain_id', sa.String(length=64), nullable=True),
    sa.Column('pulled_at', sa.String(length=24), nullable=False),
    sa.PrimaryKeyConstraint('digest', name=op.f('pk_images'))
    )
    op.create_table('image_layers',
    sa.Column('chain_id', sa.String(length=64), nullable=False),
    sa.Column('parent_chain_id', sa.String(length=64), nullable=True),
    sa.Column('diff_id', sa.String(length=128), nullable=False),
    sa.Column('layer_digest', sa.String(length=71), nullable=False),
    sa.Column('first_source', sa.Text(), nullable=False),
    sa.Column('convert_ms', sa.Float(), nullable=True),
    sa.Column('created_at', sa.String(length=24), nullable=False),
    sa.ForeignKeyConstraint(['layer_digest'], ['layers.digest'], name=op.f('fk_image_layers_layer_digest_layers')),
    sa.PrimaryKeyConstraint('chain_id', name=op.f('pk_image_layers'))
    )
    with op.batch_alter_table('image_layers', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_image_layers_layer_digest'), ['layer_digest'], unique=False)

    with op.batch_alter_table('template_builds', schema=None) as batch_op:
        batch_op.add_column(sa.Column('source_digest', sa.String(length=71), nullable=True))



def downgrade() -> None:
    with op.batch_alter_table('template_builds', schema=None) as batch_op:
        batch_op.drop_column('source_digest')

    with op.batch_alter_table('image_layers', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_image_layers_layer_digest'))

    op.drop_table('image_layers')
    op.drop_table('images')
