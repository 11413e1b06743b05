"""Registered teams: create, find by a name's forms, list with their members, delete; the cap on a
verified member's live leases per address."""

from __future__ import annotations

from sqlalchemy import Connection, Row, delete, func, insert, or_, select, update

from coordinator.models import Team, Worker


def insert_team(c: Connection, *, name: str, keys: tuple[str, ...], key_hash: str,
                max_leases_per_address: int | None) -> int:
    return c.execute(insert(Team).values(name=name, name_key=keys[0], shape_key=keys[-1], key_hash=key_hash,
                                         max_leases_per_address=max_leases_per_address)
                     .returning(Team.id)).scalar_one()


def matching(c: Connection, keys: tuple[str, ...]) -> Row | None:
    """(id, name, key_hash, max_leases_per_address) of the registered team whose name shares one of
    the forms `keys` (names.name_keys), the oldest first."""
    return c.execute(select(Team.id, Team.name, Team.key_hash, Team.max_leases_per_address)
                     .where(or_(Team.name_key.in_(keys), Team.shape_key.in_(keys))).order_by(Team.id)).first()


def listed(c: Connection) -> list[Row]:
    """(id, name, max_leases_per_address, created_at, members) of every registered team, by name;
    members: its verified workers in every run, revoked ones left out."""
    members = (select(Worker.team_id, func.count().label("n")).where(Worker.revoked.is_(False))
               .group_by(Worker.team_id).subquery())
    return list(c.execute(select(Team.id, Team.name, Team.max_leases_per_address, Team.created_at,
                                 func.coalesce(members.c.n, 0))
                          .outerjoin(members, members.c.team_id == Team.id).order_by(Team.name)))


def remove(c: Connection, team_id: int) -> int:
    """Delete a team; its members stay, unverified, under its name as a label. Returns them."""
    n = c.execute(update(Worker).where(Worker.team_id == team_id).values(team_id=None)).rowcount
    c.execute(delete(Team).where(Team.id == team_id))
    return n


def lease_cap(c: Connection, team_id: int) -> int | None:
    """The team's own cap on its members' live leases per address (None: the coordinator's)."""
    return c.scalar(select(Team.max_leases_per_address).where(Team.id == team_id))
