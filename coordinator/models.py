"""The database schema (SQLAlchemy 2.x ORM): all progress the coordinator must not lose."""

from __future__ import annotations

from datetime import date, datetime, timezone

from sqlalchemy import (BigInteger, Boolean, Date, DateTime, Float, ForeignKey, Index, Integer, LargeBinary, String,
                        Text, UniqueConstraint)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class Base(DeclarativeBase):
    pass


class Run(Base):
    __tablename__ = "runs"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    config_json: Mapped[str] = mapped_column(Text)
    # creating | active | paused | finishing (no new leases; the outstanding ones deliver or expire, then
    # the final evaluation, checkpoint and export) | finished | archived (the bulky state deleted)
    state: Mapped[str] = mapped_column(String(16), default="active")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    n_params: Mapped[int] = mapped_column(BigInteger)
    version: Mapped[int] = mapped_column(BigInteger, default=0)  # deltas processed so far
    next_seq: Mapped[int] = mapped_column(BigInteger, default=1)  # seq of the next acknowledged delta
    epoch: Mapped[int] = mapped_column(Integer, default=0)
    train_tokens: Mapped[int] = mapped_column(BigInteger)
    eval_tokens: Mapped[int] = mapped_column(BigInteger)
    tokens_trained: Mapped[int] = mapped_column(BigInteger, default=0)
    worker_steps: Mapped[int] = mapped_column(BigInteger, default=0)
    bytes_up: Mapped[int] = mapped_column(BigInteger, default=0)
    bytes_down_model: Mapped[int] = mapped_column(BigInteger, default=0)
    bytes_down_data: Mapped[int] = mapped_column(BigInteger, default=0)
    join_key_hash: Mapped[str | None] = mapped_column(String(64), nullable=True)
    # the run's lifecycle: it finishes when tokens_trained reaches token_budget (None: no budget) or
    # its epoch reaches max_epochs (None: epochs repeat until finished by hand); workers following a
    # project train the active run of highest priority first
    token_budget: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    max_epochs: Mapped[int | None] = mapped_column(Integer, nullable=True)
    priority: Mapped[int] = mapped_column(Integer, default=0)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    # finishing: the leases still out then are given up at this time (`run finish --grace`; None: wait for them)
    finish_by: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class Worker(Base):
    __tablename__ = "workers"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"), index=True)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    name: Mapped[str | None] = mapped_column(String(64), nullable=True)  # its contributor's (None: anonymous)
    contributor_id: Mapped[int | None] = mapped_column(ForeignKey("contributors.id"), nullable=True)
    team: Mapped[str | None] = mapped_column(String(64), nullable=True)  # a label it declared, or its team's name
    # Set when it registered with a registered team's key (--team-key): a verified member, whose leases
    # count against the team's cap per address, not max_leases_per_address.
    team_id: Mapped[int | None] = mapped_column(ForeignKey("teams.id"), nullable=True, index=True)
    device: Mapped[str | None] = mapped_column(String(64), nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    last_seen: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    revoked: Mapped[bool] = mapped_column(Boolean, default=False)
    # Robust merging's verdict on this worker (coordinator/trust.py): ok | throttled | banned.
    standing: Mapped[str] = mapped_column(String(16), default="ok")
    standing_reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    last_lease_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    # Contribution ledger (per run, since a worker registers with one run).
    tokens_trained: Mapped[int] = mapped_column(BigInteger, default=0)
    deltas_accepted: Mapped[int] = mapped_column(Integer, default=0)
    deltas_rejected: Mapped[int] = mapped_column(Integer, default=0)
    bytes_up: Mapped[int] = mapped_column(BigInteger, default=0)
    bytes_down: Mapped[int] = mapped_column(BigInteger, default=0)
    # Tokens of its merged deltas times their quick-return bonus (coordinator/credit.py).
    credit: Mapped[float] = mapped_column(Float, default=0.0)


class Shard(Base):
    __tablename__ = "shards"
    # a lease claims the first pending shard by (times_trained, index): one step of this index
    __table_args__ = (UniqueConstraint("run_id", "index"),
                      Index("ix_shards_pick", "run_id", "state", "times_trained", "index"))
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"))
    index: Mapped[int] = mapped_column(Integer)  # position in the corpus
    n_tokens: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64))  # of the raw tokens
    state: Mapped[str] = mapped_column(String(16), default="pending")  # pending | leased | done
    epoch: Mapped[int] = mapped_column(Integer, default=0)  # epoch of its last completion
    times_trained: Mapped[int] = mapped_column(Integer, default=0)


class Lease(Base):
    __tablename__ = "leases"
    __table_args__ = (Index("ix_leases_state_deadline", "state", "deadline"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"), index=True)
    worker_id: Mapped[int] = mapped_column(ForeignKey("workers.id"), index=True)
    shard_id: Mapped[int] = mapped_column(ForeignKey("shards.id"))
    base_version: Mapped[int] = mapped_column(BigInteger)
    seed: Mapped[int] = mapped_column(BigInteger)
    lr: Mapped[float] = mapped_column(Float)
    state: Mapped[str] = mapped_column(String(16), default="active")  # active | expired | delivered | abandoned
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    deadline: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    # The network address the lease was granted to (its /64 for IPv6): leases per address are capped.
    client: Mapped[str | None] = mapped_column(String(64), nullable=True, index=True)
    # The local step the worker reported at its last renewal: a renewal must show progress.
    progress_step: Mapped[int] = mapped_column(Integer, default=0)


class DeltaRecord(Base):
    __tablename__ = "deltas"
    # ix_deltas_content: identical delta content is merged once per run (looked up by its hash)
    __table_args__ = (UniqueConstraint("run_id", "seq"), Index("ix_deltas_queue", "run_id", "outcome", "seq"),
                      Index("ix_deltas_content", "run_id", "sha256"), Index("ix_deltas_voice", "run_id", "voice"))
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"))
    lease_id: Mapped[int] = mapped_column(ForeignKey("leases.id"), unique=True)
    worker_id: Mapped[int] = mapped_column(ForeignKey("workers.id"), index=True)
    seq: Mapped[int] = mapped_column(BigInteger)  # arrival order; merging it makes version == seq
    base_version: Mapped[int] = mapped_column(BigInteger)
    size_bytes: Mapped[int] = mapped_column(Integer)
    sha256: Mapped[str] = mapped_column(String(64))
    tokens: Mapped[int] = mapped_column(BigInteger)
    steps: Mapped[int] = mapped_column(Integer)
    received_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    outcome: Mapped[str] = mapped_column(String(16), default="queued")  # queued | merged | rejected
    staleness: Mapped[int | None] = mapped_column(Integer, nullable=True)
    weight: Mapped[float | None] = mapped_column(Float, nullable=True)
    reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    norm: Mapped[float | None] = mapped_column(Float, nullable=True)  # robust merging's measurements
    cosine: Mapped[float | None] = mapped_column(Float, nullable=True)
    merged_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    # the voice it speaks in (coordinator/voices.py: tokens of one address share one); None: its worker's own
    voice: Mapped[str | None] = mapped_column(String(32), nullable=True)
    # what merging it moved each weight by per unit of its values (runtime.MergeOutcome.applied); NULL
    # for a delta merged before this was recorded: such a delta cannot be compensated
    applied: Mapped[float | None] = mapped_column(Float, nullable=True)


class ModelVersion(Base):
    __tablename__ = "model_versions"
    __table_args__ = (UniqueConstraint("run_id", "version"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"))
    version: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64))  # of the snapshot file as served
    size_bytes: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class EvalResult(Base):
    __tablename__ = "eval_results"
    __table_args__ = (UniqueConstraint("run_id", "version"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"))
    version: Mapped[int] = mapped_column(BigInteger)
    loss: Mapped[float] = mapped_column(Float)
    tokens_trained: Mapped[int] = mapped_column(BigInteger)
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class Exchange(Base):
    """One sparse exchange (sparta): a worker's values mixed into the global model after local
    step `step` of a lease, while the model was at `after_version`. The body is kept so a restart
    replays exchanges and deltas in their original order (ordered by id); the unique (lease, step)
    makes each exchange count once."""

    __tablename__ = "exchanges"
    __table_args__ = (UniqueConstraint("lease_id", "step"),
                      Index("ix_exchanges_replay", "run_id", "after_version", "id"))
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"), index=True)
    lease_id: Mapped[int] = mapped_column(ForeignKey("leases.id"))
    worker_id: Mapped[int] = mapped_column(ForeignKey("workers.id"), index=True)
    step: Mapped[int] = mapped_column(Integer)
    after_version: Mapped[int] = mapped_column(BigInteger)
    body: Mapped[bytes] = mapped_column(LargeBinary)
    bytes_in: Mapped[int] = mapped_column(Integer)
    bytes_out: Mapped[int] = mapped_column(Integer)
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    # what the descent guard kept of its step of the global model (exchange_screen.guard_scale); a replay
    # takes it as recorded. NULL: from before the guard, replayed at 1
    centre_scale: Mapped[float | None] = mapped_column(Float, nullable=True)
    # the correction answered, kept for a lease sampled for its spot-check (its replay applies it where
    # the worker did: spot_checks.exchanges_applied); NULL otherwise, and once judged
    answer: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)


class Refusal(Base):
    """A request refused for the worker's own doing (a malformed or out-of-bounds delta or exchange,
    a copied delta, ...): these count toward throttle and ban with the deltas rejected at merge
    (coordinator/trust.py), so a worker cannot probe the screens for free."""

    __tablename__ = "refusals"
    __table_args__ = (Index("ix_refusals_worker", "worker_id", "id"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"))
    worker_id: Mapped[int] = mapped_column(ForeignKey("workers.id"))
    kind: Mapped[str] = mapped_column(String(16))  # delta | exchange | renew | ...
    reason: Mapped[str] = mapped_column(Text)
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class Contributor(Base):
    """A contributor name claimed in a run: the first worker to register it claims it, and the run's
    later workers join under it only with its contributor key (coordinator/names.py gives each name
    its forms compared, ContributorKey holds them, so a lookalike cannot pass for it)."""

    __tablename__ = "contributors"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"))
    name: Mapped[str] = mapped_column(String(64))  # as first registered: every machine of it shows this
    key_hash: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class ContributorKey(Base):
    """One form a contributor's name is compared in (names.name_keys). A claim holds each of its forms
    at seat 0, so (run_id, key, 0) is what a concurrent claim of a lookalike collides with, in any
    process. A name claimed before the forms last changed that now shares one with an older name sits
    at its own id instead: both are kept (and found), a new claim of either form is refused."""

    __tablename__ = "contributor_keys"
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"), primary_key=True)
    key: Mapped[str] = mapped_column(String(256), primary_key=True)
    seat: Mapped[int] = mapped_column(Integer, primary_key=True)
    contributor_id: Mapped[int] = mapped_column(ForeignKey("contributors.id"), index=True)


class Team(Base):
    """A team the operator registered (`idletrain team create`): its name (compared as names are,
    coordinator-wide) is claimed only with its key, and its verified members' live leases count
    against its own cap per address (None: the coordinator's max_leases_per_address)."""

    __tablename__ = "teams"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    name_key: Mapped[str] = mapped_column(String(256), unique=True)  # names.name_keys' first form
    shape_key: Mapped[str] = mapped_column(String(256), unique=True)  # its last (the first again for most names)
    key_hash: Mapped[str] = mapped_column(String(64))
    max_leases_per_address: Mapped[int | None] = mapped_column(Integer, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class DailyStat(Base):
    """One worker's contribution on one UTC day, moved in the transaction that moves its ledger
    (queries/workers.py): tokens and deltas when acknowledged, rejections, credit when awarded or
    revoked. The daily stats aggregate these by contributor name and by team."""

    __tablename__ = "daily_stats"
    __table_args__ = (Index("ix_daily_stats_worker", "worker_id", "day"),)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"), primary_key=True)
    day: Mapped[date] = mapped_column(Date, primary_key=True)
    worker_id: Mapped[int] = mapped_column(ForeignKey("workers.id"), primary_key=True)
    tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    deltas_accepted: Mapped[int] = mapped_column(Integer, default=0)
    deltas_rejected: Mapped[int] = mapped_column(Integer, default=0)
    credit: Mapped[float] = mapped_column(Float, default=0.0)


class SpotCheck(Base):
    """A delivered lease sampled for the replay spot-check (coordinator/spotcheck.py): the coordinator
    re-trains its round and compares it with the delta sent (a copy kept until the check is done).
    While pending it keeps the lease's base snapshot from being deleted."""

    __tablename__ = "spot_checks"
    __table_args__ = (Index("ix_spot_checks_pending", "run_id", "verdict"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"))
    lease_id: Mapped[int] = mapped_column(ForeignKey("leases.id"), unique=True)
    worker_id: Mapped[int] = mapped_column(ForeignKey("workers.id"), index=True)
    base_version: Mapped[int] = mapped_column(BigInteger)
    verdict: Mapped[str] = mapped_column(String(16), default="pending")  # pending | passed | failed | skipped
    cosine: Mapped[float | None] = mapped_column(Float, nullable=True)
    norm_ratio: Mapped[float | None] = mapped_column(Float, nullable=True)
    reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    credit_revoked: Mapped[float] = mapped_column(Float, default=0.0)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)  # when judged
    # the worker's commitment to its round's start state (shared/algorithms/start_state.py), from its
    # upload's headers; NULL: none made (an older worker). received_at: the bytes arrived and matched.
    state_sha256: Mapped[str | None] = mapped_column(String(64), nullable=True)
    state_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    state_received_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    # a round with exchanges (sparta): where its worker applied each correction, as sent with the state
    # ("<resumed at>;<exchange step>:<after step>,..."; protocol.H_EXCHANGES_APPLIED)
    exchanges_applied: Mapped[str | None] = mapped_column(Text, nullable=True)


class Compensation(Base):
    """A merged delta taken back because it was found false after it merged (a failed spot-check):
    the merger applies its negation (FlatOuter.compensate) just before it merges version
    `before_version`, and a restart's replay does the same there. NULL before_version: not applied
    yet (it waits for the run's next delta); 0: never applied, its kept bytes were gone. Its bytes are
    kept as Storage.compensation until the checkpoints hold it."""

    __tablename__ = "compensations"
    __table_args__ = (UniqueConstraint("run_id", "seq"), Index("ix_compensations_pending", "run_id", "before_version"))
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"))
    seq: Mapped[int] = mapped_column(BigInteger)  # the false delta's
    applied: Mapped[float] = mapped_column(Float)  # its DeltaRecord.applied: what is taken back
    reason: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    before_version: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
