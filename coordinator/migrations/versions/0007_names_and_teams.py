"""names and teams: the forms a contributor name is compared in, registered teams

contributor_keys holds each contributor name's forms (coordinator/names.py: Unicode's confusable
skeletons of the name case-folded and as written), which replace contributors.name_key, its one
folded form; each existing name's forms are computed here with the names.py of this release. A
name that now shares a form with an older one keeps it at a seat of its own (its id), so both
names are kept and found and a new claim of that form is refused. teams holds the teams the
operator registered (a name taken only with its key, hashed, and an optional cap on its members'
live leases per address); workers.team_id marks a registered team's verified members.

Downgrading puts back one folded form per name (the case-folded one, `#id` appended where two
names share it): a coordinator of the release before compares names its own way from then on.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-05 10:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0007'
down_revision = '0006'
branch_labels = None
depends_on = None

_contributors = sa.table('contributors', sa.column('id', sa.Integer), sa.column('run_id', sa.Integer),
                         sa.column('name', sa.String), sa.column('name_key', sa.String))
_keys = sa.table('contributor_keys', sa.column('run_id', sa.Integer), sa.column('key', sa.String),
                 sa.column('seat', sa.Integer), sa.column('contributor_id', sa.Integer))


def _forms(name: str) -> tuple[str, ...]:
    from coordinator import names

    try:
        return names.name_keys(name)
    except ValueError:  # nothing left by this release's rules (only marks, say): the name itself, folded
        return (name.casefold()[:256],)


def upgrade() -> None:
    op.create_table(
        'teams',
        sa.Column('id', sa.Integer(), nullable=False),
        sa.Column('name', sa.String(length=64), nullable=False),
        sa.Column('name_key', sa.String(length=256), nullable=False),
        sa.Column('shape_key', sa.String(length=256), nullable=False),
        sa.Column('key_hash', sa.String(length=64), nullable=False),
        sa.Column('max_leases_per_address', sa.Integer(), nullable=True),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint('id'),
        sa.UniqueConstraint('name'),
        sa.UniqueConstraint('name_key'),
        sa.UniqueConstraint('shape_key'),
    )
    with op.batch_alter_table('workers', schema=None) as batch_op:
        batch_op.add_column(sa.Column('team_id', sa.Integer(), nullable=True))
        batch_op.create_foreign_key('fk_workers_team_id', 'teams', ['team_id'], ['id'])
        batch_op.create_index(batch_op.f('ix_workers_team_id'), ['team_id'], unique=False)
    op.create_table(
        'contributor_keys',
        sa.Column('run_id', sa.Integer(), nullable=False),
        sa.Column('key', sa.String(length=256), nullable=False),
        sa.Column('seat', sa.Integer(), nullable=False),
        sa.Column('contributor_id', sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(['contributor_id'], ['contributors.id']),
        sa.ForeignKeyConstraint(['run_id'], ['runs.id']),
        sa.PrimaryKeyConstraint('run_id', 'key', 'seat'),
    )
    with op.batch_alter_table('contributor_keys', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_contributor_keys_contributor_id'), ['contributor_id'], unique=False)
    conn = op.get_bind()
    held: set[tuple[int, str]] = set()
    rows = []
    for cid, run_id, name in conn.execute(sa.select(_contributors.c.id, _contributors.c.run_id,
                                                    _contributors.c.name).order_by(_contributors.c.id)):
        for key in _forms(name):
            rows.append({"run_id": run_id, "key": key, "seat": cid if (run_id, key) in held else 0,
                         "contributor_id": cid})
            held.add((run_id, key))
    if rows:
        conn.execute(_keys.insert(), rows)
    # the column's unique (run_id, name_key) goes with it: PostgreSQL drops a dropped column's
    # constraints, SQLite's batch rebuild leaves out those over a column it no longer has
    with op.batch_alter_table('contributors', schema=None) as batch_op:
        batch_op.drop_column('name_key')


def downgrade() -> None:
    with op.batch_alter_table('contributors', schema=None) as batch_op:
        batch_op.add_column(sa.Column('name_key', sa.String(length=256), nullable=True))
    conn = op.get_bind()
    taken: set[tuple[int, str]] = set()
    for cid, run_id, name in conn.execute(sa.select(_contributors.c.id, _contributors.c.run_id,
                                                    _contributors.c.name).order_by(_contributors.c.id)):
        key = _forms(name)[0]
        if (run_id, key) in taken:
            key = f"{key}#{cid}"
        taken.add((run_id, key))
        conn.execute(_contributors.update().where(_contributors.c.id == cid).values(name_key=key))
    with op.batch_alter_table('contributors', schema=None) as batch_op:
        batch_op.alter_column('name_key', existing_type=sa.String(length=256), nullable=False)
        batch_op.create_unique_constraint('uq_contributors_run_id_name_key', ['run_id', 'name_key'])
    with op.batch_alter_table('contributor_keys', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_contributor_keys_contributor_id'))
    op.drop_table('contributor_keys')
    with op.batch_alter_table('workers', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_workers_team_id'))
        batch_op.drop_constraint('fk_workers_team_id', type_='foreignkey')
        batch_op.drop_column('team_id')
    op.drop_table('teams')
