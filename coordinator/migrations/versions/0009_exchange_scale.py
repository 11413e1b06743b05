"""exchange scale: the share of its centre step an exchange kept under the descent guard

exchanges.centre_scale is the factor the coordinator scaled an exchange's step of the global model by
so that its predicted loss increase stayed within the guard's budget (shared/algorithms/exchange_screen.py);
a restart replays it as recorded. Rows from before it (NULL) replay at 1.

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


def downgrade() -> None:
    with op.batch_alter_table('exchanges', schema=None) as batch_op:
        batch_op.drop_column('centre_scale')
