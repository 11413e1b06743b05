"""credit checks: the replay spot-checks of sampled leases

spot_checks holds each delivered lease sampled for a replay (coordinator/spotcheck.py): pending until
the coordinator re-trained its round, then passed, failed (with the credit it revoked) or skipped.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-03 10:21:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op


revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'spot_checks',
        sa.Column('id', sa.Integer(), nullable=False),
        sa.Column('run_id', sa.Integer(), nullable=False),
        sa.Column('lease_id', sa.Integer(), nullable=False),
        sa.Column('worker_id', sa.Integer(), nullable=False),
        sa.Column('base_version', sa.BigInteger(), nullable=False),
        sa.Column('verdict', sa.String(length=16), nullable=False),
        sa.Column('cosine', sa.Float(), nullable=True),
        sa.Column('norm_ratio', sa.Float(), nullable=True),
        sa.Column('reason', sa.Text(), nullable=True),
        sa.Column('credit_revoked', sa.Float(), nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('at', sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(['lease_id'], ['leases.id']),
        sa.ForeignKeyConstraint(['run_id'], ['runs.id']),
        sa.ForeignKeyConstraint(['worker_id'], ['workers.id']),
        sa.PrimaryKeyConstraint('id'),
        sa.UniqueConstraint('lease_id'),
    )
    with op.batch_alter_table('spot_checks', schema=None) as batch_op:
        batch_op.create_index('ix_spot_checks_pending', ['run_id', 'verdict'], unique=False)
        batch_op.create_index(batch_op.f('ix_spot_checks_worker_id'), ['worker_id'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('spot_checks', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_spot_checks_worker_id'))
        batch_op.drop_index('ix_spot_checks_pending')
    op.drop_table('spot_checks')
