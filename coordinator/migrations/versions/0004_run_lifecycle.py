"""run lifecycle: token budget, epoch limit, priority, finish times

runs.token_budget and runs.max_epochs say when a run finishes (None: no limit); runs.priority orders
the active runs a worker following the whole coordinator (a project) trains; runs.finished_at is
when it reached `finished`; runs.finish_by, while it is `finishing`, when the leases still out are
given up (`run finish --grace`).

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-03 10:20:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op


revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('runs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('token_budget', sa.BigInteger(), nullable=True))
        batch_op.add_column(sa.Column('max_epochs', sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column('priority', sa.Integer(), nullable=False, server_default='0'))
        batch_op.add_column(sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column('finish_by', sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('runs', schema=None) as batch_op:
        batch_op.drop_column('finish_by')
        batch_op.drop_column('finished_at')
        batch_op.drop_column('priority')
        batch_op.drop_column('max_epochs')
        batch_op.drop_column('token_budget')
