"""Received deltas: the upload's checks and acknowledgement, the merger's queue and its outcomes."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import Connection, Row, bindparam, case, func, insert, select, update

from coordinator.models import DeltaRecord, Exchange, Lease, Run, Shard, Worker
from coordinator.queries.leases import unheld

# what an upload checks before anything is written: the lease, its run and an earlier delivery
_UPLOAD_CHECK = (select(Lease.worker_id, Lease.run_id, Lease.shard_id, Lease.base_version, Lease.state, Lease.seed,
                        Lease.client, Run.name.label("run_name"), Run.version.label("run_version"), Run.config_json,
                        DeltaRecord.id.label("delta_id"), DeltaRecord.seq.label("delta_seq"),
                        DeltaRecord.sha256.label("delta_sha256"))
                 .join(Run, Run.id == Lease.run_id)
                 .outerjoin(DeltaRecord, DeltaRecord.lease_id == Lease.id)
                 .where(Lease.id == bindparam("lease")))
# the sparse exchanges a lease made (sparta): what an empty end-of-round delta is credited for
_EXCHANGES_OF = select(func.count()).select_from(Exchange).where(Exchange.lease_id == bindparam("lease"))
_DELIVERED_OF = select(DeltaRecord.id, DeltaRecord.seq, DeltaRecord.sha256).where(
    DeltaRecord.lease_id == bindparam("lease"))
# Only one delivery per lease: a second (the same upload racing itself, maybe in another process)
# waits for the first's row lock and then finds the lease delivered (no row).
# a lease given up (abandoned) delivers nothing: its shard may be someone else's by now
_LEASE_DELIVERED = update(Lease).where(Lease.id == bindparam("lease"),
                                       Lease.state.not_in(("delivered", "abandoned"))).values(
    state="delivered").returning(Lease.deadline)
# A later lease on the same shard that is live or delivered: the shard was re-issued after this lease
# (lease ids only grow), so this lease, expired, may no longer deliver it
_SHARD_REISSUED = select(Lease.id).where(Lease.shard_id == bindparam("shard"), Lease.id > bindparam("lease"),
                                         Lease.state.in_(("active", "delivered"))).limit(1)
# Another lease of the run already delivered these exact bytes: identical content is merged once
_SAME_CONTENT = select(DeltaRecord.lease_id).where(DeltaRecord.run_id == bindparam("run"),
                                                   DeltaRecord.sha256 == bindparam("digest"),
                                                   DeltaRecord.lease_id != bindparam("lease")).limit(1)
# The shard is done, unless a late delivery finds it leased again to someone else: then that lease
# still holds it (its trained count goes up all the same).
_SHARD_TRAINED = update(Shard).where(Shard.id == bindparam("shard")).values(
    times_trained=Shard.times_trained + 1,
    state=case((unheld(bindparam("shard")), "done"), else_=Shard.state))
_INSERT = (insert(DeltaRecord).values(run_id=bindparam("run"), lease_id=bindparam("lease"),
                                      worker_id=bindparam("worker"), seq=bindparam("seq_no"),
                                      base_version=bindparam("base"), size_bytes=bindparam("size"),
                                      sha256=bindparam("digest"), tokens=bindparam("round_tokens"),
                                      steps=bindparam("round_steps"), received_at=bindparam("now"),
                                      voice=bindparam("voice"), outcome="queued")
           .returning(DeltaRecord.id))


def upload_check(c: Connection, lease_id: int) -> Row | None:
    """The lease with its run and its delivery, if any: (worker_id, run_id, shard_id, base_version,
    state, seed, client, run_name, run_version, config_json, delta_id, delta_seq, delta_sha256)."""
    return c.execute(_UPLOAD_CHECK, {"lease": lease_id}).first()


def exchanges_of(c: Connection, lease_id: int) -> int:
    return c.execute(_EXCHANGES_OF, {"lease": lease_id}).scalar_one()


def delivered_of(c: Connection, lease_id: int) -> Row | None:
    """(id, seq, sha256) of the delta the lease delivered."""
    return c.execute(_DELIVERED_OF, {"lease": lease_id}).first()


def mark_delivered(c: Connection, lease_id: int) -> Row | None:
    """Mark the lease delivered (taking its row lock); (deadline,) or None when it was delivered or
    given up already."""
    return c.execute(_LEASE_DELIVERED, {"lease": lease_id}).first()


def shard_trained(c: Connection, shard_id: int) -> None:
    c.execute(_SHARD_TRAINED, {"shard": shard_id})


def shard_reissued(c: Connection, shard_id: int, lease_id: int) -> bool:
    return c.execute(_SHARD_REISSUED, {"shard": shard_id, "lease": lease_id}).first() is not None


def same_content(c: Connection, run_id: int, digest: str, lease_id: int) -> int | None:
    """Another lease of the run that delivered these exact bytes, if any."""
    row = c.execute(_SAME_CONTENT, {"run": run_id, "digest": digest, "lease": lease_id}).first()
    return None if row is None else row.lease_id


def insert_delta(c: Connection, *, run_id: int, lease_id: int, worker_id: int, seq: int, base_version: int,
                 size: int, sha256: str, tokens: int, steps: int, now: datetime, voice: str | None = None) -> int:
    """The queued delta's row; returns its id."""
    return c.execute(_INSERT, {"run": run_id, "lease": lease_id, "worker": worker_id, "seq_no": seq,
                               "base": base_version, "size": size, "digest": sha256, "round_tokens": tokens,
                               "round_steps": steps, "now": now, "voice": voice}).scalar_one()


def queued(c: Connection, run_id: int, *, after: int, through: int) -> list[Row]:
    """(seq, base_version, lease_id, sha256, worker_id, voice) of the run's deltas after version `after`
    up to `through`, in order."""
    return list(c.execute(select(DeltaRecord.seq, DeltaRecord.base_version, DeltaRecord.lease_id,
                                 DeltaRecord.sha256, DeltaRecord.worker_id, DeltaRecord.voice).where(
        DeltaRecord.run_id == run_id, DeltaRecord.seq > after, DeltaRecord.seq <= through)
        .order_by(DeltaRecord.seq)))


def seq_of_lease(c: Connection, lease_id: int) -> Row | None:
    """(seq, sha256) of the delta a lease delivered."""
    return c.execute(select(DeltaRecord.seq, DeltaRecord.sha256).where(DeltaRecord.lease_id == lease_id)).first()


def record_outcome(c: Connection, run_id: int, seq: int, *, merged: bool, staleness: int, weight: float,
                   reason: str | None, norm: float | None, cosine: float | None, at: datetime,
                   applied: float = 0.0) -> None:
    """The merger's verdict on delta `seq` (applied: runtime.MergeOutcome.applied)."""
    c.execute(update(DeltaRecord).where(DeltaRecord.run_id == run_id, DeltaRecord.seq == seq).values(
        outcome="merged" if merged else "rejected", staleness=staleness, weight=weight, reason=reason,
        merged_at=at, norm=norm, cosine=cosine, applied=applied))


def for_credit(c: Connection, run_id: int, seq: int) -> Row | None:
    """(worker_id, outcome, tokens, received_at, leased_at, standing) of delta `seq`: what its worker's
    ledger and standing need."""
    return c.execute(select(DeltaRecord.worker_id, DeltaRecord.outcome, DeltaRecord.tokens, DeltaRecord.received_at,
                            Lease.created_at.label("leased_at"), Worker.standing)
                     .join(Lease, Lease.id == DeltaRecord.lease_id).join(Worker, Worker.id == DeltaRecord.worker_id)
                     .where(DeltaRecord.run_id == run_id, DeltaRecord.seq == seq)).first()


def merged_tokens(c: Connection, run_id: int, through: int) -> int:
    """Tokens in the run's merged deltas up to version `through`."""
    return int(c.scalar(select(func.coalesce(func.sum(DeltaRecord.tokens), 0)).where(
        DeltaRecord.run_id == run_id, DeltaRecord.seq <= through, DeltaRecord.outcome == "merged")))


def voice_members(c: Connection, run_id: int, worker_id: int) -> list[int]:
    """The other workers whose deltas of the run spoke in a voice this worker's did (coordinator/voices.py)."""
    mine = select(DeltaRecord.voice).where(DeltaRecord.run_id == run_id, DeltaRecord.worker_id == worker_id,
                                          DeltaRecord.voice.is_not(None)).distinct()
    return list(c.scalars(select(DeltaRecord.worker_id).where(
        DeltaRecord.run_id == run_id, DeltaRecord.voice.in_(mine), DeltaRecord.worker_id != worker_id).distinct()))
