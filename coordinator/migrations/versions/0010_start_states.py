"""start states: a sampled lease's commitment to the state its round started from

spot_checks.state_sha256 and state_bytes are what the worker's upload said of its round's start
state (its AdamW state and error-feedback residual: shared/algorithms/start_state.py), NULL when it
said nothing (a worker of API 4 or older, or a run without the commitment); state_received_at is
when the bytes arrived and matched, NULL until then.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-07 15:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op


revision = '0010'
down_revision = '0009'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('spot_checks', schema=None) as batch_op:
        batch_op.add_column(sa.Column('state_sha256', sa.String(length=64), nullable=True))
        batch_op.add_column(sa.Column('state_bytes', sa.BigInteger(), nullable=True))
        batch_op.add_column(sa.Column('state_received_at', sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('spot_checks', schema=None) as batch_op:
        batch_op.drop_column('state_received_at')
        batch_op.drop_column('state_bytes')
        batch_op.drop_column('state_sha256')
