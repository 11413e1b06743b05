"""Workers and refusals: authentication, registration, the ledger, standing, the events trust judges.

Each change to a worker's ledger (tokens and deltas acknowledged, rejections, credit) also moves its
row of the day in daily_stats (queries/stats.py), in the same transaction: the daily stats hold
exactly what the ledger holds, in any process, across restarts."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import Connection, Row, bindparam, insert, select, update

from coordinator.models import DeltaRecord, Refusal, Worker, utcnow
from coordinator.queries import stats as stat_rows

# the columns a request needs of its worker (the rest are the ledger's)
_BY_TOKEN = select(Worker.id, Worker.run_id, Worker.revoked, Worker.standing, Worker.standing_reason,
                   Worker.last_seen, Worker.last_lease_at, Worker.team_id
                   ).where(Worker.token_hash == bindparam("token"))
_SEEN = update(Worker).where(Worker.id == bindparam("worker")).values(last_seen=bindparam("now"))
_LEASED = update(Worker).where(Worker.id == bindparam("worker")).values(last_lease_at=bindparam("now"))
_DELIVERED = update(Worker).where(Worker.id == bindparam("worker")).values(
    tokens_trained=Worker.tokens_trained + bindparam("tokens", type_=Worker.tokens_trained.type),
    deltas_accepted=Worker.deltas_accepted + 1,
    bytes_up=Worker.bytes_up + bindparam("size", type_=Worker.bytes_up.type))
_WORKER = select(Worker.__table__)


def by_token(c: Connection, token_hash: str) -> Row | None:
    """(id, run_id, revoked, standing, standing_reason, last_seen, last_lease_at, team_id) of a token's
    worker."""
    return c.execute(_BY_TOKEN, {"token": token_hash}).first()


def seen(c: Connection, worker_id: int, now: datetime) -> None:
    c.execute(_SEEN, {"worker": worker_id, "now": now})


def leased(c: Connection, worker_id: int, now: datetime) -> None:
    c.execute(_LEASED, {"worker": worker_id, "now": now})


def delivered(c: Connection, worker_id: int, *, tokens: int, size: int) -> None:
    """Count an acknowledged delta in its worker's ledger."""
    c.execute(_DELIVERED, {"worker": worker_id, "tokens": tokens, "size": size})
    stat_rows.bump(c, worker_id, utcnow().date(), tokens=tokens, accepted=1)


def insert_worker(c: Connection, *, run_id: int, token_hash: str, name: str | None, team: str | None,
                  device: str | None, contributor_id: int | None = None, team_id: int | None = None) -> int:
    return c.execute(insert(Worker).values(run_id=run_id, token_hash=token_hash, name=name, team=team,
                                           device=device, contributor_id=contributor_id, team_id=team_id)
                     .returning(Worker.id)).scalar_one()


def by_id(c: Connection, worker_id: int) -> Row | None:
    """Every column of a worker."""
    return c.execute(_WORKER.where(Worker.id == worker_id)).first()


def of_run(c: Connection, run_id: int) -> list[Row]:
    """Every column of each worker of a run, by id."""
    return list(c.execute(_WORKER.where(Worker.run_id == run_id).order_by(Worker.id)))


def revoke(c: Connection, worker_id: int) -> None:
    c.execute(update(Worker).where(Worker.id == worker_id).values(revoked=True))


def set_standing(c: Connection, worker_id: int, state: str, reason: str | None) -> None:
    c.execute(update(Worker).where(Worker.id == worker_id).values(standing=state, standing_reason=reason))


def count_rejected(c: Connection, worker_id: int) -> None:
    c.execute(update(Worker).where(Worker.id == worker_id).values(deltas_rejected=Worker.deltas_rejected + 1))
    stat_rows.bump(c, worker_id, utcnow().date(), rejected=1)


def add_credit(c: Connection, worker_id: int, credit: float) -> None:
    """Award credit to a worker (negative: revoke it), counted on today's row of its daily stats."""
    c.execute(update(Worker).where(Worker.id == worker_id).values(credit=Worker.credit + credit))
    stat_rows.bump(c, worker_id, utcnow().date(), credit=credit)


def add_traffic(c: Connection, worker_id: int, *, up: int, down: int) -> None:
    c.execute(update(Worker).where(Worker.id == worker_id).values(
        bytes_up=Worker.bytes_up + up, bytes_down=Worker.bytes_down + down))


def insert_refusal(c: Connection, *, run_id: int, worker_id: int, kind: str, reason: str) -> None:
    c.execute(insert(Refusal).values(run_id=run_id, worker_id=worker_id, kind=kind, reason=reason))


def recent_judged(c: Connection, worker_id: int, limit: int) -> tuple[list[Row], list[Row]]:
    """The worker's newest `limit` deltas judged at merge, (outcome, reason, staleness, received_at),
    and its newest `limit` refusals, (reason, at): each newest first."""
    deltas = c.execute(select(DeltaRecord.outcome, DeltaRecord.reason, DeltaRecord.staleness,
                              DeltaRecord.received_at).where(
        DeltaRecord.worker_id == worker_id, DeltaRecord.outcome != "queued")
        .order_by(DeltaRecord.seq.desc()).limit(limit)).all()
    refused = c.execute(select(Refusal.reason, Refusal.at).where(Refusal.worker_id == worker_id)
                        .order_by(Refusal.id.desc()).limit(limit)).all()
    return list(deltas), list(refused)
