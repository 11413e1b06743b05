"""compensations, and what a sparta round's spot-check replays

deltas.applied is what merging a delta moved each weight by per unit of its values (its merge weight
times its group's share of the outer lr); NULL for deltas merged before it was recorded.
compensations holds each merged delta found false afterwards: the merger applies its negation just
before it merges `before_version` (NULL until then), and a restart's replay does the same there.
exchanges.answer keeps the correction answered to a lease sampled for its spot-check, and
spot_checks.exchanges_applied where its worker applied each (a sparta round's replay needs both).

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-07 18:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op


revision = '0011'
down_revision = '0010'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('deltas', schema=None) as batch_op:
        batch_op.add_column(sa.Column('applied', sa.Float(), nullable=True))
    with op.batch_alter_table('exchanges', schema=None) as batch_op:
        batch_op.add_column(sa.Column('answer', sa.LargeBinary(), nullable=True))
    with op.batch_alter_table('spot_checks', schema=None) as batch_op:
        batch_op.add_column(sa.Column('exchanges_applied', sa.Text(), nullable=True))
    op.create_table(
        'compensations',
        sa.Column('id', sa.Integer(), nullable=False),
        sa.Column('run_id', sa.Integer(), nullable=False),
        sa.Column('seq', sa.BigInteger(), nullable=False),
        sa.Column('applied', sa.Float(), nullable=False),
        sa.Column('reason', sa.Text(), nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('before_version', sa.BigInteger(), nullable=True),
        sa.ForeignKeyConstraint(['run_id'], ['runs.id']),
        sa.PrimaryKeyConstraint('id'),
        sa.UniqueConstraint('run_id', 'seq'),
    )
    with op.batch_alter_table('compensations', schema=None) as batch_op:
        batch_op.create_index('ix_compensations_pending', ['run_id', 'before_version'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('compensations', schema=None) as batch_op:
        batch_op.drop_index('ix_compensations_pending')
    op.drop_table('compensations')
    with op.batch_alter_table('spot_checks', schema=None) as batch_op:
        batch_op.drop_column('exchanges_applied')
    with op.batch_alter_table('exchanges', schema=None) as batch_op:
        batch_op.drop_column('answer')
    with op.batch_alter_table('deltas', schema=None) as batch_op:
        batch_op.drop_column('applied')
