"""Leases and shards: grant (a shard picked and claimed in one UPDATE), renew, give up, expire."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import Connection, Executable, Row, bindparam, func, insert, select, update

from coordinator.models import DeltaRecord, Lease, Shard, Worker
from coordinator.queries.versions import newest_snapshot


def unheld(shard_id) -> object:
    """SQL condition: no live lease holds this shard (a shard changes state only when it is free)."""
    return ~select(Lease.id).where(Lease.shard_id == shard_id, Lease.state == "active").exists()


_LEASE = select(Lease.__table__).where(Lease.id == bindparam("lease"))
_OWNER = select(Lease.id, Lease.worker_id, Lease.run_id, Lease.shard_id, Lease.base_version, Lease.state).where(
    Lease.id == bindparam("lease"))
# A worker asking again has given up its earlier live leases, but the one it keeps (-1: none)
_ABANDON_OTHERS = (update(Lease).where(Lease.worker_id == bindparam("worker"), Lease.state == "active",
                                       Lease.id != bindparam("keep")).values(state="abandoned")
                   .returning(Lease.id, Lease.shard_id))
_FREE_SHARD = update(Shard).where(Shard.id == bindparam("shard"), Shard.state == "leased",
                                  unheld(bindparam("shard"))).values(state="pending")
# only a live lease ends: one delivered between a caller's read and this write stays delivered
_END = update(Lease).where(Lease.id == bindparam("lease"), Lease.state == "active").values(state=bindparam("new_state"))
_SHARD_STATES = select(Shard.state, func.count()).where(Shard.run_id == bindparam("run")).group_by(Shard.state)
# the lease hands out the newest version with a snapshot on disk; its seed follows from its id
_INSERT = (insert(Lease).values(run_id=bindparam("run"), worker_id=bindparam("worker"),
                                shard_id=bindparam("shard"), base_version=newest_snapshot(bindparam("run")), seed=0,
                                lr=bindparam("lease_lr"), state="active", deadline=bindparam("until"),
                                created_at=bindparam("now"), client=bindparam("client"))
           .returning(Lease.id, Lease.base_version))
_SEED = update(Lease).where(Lease.id == bindparam("lease")).values(seed=bindparam("lease_seed"))
# live leases of a run held from one client address by workers of no registered team (settings.
# max_leases_per_address caps them), and by the verified members of one team (its own cap)
_AT_CLIENT = select(func.count()).select_from(Lease).join(Worker, Worker.id == Lease.worker_id).where(
    Lease.run_id == bindparam("run"), Lease.client == bindparam("client"), Lease.state == "active",
    Lease.deadline > bindparam("now"))
_OF_CLIENT = _AT_CLIENT.where(Worker.team_id.is_(None))
_OF_CLIENT_TEAM = _AT_CLIENT.where(Worker.team_id == bindparam("team"))
# (received_at, lease created_at) of a run's newest deliveries: its expected round (scheduler.lease_lifetime_s)
_RECENT_ROUNDS = (select(DeltaRecord.received_at, Lease.created_at).join(Lease, Lease.id == DeltaRecord.lease_id)
                  .where(DeltaRecord.run_id == bindparam("run")).order_by(DeltaRecord.seq.desc()).limit(64))


def claim_statement(*, skip_locked: bool) -> Executable:
    """Pick and claim the next shard in one statement: the least-trained pending shard, lowest index
    on ties (the ix_shards_pick index walks that order). On PostgreSQL the pick skips rows that
    concurrent claims hold (FOR UPDATE SKIP LOCKED), so they take different shards instead of
    queueing on one; SQLite runs one writer at a time. Returns (id, index, sha256), or no row when
    no pending shard was free."""
    pick = (select(Shard.id).where(Shard.run_id == bindparam("run"), Shard.state == "pending")
            .order_by(Shard.times_trained, Shard.index).limit(1))
    if skip_locked:
        pick = pick.with_for_update(skip_locked=True)
    return (update(Shard).where(Shard.id == pick.scalar_subquery(), Shard.state == "pending")
            .values(state="leased").returning(Shard.id, Shard.index, Shard.sha256))


def claim(c: Connection, statement: Executable, run_id: int) -> Row | None:
    """Run claim_statement's statement for a run: (id, index, sha256) of the shard claimed, or None."""
    return c.execute(statement, {"run": run_id}).first()


def shard_states(c: Connection, run_id: int) -> dict[str, int]:
    """How many of the run's shards are in each state."""
    return {state: n for state, n in c.execute(_SHARD_STATES, {"run": run_id})}


def by_id(c: Connection, lease_id: int) -> Row | None:
    """Every column of a lease."""
    return c.execute(_LEASE, {"lease": lease_id}).first()


def owner(c: Connection, lease_id: int) -> Row | None:
    """(id, worker_id, run_id, shard_id, base_version, state) of a lease."""
    return c.execute(_OWNER, {"lease": lease_id}).first()


def abandon_others(c: Connection, worker_id: int, *, keep: int | None) -> None:
    """Give up the worker's live leases but `keep`; their shards go back to the queue unless held."""
    for _, shard_id in c.execute(_ABANDON_OTHERS, {"worker": worker_id, "keep": -1 if keep is None else keep}).all():
        free_shard(c, shard_id)


def free_shard(c: Connection, shard_id: int) -> None:
    """A leased shard back to pending, unless a live lease still holds it."""
    c.execute(_FREE_SHARD, {"shard": shard_id})


def end_lease(c: Connection, lease_id: int, shard_id: int, state: str) -> None:
    """Mark a live lease expired or abandoned; its shard goes back to the queue if nobody else holds it."""
    c.execute(_END, {"lease": lease_id, "new_state": state})
    free_shard(c, shard_id)


def of_client(c: Connection, run_id: int, client: str, now: datetime, *, team_id: int | None = None) -> int:
    """Live leases of the run held from `client` by the verified members of team `team_id` (None:
    by the workers of no registered team)."""
    if team_id is None:
        return c.execute(_OF_CLIENT, {"run": run_id, "client": client, "now": now}).scalar_one()
    return c.execute(_OF_CLIENT_TEAM, {"run": run_id, "client": client, "now": now, "team": team_id}).scalar_one()


def insert_lease(c: Connection, *, run_id: int, worker_id: int, shard_id: int, lr: float, deadline: datetime,
                 now: datetime, client: str | None) -> tuple[int, int]:
    """A live lease on the run's newest snapshot; returns (its id, its base version)."""
    lease_id, base_version = c.execute(_INSERT, {"run": run_id, "worker": worker_id, "shard": shard_id,
                                                 "lease_lr": lr, "until": deadline, "now": now,
                                                 "client": client}).one()
    return lease_id, base_version


def set_seed(c: Connection, lease_id: int, seed: int) -> None:
    c.execute(_SEED, {"lease": lease_id, "lease_seed": seed})


def recent_rounds(c: Connection, run_id: int) -> list[tuple[datetime, datetime]]:
    """(received_at, lease created_at) of the run's newest deliveries."""
    return [(received, created) for received, created in c.execute(_RECENT_ROUNDS, {"run": run_id})]


def renew(c: Connection, lease_id: int, *, deadline: datetime, step: int) -> bool:
    """A live lease's new deadline and progress; False when it is no longer live."""
    return bool(c.execute(update(Lease).where(Lease.id == lease_id, Lease.state == "active")
                          .values(deadline=deadline, progress_step=step)).rowcount)


def live_of_worker(c: Connection, worker_id: int) -> list[Row]:
    """(id, shard_id) of the worker's live leases."""
    return list(c.execute(select(Lease.id, Lease.shard_id).where(Lease.worker_id == worker_id,
                                                                 Lease.state == "active")))


def past_deadline(c: Connection, now: datetime) -> list[Row]:
    """(id, worker_id, shard_id) of the live leases whose deadline is `now` or earlier."""
    return list(c.execute(select(Lease.id, Lease.worker_id, Lease.shard_id).where(
        Lease.state == "active", Lease.deadline <= now)))


def live_count(c: Connection, run_id: int, *, besides_worker: int | None = None) -> int:
    """The run's leases still out (state active, whatever their deadline), but those of `besides_worker`."""
    query = select(func.count()).select_from(Lease).where(Lease.run_id == run_id, Lease.state == "active")
    if besides_worker is not None:
        query = query.where(Lease.worker_id != besides_worker)
    return c.scalar(query) or 0


def live_base_versions(c: Connection, run_id: int) -> set[int]:
    """The versions the run's live leases train from (their snapshots must stay)."""
    return set(c.scalars(select(Lease.base_version).where(Lease.run_id == run_id, Lease.state == "active")))
