"""Template tags, a build's snapshot and failed step, converted-layer cache expiry

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-02 12:10:00

- template_tags: (template, tag) -> the ready build it names; `default` is what a bare name means.
- template_builds.tags: the tags a build takes when it succeeds; template_builds.snapshot_id: the boot
  snapshot it made; template_builds.error_step: where a failed build stopped (base, 1..N, finalize).
- image_layers.last_used_at: when a build last used a converted layer (rows unused for
  images.layer_cache_ttl_s expire).

Existing ready builds get their template's current snapshot and the tag `default` when they are the build that
made it (the latest ready one); existing converted layers count as used at their creation.
"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa

revision: str = '0004'
down_revision: Union[str, None] = '0003'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    with op.batch_alter_table('template_builds', schema=None) as batch_op:
        batch_op.add_column(sa.Column('error_step', sa.String(length=16), nullable=True))
        batch_op.add_column(sa.Column('tags', sa.JSON(), nullable=False, server_default='[]'))
        batch_op.add_column(sa.Column('snapshot_id', sa.String(length=64), nullable=True))
        batch_op.create_foreign_key(batch_op.f('fk_template_builds_snapshot_id_snapshots'), 'snapshots',
                                    ['snapshot_id'], ['id'], ondelete='SET NULL')
    with op.batch_alter_table('template_builds', schema=None) as batch_op:
        batch_op.alter_column('tags', server_default=None)
    op.create_table('template_tags',
    sa.Column('template_id', sa.String(length=64), nullable=False),
    sa.Column('tag', sa.String(length=128), nullable=False),
    sa.Column('build_id', sa.String(length=64), nullable=False),
    sa.Column('created_at', sa.String(length=24), nullable=False),
    sa.ForeignKeyConstraint(['build_id'], ['template_builds.id'], name=op.f('fk_template_tags_build_id_template_builds'),
                            ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['template_id'], ['templates.id'], name=op.f('fk_template_tags_template_id_templates'),
                            ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('template_id', 'tag', name=op.f('pk_template_tags'))
    )
    with op.batch_alter_table('template_tags', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_template_tags_build_id'), ['build_id'], unique=False)
    with op.batch_alter_table('image_layers', schema=None) as batch_op:
        batch_op.add_column(sa.Column('last_used_at', sa.String(length=24), nullable=True))
    op.execute("UPDATE image_layers SET last_used_at = created_at")
    with op.batch_alter_table('image_layers', schema=None) as batch_op:
        batch_op.alter_column('last_used_at', nullable=False)
    # the latest ready build of each template made its current snapshot: it gets it, and the tag `default`
    op.execute("""
        UPDATE template_builds SET snapshot_id = (SELECT t.boot_snapshot_id FROM templates t
                                                  WHERE t.id = template_builds.template_id)
        WHERE status = 'ready' AND id = (SELECT b.id FROM template_builds b
                                         WHERE b.template_id = template_builds.template_id AND b.status = 'ready'
                                         ORDER BY b.started_at DESC LIMIT 1)
    """)
    op.execute("""
        INSERT INTO template_tags (template_id, tag, build_id, created_at)
        SELECT template_id, 'default', id, COALESCE(finished_at, started_at) FROM template_builds
        WHERE snapshot_id IS NOT NULL
    """)


def downgrade() -> None:
    with op.batch_alter_table('image_layers', schema=None) as batch_op:
        batch_op.drop_column('last_used_at')
    with op.batch_alter_table('template_tags', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_template_tags_build_id'))
    op.drop_table('template_tags')
    with op.batch_alter_table('template_builds', schema=None) as batch_op:
        batch_op.drop_constraint(batch_op.f('fk_template_builds_snapshot_id_snapshots'), type_='foreignkey')
        batch_op.drop_column('snapshot_id')
        batch_op.drop_column('tags')
        batch_op.drop_column('error_step')
