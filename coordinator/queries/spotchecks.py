"""Spot-checks: sample at acknowledgement, the checker's queue, verdicts, a worker's record."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import Connection, Row, func, insert, or_, select, update

from coordinator.models import DeltaRecord, Lease, Run, Shard, SpotCheck


def insert_pending(c: Connection, *, run_id: int, lease_id: int, worker_id: int, base_version: int,
                   state_sha256: str | None = None, state_bytes: int | None = None) -> None:
    c.execute(insert(SpotCheck).values(run_id=run_id, lease_id=lease_id, worker_id=worker_id,
                                       base_version=base_version, verdict="pending", credit_revoked=0.0,
                                       state_sha256=state_sha256, state_bytes=state_bytes))


def start_state_of(c: Connection, lease_id: int) -> Row | None:
    """The lease and its check as its start state concerns them: (run_id, worker_id, verdict, state_sha256,
    state_bytes, state_received_at), the check's columns None when the lease is not checked; None when
    there is no such lease."""
    return c.execute(select(Lease.run_id, Lease.worker_id, SpotCheck.verdict, SpotCheck.state_sha256,
                            SpotCheck.state_bytes, SpotCheck.state_received_at)
                     .outerjoin(SpotCheck, SpotCheck.lease_id == Lease.id)
                     .where(Lease.id == lease_id)).first()


def start_state_received(c: Connection, lease_id: int, at: datetime, *, exchanges_applied: str | None = None) -> bool:
    """Mark the lease's committed start state arrived (with a sparta round's exchanges_applied); False
    when it is no longer wanted."""
    return c.execute(update(SpotCheck).where(SpotCheck.lease_id == lease_id, SpotCheck.verdict == "pending",
                                             SpotCheck.state_sha256.is_not(None),
                                             SpotCheck.state_received_at.is_(None))
                     .values(state_received_at=at, exchanges_applied=exchanges_applied)).rowcount == 1


def pending_count(c: Connection, run_id: int) -> int:
    return int(c.scalar(select(func.count()).select_from(SpotCheck).where(SpotCheck.run_id == run_id,
                                                                            SpotCheck.verdict == "pending")))


def pending_bases(c: Connection, run_id: int) -> set[int]:
    """The base versions of the run's pending checks (their snapshots must stay)."""
    return set(c.scalars(select(SpotCheck.base_version).where(SpotCheck.run_id == run_id,
                                                              SpotCheck.verdict == "pending")))


def next_ready(c: Connection, *, state_due: datetime, after_id: int = 0) -> Row | None:
    """The oldest pending check (id > after_id) whose delta the merger has judged and whose committed
    start state arrived, or was due by `state_due` (a delta received before it): (id, run_id,
    lease_id, worker_id, base_version, seed, lr, shard_index, seq, sha256, outcome, tokens,
    received_at, leased_at, config_json, state_sha256, state_received_at, exchanges_applied)."""
    return c.execute(
        select(SpotCheck.id, SpotCheck.run_id, SpotCheck.lease_id, SpotCheck.worker_id, SpotCheck.base_version,
               Lease.seed, Lease.lr, Shard.index.label("shard_index"), DeltaRecord.seq, DeltaRecord.sha256,
               DeltaRecord.outcome, DeltaRecord.tokens, DeltaRecord.received_at, Lease.created_at.label("leased_at"),
               Run.config_json, SpotCheck.state_sha256, SpotCheck.state_received_at, SpotCheck.exchanges_applied)
        .join(Lease, Lease.id == SpotCheck.lease_id).join(Shard, Shard.id == Lease.shard_id)
        .join(DeltaRecord, DeltaRecord.lease_id == SpotCheck.lease_id).join(Run, Run.id == SpotCheck.run_id)
        .where(SpotCheck.verdict == "pending", SpotCheck.id > after_id, DeltaRecord.outcome != "queued",
               or_(SpotCheck.state_sha256.is_(None), SpotCheck.state_received_at.is_not(None),
                   DeltaRecord.received_at < state_due))
        .order_by(SpotCheck.id).limit(1)).first()


def first_lease(c: Connection, worker_id: int, lease_id: int) -> bool:
    """Whether `lease_id` is the worker's first lease (its trainer then starts from a fresh AdamW)."""
    return c.scalar(select(func.count()).select_from(Lease).where(Lease.worker_id == worker_id,
                                                                   Lease.id < lease_id)) == 0


def ahead_of(c: Connection, worker_id: int, lease_id: int, base_version: int, limit: int) -> list[Row]:
    """(seq, lease_id, sha256) of the worker's deltas from earlier leases that base_version does not hold
    (seq > base_version), newest `limit` of them: what the worker's round started from its base minus
    (worker/ledger.py)."""
    return list(c.execute(select(DeltaRecord.seq, DeltaRecord.lease_id, DeltaRecord.sha256).where(
        DeltaRecord.worker_id == worker_id, DeltaRecord.lease_id < lease_id, DeltaRecord.seq > base_version)
        .order_by(DeltaRecord.seq.desc()).limit(limit)))


def steps_before(c: Connection, worker_id: int, seq: int) -> int:
    """Local steps of the worker's deltas acknowledged before sequence number `seq`: where its warm-up stood."""
    return int(c.scalar(select(func.coalesce(func.sum(DeltaRecord.steps), 0)).where(
        DeltaRecord.worker_id == worker_id, DeltaRecord.seq < seq)))


def record(c: Connection, check_id: int, *, verdict: str, cosine: float | None, norm_ratio: float | None,
           reason: str | None, credit_revoked: float, at: datetime) -> bool:
    """Judge a pending check; False if it was judged already (another process's checker)."""
    return c.execute(update(SpotCheck).where(SpotCheck.id == check_id, SpotCheck.verdict == "pending").values(
        verdict=verdict, cosine=cosine, norm_ratio=norm_ratio, reason=reason, credit_revoked=credit_revoked,
        at=at)).rowcount == 1


def by_run(c: Connection, run_id: int) -> dict[int, dict[str, int]]:
    """Each worker of a run with a check, its checks by verdict: {worker_id: {verdict: n}}."""
    out: dict[int, dict[str, int]] = {}
    for worker_id, verdict, n in c.execute(select(SpotCheck.worker_id, SpotCheck.verdict, func.count()).where(
            SpotCheck.run_id == run_id).group_by(SpotCheck.worker_id, SpotCheck.verdict)):
        out.setdefault(worker_id, {})[verdict] = int(n)
    return out
