"""exchange scale and delta voice: what robust merging decided, kept for the replay

exchanges.centre_scale is the factor the coordinator scaled an exchange's step of the global model by
so that its predicted loss increase stayed within the guard's budget (shared/algorithms/exchange_screen.py);
a restart replays it as recorded. Rows from before it (NULL) replay at 1. deltas.voice is the voice a
delta speaks in (coordinator/voices.py: tokens of one address share one); NULL, the worker's own.


Revision ID: 0009
Revises: 0007
Create Date: 2026-12-04 23:10:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op


revision = '0009'
down_revision = '0007'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('exchanges', schema=None) as batch_op:
        batch_op.add_column(sa.Column('centre_scale', sa.Float(), nullable=True))
    with op.batch_alter_table('deltas', schema=None) as batch_op:
        batch_op.add_column(sa.Column('voice', sa.String(length=32), nullable=True))
        batch_op.create_index('ix_deltas_voice', ['run_id', 'voice'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('deltas', schema=None) as batch_op:
        batch_op.drop_index('ix_deltas_voice')
        batch_op.drop_column('voice')
    with op.batch_alter_table('exchanges', schema=None) as batch_op:
        batch_op.drop_column('centre_scale')
