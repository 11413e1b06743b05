"""Contributors and daily stats: claimed names, each worker's contribution per UTC day, and the
aggregates of the stats routes (by contributor name or team, per day; the run's recent rate)."""

from __future__ import annotations

from datetime import date, datetime

from sqlalchemy import Connection, Row, delete, func, insert, null, select
from sqlalchemy.dialects import postgresql, sqlite

from coordinator.models import Contributor, ContributorKey, DailyStat, DeltaRecord, Worker

_INSERTS = {"postgresql": postgresql.insert, "sqlite": sqlite.insert}


def _insert(c: Connection, table):
    """INSERT with ON CONFLICT for this connection's dialect (PostgreSQL and SQLite both have it)."""
    return _INSERTS[c.dialect.name](table)


# -- contributors ---------------------------------------------------------------------------------

def holders(c: Connection, run_id: int, keys: tuple[str, ...]) -> list[Row]:
    """(id, name, key_hash) of the run's contributors holding any of the name forms `keys`, the
    one that holds them at seat 0 (the oldest) first."""
    return list(c.execute(select(Contributor.id, Contributor.name, Contributor.key_hash)
                          .join(ContributorKey, ContributorKey.contributor_id == Contributor.id)
                          .where(ContributorKey.run_id == run_id, ContributorKey.key.in_(keys))
                          .group_by(Contributor.id, Contributor.name, Contributor.key_hash)
                          .order_by(func.min(ContributorKey.seat), Contributor.id)))


def claim(c: Connection, *, run_id: int, name: str, keys: tuple[str, ...], key_hash: str) -> int | None:
    """Claim a name for the run with its forms `keys`: its new contributor's id, or None when one of
    them is already held (by a concurrent registration too: the (run_id, key, seat) key decides, in
    any process; forms are taken in sorted order, so two claims never wait on each other)."""
    contributor_id = c.execute(insert(Contributor).values(run_id=run_id, name=name, key_hash=key_hash)
                               .returning(Contributor.id)).scalar_one()
    for key in sorted(keys):
        held = c.execute(_insert(c, ContributorKey).values(run_id=run_id, key=key, seat=0,
                                                           contributor_id=contributor_id)
                         .on_conflict_do_nothing().returning(ContributorKey.key)).scalar()
        if held is None:  # taken: the claim is undone (no savepoint: SQLite's driver handles none well)
            c.execute(delete(ContributorKey).where(ContributorKey.contributor_id == contributor_id))
            c.execute(delete(Contributor).where(Contributor.id == contributor_id))
            return None
    return contributor_id


# -- moved with the ledger (queries/workers.py) ---------------------------------------------------

def bump(c: Connection, worker_id: int, day: date, *, tokens: int = 0, accepted: int = 0, rejected: int = 0,
         credit: float = 0.0) -> None:
    """Add to a worker's row of `day`, creating it: one statement, atomic in any process."""
    run_of = select(Worker.run_id).where(Worker.id == worker_id).scalar_subquery()
    stmt = _insert(c, DailyStat).values(run_id=run_of, day=day, worker_id=worker_id, tokens=tokens,
                                        deltas_accepted=accepted, deltas_rejected=rejected, credit=credit)
    c.execute(stmt.on_conflict_do_update(
        index_elements=["run_id", "day", "worker_id"],
        set_={"tokens": DailyStat.tokens + stmt.excluded.tokens,
              "deltas_accepted": DailyStat.deltas_accepted + stmt.excluded.deltas_accepted,
              "deltas_rejected": DailyStat.deltas_rejected + stmt.excluded.deltas_rejected,
              "credit": DailyStat.credit + stmt.excluded.credit}))


# -- the stats routes -----------------------------------------------------------------------------

def _sums():
    return (func.count(func.distinct(DailyStat.worker_id)), func.coalesce(func.sum(DailyStat.tokens), 0),
            func.coalesce(func.sum(DailyStat.deltas_accepted), 0),
            func.coalesce(func.sum(DailyStat.deltas_rejected), 0), func.coalesce(func.sum(DailyStat.credit), 0.0))


def daily(c: Connection, run_id: int, *, by_team: bool, since: date | None, until: date | None,
          limit: int) -> list[Row]:
    """(day, name, team, workers, tokens, accepted, rejected, credit) per day and contributor name
    and team (or per day and named team, name None), oldest day first, most credit first within
    a day; at most `limit` rows."""
    keys = (DailyStat.day, Worker.team) if by_team else (DailyStat.day, Worker.name, Worker.team)
    name = null().label("name") if by_team else Worker.name
    credit = func.coalesce(func.sum(DailyStat.credit), 0.0)
    q = (select(DailyStat.day, name, Worker.team, *_sums()).join(Worker, Worker.id == DailyStat.worker_id)
         .where(DailyStat.run_id == run_id).group_by(*keys))
    if by_team:
        q = q.where(Worker.team.is_not(None), Worker.team != "")
    if since is not None:
        q = q.where(DailyStat.day >= since)
    if until is not None:
        q = q.where(DailyStat.day <= until)
    q = q.order_by(DailyStat.day, credit.desc(), *keys[1:]).limit(limit)
    return list(c.execute(q))


def totals(c: Connection, run_id: int, *, until: date, only_day: bool, limit: int) -> list[Row]:
    """(name, team, workers, tokens, accepted, rejected, credit) per contributor name and team, of
    the day `until` (only_day) or of every day up to it; most credit first, at most `limit`."""
    credit = func.coalesce(func.sum(DailyStat.credit), 0.0)
    q = (select(Worker.name, Worker.team, *_sums()).join(Worker, Worker.id == DailyStat.worker_id)
         .where(DailyStat.run_id == run_id, DailyStat.day == until if only_day else DailyStat.day <= until)
         .group_by(Worker.name, Worker.team).order_by(credit.desc(), Worker.name, Worker.team).limit(limit))
    return list(c.execute(q))


def history(c: Connection, run_id: int, name: str) -> list[Row]:
    """(day, workers, tokens, accepted, rejected, credit) per day of the run's workers named `name`
    (a contributor's machines), oldest first."""
    ids = select(Worker.id).where(Worker.run_id == run_id, Worker.name == name)
    return list(c.execute(select(DailyStat.day, *_sums()).where(DailyStat.worker_id.in_(ids))
                          .group_by(DailyStat.day).order_by(DailyStat.day)))


def teams_of(c: Connection, run_id: int, name: str) -> list[str]:
    """The teams the run's workers named `name` declared."""
    return sorted(t for t in c.scalars(select(func.distinct(Worker.team)).where(
        Worker.run_id == run_id, Worker.name == name)) if t)


def recent_tokens(c: Connection, run_id: int, *, from_seq: int, since: datetime) -> tuple[int, int, datetime | None]:
    """(tokens, deltas, the oldest's received_at) of the run's deltas from sequence number `from_seq`
    received since `since` (by the (run_id, seq) index: bounded work whatever the history)."""
    tokens, n, oldest = c.execute(select(func.coalesce(func.sum(DeltaRecord.tokens), 0), func.count(),
                                         func.min(DeltaRecord.received_at)).where(
        DeltaRecord.run_id == run_id, DeltaRecord.seq >= from_seq, DeltaRecord.received_at >= since)).one()
    return int(tokens), int(n), oldest
