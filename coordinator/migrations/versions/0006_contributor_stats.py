"""contributor stats: claimed contributor names, per-day contribution

contributors holds each run's claimed contributor names (their folded form unique per run, and the
hash of the key that adds a machine under one); workers.contributor_id links a worker to its name;
daily_stats holds each worker's tokens, deltas and credit per UTC day, moved with its ledger.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-03 10:22:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op


revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'contributors',
        sa.Column('id', sa.Integer(), nullable=False),
        sa.Column('run_id', sa.Integer(), nullable=False),
        sa.Column('name', sa.String(length=64), nullable=False),
        sa.Column('name_key', sa.String(length=256), nullable=False),
        sa.Column('key_hash', sa.String(length=64), nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(['run_id'], ['runs.id']),
        sa.PrimaryKeyConstraint('id'),
        sa.UniqueConstraint('run_id', 'name_key'),
    )
    with op.batch_alter_table('workers', schema=None) as batch_op:
        batch_op.add_column(sa.Column('contributor_id', sa.Integer(), nullable=True))
        batch_op.create_foreign_key('fk_workers_contributor_id', 'contributors', ['contributor_id'], ['id'])
    op.create_table(
        'daily_stats',
        sa.Column('run_id', sa.Integer(), nullable=False),
        sa.Column('day', sa.Date(), nullable=False),
        sa.Column('worker_id', sa.Integer(), nullable=False),
        sa.Column('tokens', sa.BigInteger(), nullable=False),
        sa.Column('deltas_accepted', sa.Integer(), nullable=False),
        sa.Column('deltas_rejected', sa.Integer(), nullable=False),
        sa.Column('credit', sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(['run_id'], ['runs.id']),
        sa.ForeignKeyConstraint(['worker_id'], ['workers.id']),
        sa.PrimaryKeyConstraint('run_id', 'day', 'worker_id'),
    )
    op.create_index('ix_daily_stats_worker', 'daily_stats', ['worker_id', 'day'], unique=False)


def downgrade() -> None:
    op.drop_index('ix_daily_stats_worker', table_name='daily_stats')
    op.drop_table('daily_stats')
    with op.batch_alter_table('workers', schema=None) as batch_op:
        batch_op.drop_constraint('fk_workers_contributor_id', type_='foreignkey')
        batch_op.drop_column('contributor_id')
    op.drop_table('contributors')
