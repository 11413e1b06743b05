"""The aggregates behind status, the dashboard and /metrics: grouped in SQL, capped in rows."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import Connection, Row, and_, case, func, or_, select

from coordinator.models import DeltaRecord, EvalResult, Exchange, Lease, Worker


def _leasing(run_id: int, now: datetime):
    """The workers holding a live lease of the run (a subquery)."""
    return select(Lease.worker_id).where(Lease.run_id == run_id, Lease.state == "active", Lease.deadline > now)


# -- one run --------------------------------------------------------------------------------------

def outcomes(c: Connection, run_id: int) -> dict[str, int]:
    """How many of the run's deltas are queued, merged, rejected."""
    return {outcome: n for outcome, n in c.execute(select(DeltaRecord.outcome, func.count()).where(
        DeltaRecord.run_id == run_id).group_by(DeltaRecord.outcome))}


def delta_counts(c: Connection, run_id: int) -> dict[str, int]:
    """The run's deltas, as status, the dashboard and /metrics count them: `queued`, `merged` and
    `rejected` (at merge: merged + rejected = the version), and `refused` at upload (never acknowledged:
    each worker's deltas_rejected counts both kinds)."""
    counts = outcomes(c, run_id)
    rejected_total = c.scalar(select(func.coalesce(func.sum(Worker.deltas_rejected), 0))
                              .where(Worker.run_id == run_id)) or 0
    return {"queued": counts.get("queued", 0), "merged": counts.get("merged", 0),
            "rejected": counts.get("rejected", 0), "refused": max(0, int(rejected_total) - counts.get("rejected", 0))}


def clipped(c: Connection, run_id: int) -> int:
    """The run's deltas merged scaled down (merged with a reason)."""
    return c.scalar(select(func.count()).select_from(DeltaRecord).where(
        DeltaRecord.run_id == run_id, DeltaRecord.outcome == "merged", DeltaRecord.reason.is_not(None))) or 0


def exchanges(c: Connection, run_id: int) -> int:
    return c.scalar(select(func.count()).select_from(Exchange).where(Exchange.run_id == run_id)) or 0


def workers_leasing(c: Connection, run_id: int, now: datetime) -> int:
    """How many of the run's workers hold a live lease now."""
    return c.scalar(select(func.count(func.distinct(Lease.worker_id))).where(
        Lease.run_id == run_id, Lease.state == "active", Lease.deadline > now)) or 0


def worker_count(c: Connection, run_id: int) -> int:
    return c.scalar(select(func.count()).select_from(Worker).where(Worker.run_id == run_id)) or 0


def standings(c: Connection, run_id: int) -> dict[str, int]:
    return {standing: n for standing, n in c.execute(select(Worker.standing, func.count()).where(
        Worker.run_id == run_id).group_by(Worker.standing))}


def worker_totals(c: Connection, run_id: int) -> tuple[int, float]:
    """(workers, credit) over the run's workers (their deltas rejected: delta_counts)."""
    n, credit = c.execute(select(func.count(), func.coalesce(func.sum(Worker.credit), 0.0))
                          .where(Worker.run_id == run_id)).one()
    return n, credit


def holding(c: Connection, run_id: int, now: datetime) -> set[int]:
    """The ids of the workers holding a live lease of the run."""
    return set(c.scalars(_leasing(run_id, now)))


def live(c: Connection, run_id: int, *, since: datetime, now: datetime) -> list[Row]:
    """(id, name, team, device, last_seen, standing) of the run's unrevoked workers seen since `since`
    or holding a live lease."""
    return list(c.execute(select(Worker.id, Worker.name, Worker.team, Worker.device, Worker.last_seen,
                                 Worker.standing).where(
        Worker.run_id == run_id, Worker.revoked.is_(False),
        or_(Worker.last_seen >= since, Worker.id.in_(_leasing(run_id, now))))))


def deliveries(c: Connection, run_id: int, *, from_seq: int, since: datetime) -> list[Row]:
    """(worker_id, tokens, received_at, leased_at) of the run's deltas from sequence number `from_seq`
    received since `since`."""
    return list(c.execute(select(DeltaRecord.worker_id, DeltaRecord.tokens, DeltaRecord.received_at,
                                 Lease.created_at)
                          .join(Lease, Lease.id == DeltaRecord.lease_id)
                          .where(DeltaRecord.run_id == run_id, DeltaRecord.seq >= from_seq,
                                 DeltaRecord.received_at >= since)))


def leaders(c: Connection, run_id: int, limit: int) -> list[Row]:
    """(id, name, team, tokens_trained, deltas_accepted, credit, standing, revoked) of the run's workers
    with a delta accepted, most credit first."""
    return list(c.execute(select(Worker.id, Worker.name, Worker.team, Worker.tokens_trained, Worker.deltas_accepted,
                                 Worker.credit, Worker.standing, Worker.revoked)
                          .where(Worker.run_id == run_id, Worker.deltas_accepted > 0)
                          .order_by(Worker.credit.desc(), Worker.tokens_trained.desc(), Worker.id).limit(limit)))


def teams(c: Connection, run_id: int, limit: int) -> list[Row]:
    """(team, workers, tokens_trained, deltas_accepted, credit) per named team of the run, most credit first."""
    team_credit = func.coalesce(func.sum(Worker.credit), 0.0)
    return list(c.execute(select(Worker.team, func.count(), func.coalesce(func.sum(Worker.tokens_trained), 0),
                                 func.coalesce(func.sum(Worker.deltas_accepted), 0), team_credit)
                          .where(Worker.run_id == run_id, Worker.team.is_not(None), Worker.team != "")
                          .group_by(Worker.team).order_by(team_credit.desc(), Worker.team).limit(limit)))


# -- every run (/metrics) -------------------------------------------------------------------------

def pending_outcomes(c: Connection) -> dict[tuple[int, str], int]:
    """(run id, outcome) -> deltas, for the queued and the rejected ones."""
    return {(run_id, outcome): n for run_id, outcome, n in c.execute(
        select(DeltaRecord.run_id, DeltaRecord.outcome, func.count())
        .where(DeltaRecord.outcome.in_(("queued", "rejected")))
        .group_by(DeltaRecord.run_id, DeltaRecord.outcome))}


def lease_states(c: Connection, now: datetime) -> dict[int, dict[str, int]]:
    """run id -> lease state -> leases; an active lease past its deadline is expired, whether or not
    the sweep has marked it yet."""
    state = case((and_(Lease.state == "active", Lease.deadline <= now), "expired"), else_=Lease.state)
    out: dict[int, dict[str, int]] = {}
    for run_id, lease_state, n in c.execute(select(Lease.run_id, state, func.count()).group_by(Lease.run_id, state)):
        out.setdefault(run_id, {})[lease_state] = n
    return out


def worker_stats(c: Connection, *, since: datetime, now: datetime) -> dict[int, tuple[int, int, int, float]]:
    """run id -> (workers, live ones: unrevoked, seen since `since` or leasing; deltas rejected, credit)."""
    live_now = or_(Worker.last_seen >= since, Worker.id.in_(
        select(Lease.worker_id).where(Lease.state == "active", Lease.deadline > now)))
    return {run_id: (n, int(n_live or 0), int(rejected), float(credit))
            for run_id, n, n_live, rejected, credit in c.execute(
                select(Worker.run_id, func.count(),
                       func.sum(case((and_(live_now, Worker.revoked.is_(False)), 1), else_=0)),
                       func.coalesce(func.sum(Worker.deltas_rejected), 0),
                       func.coalesce(func.sum(Worker.credit), 0.0)).group_by(Worker.run_id))}


def newest_losses(c: Connection) -> dict[int, float]:
    """run id -> the loss of its newest evaluation."""
    newest = select(EvalResult.run_id, func.max(EvalResult.version).label("version")) \
        .group_by(EvalResult.run_id).subquery()
    return {run_id: loss for run_id, loss in c.execute(select(EvalResult.run_id, EvalResult.loss).join(
        newest, and_(EvalResult.run_id == newest.c.run_id, EvalResult.version == newest.c.version)))}
