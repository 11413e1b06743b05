"""abuse guards: lease address and progress, refusals, delta content index

leases.client and leases.progress_step let the coordinator cap leases per address and require
progress for a renewal (shard hoarding); refusals records requests refused for the worker's own
doing, which count toward throttle and ban; ix_deltas_content finds an identical delta already
delivered to the run (merged once per run).

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-03 06:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op


revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('leases', schema=None) as batch_op:
        batch_op.add_column(sa.Column('client', sa.String(length=64), nullable=True))
        batch_op.add_column(sa.Column('progress_step', sa.Integer(), nullable=False, server_default='0'))
        batch_op.create_index('ix_leases_client', ['client'], unique=False)
    with op.batch_alter_table('deltas', schema=None) as batch_op:
        batch_op.create_index('ix_deltas_content', ['run_id', 'sha256'], unique=False)
    op.create_table(
        'refusals',
        sa.Column('id', sa.Integer(), nullable=False),
        sa.Column('run_id', sa.Integer(), nullable=False),
        sa.Column('worker_id', sa.Integer(), nullable=False),
        sa.Column('kind', sa.String(length=16), nullable=False),
        sa.Column('reason', sa.Text(), nullable=False),
        sa.Column('at', sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(['run_id'], ['runs.id']),
        sa.ForeignKeyConstraint(['worker_id'], ['workers.id']),
        sa.PrimaryKeyConstraint('id'),
    )
    op.create_index('ix_refusals_worker', 'refusals', ['worker_id', 'id'], unique=False)


def downgrade() -> None:
    op.drop_index('ix_refusals_worker', table_name='refusals')
    op.drop_table('refusals')
    with op.batch_alter_table('deltas', schema=None) as batch_op:
        batch_op.drop_index('ix_deltas_content')
    with op.batch_alter_table('leases', schema=None) as batch_op:
        batch_op.drop_index('ix_leases_client')
        batch_op.drop_column('progress_step')
        batch_op.drop_column('client')
