"""The statements of the hot path (authentication, leases, uploads), built once.

Every worker request runs some of these. Building a SQLAlchemy statement costs more CPU than
running it on a warm connection, so each is built here once, with named parameters, and run
through Core (no ORM unit of work); each round trip also does as much as one statement can:
a shard is picked and claimed in one UPDATE, a run's next sequence number taken and its counts
moved in another.

Row locks are taken in one order, lease -> shard -> run -> worker: the merger's commit and the
traffic flush also lock the run's row before any worker's, so no two transactions wait on each
other in a circle.
"""

from __future__ import annotations

from sqlalchemy import and_, bindparam, case, func, insert, select, update

from coordinator.models import DeltaRecord, Exchange, Lease, ModelVersion, Run, Shard, Worker


def unheld(shard_id) -> object:
    """SQL condition: no live lease holds this shard (a shard changes state only when it is free)."""
    return ~select(Lease.id).where(Lease.shard_id == shard_id, Lease.state == "active").exists()


# -- authentication -------------------------------------------------------------------------------

# the columns a request needs of its worker (the rest are the ledger's)
AUTH_COLUMNS = (Worker.id, Worker.run_id, Worker.revoked, Worker.standing, Worker.standing_reason,
                Worker.last_seen, Worker.last_lease_at)
WORKER_BY_TOKEN = select(*AUTH_COLUMNS).where(Worker.token_hash == bindparam("token"))
WORKER_SEEN = update(Worker).where(Worker.id == bindparam("worker")).values(last_seen=bindparam("now"))

# -- leases ---------------------------------------------------------------------------------------

RUN_FOR_LEASE = select(Run.id, Run.name, Run.state, Run.epoch, Run.tokens_trained, Run.config_json).where(
    Run.name == bindparam("name"))
LEASE_OF = select(Lease.id, Lease.worker_id, Lease.run_id, Lease.shard_id, Lease.base_version, Lease.state).where(
    Lease.id == bindparam("lease"))
# A worker asking again has given up its earlier live leases, but the one it keeps (-1: none)
ABANDON_OTHERS = (update(Lease).where(Lease.worker_id == bindparam("worker"), Lease.state == "active",
                                      Lease.id != bindparam("keep")).values(state="abandoned")
                  .returning(Lease.id, Lease.shard_id))
FREE_SHARD = update(Shard).where(Shard.id == bindparam("shard"), Shard.state == "leased",
                                 unheld(bindparam("shard"))).values(state="pending")


def claim_shard(*, skip_locked: bool):
    """Pick and claim the next shard in one statement: the least-trained pending shard, lowest index
    on ties (scheduler.pick_shard's order; the ix_shards_pick index walks it). On PostgreSQL the pick
    skips rows that concurrent claims hold (FOR UPDATE SKIP LOCKED), so they take different shards
    instead of queueing on one; SQLite runs one writer at a time. Returns (id, index, sha256), or
    no row when no pending shard was free."""
    pick = (select(Shard.id).where(Shard.run_id == bindparam("run"), Shard.state == "pending")
            .order_by(Shard.times_trained, Shard.index).limit(1))
    if skip_locked:
        pick = pick.with_for_update(skip_locked=True)
    return (update(Shard).where(Shard.id == pick.scalar_subquery(), Shard.state == "pending")
            .values(state="leased").returning(Shard.id, Shard.index, Shard.sha256))


SHARDS_UNDONE = (select(Shard.state, func.count()).where(Shard.run_id == bindparam("run"), Shard.state != "done")
                 .group_by(Shard.state))
WORKER_LEASED = update(Worker).where(Worker.id == bindparam("worker")).values(last_lease_at=bindparam("now"))


def newest_snapshot(run_id):
    """The newest version with a snapshot on disk (0 before any): what leases hand out and
    `snapshots/latest` serves. `run_id`: a value, a parameter or a column to correlate with."""
    return (select(func.coalesce(func.max(ModelVersion.version), 0)).where(ModelVersion.run_id == run_id)
            .scalar_subquery())


NEWEST_SNAPSHOT = newest_snapshot(bindparam("run"))
# the lease hands out the newest version with a snapshot on disk; its seed follows from its id
INSERT_LEASE = (insert(Lease).values(run_id=bindparam("run"), worker_id=bindparam("worker"),
                                     shard_id=bindparam("shard"), base_version=NEWEST_SNAPSHOT, seed=0,
                                     lr=bindparam("lease_lr"), state="active", deadline=bindparam("until"),
                                     created_at=bindparam("now"), client=bindparam("client"))
                .returning(Lease.id, Lease.base_version))
# live leases of a run held from one client address (settings.max_leases_per_address caps them)
LEASES_OF_CLIENT = select(func.count()).select_from(Lease).where(
    Lease.run_id == bindparam("run"), Lease.client == bindparam("client"), Lease.state == "active",
    Lease.deadline > bindparam("now"))
# (received_at, lease created_at) of a run's newest deliveries: its expected round (scheduler.lease_lifetime_s)
RECENT_ROUNDS = (select(DeltaRecord.received_at, Lease.created_at).join(Lease, Lease.id == DeltaRecord.lease_id)
                 .where(DeltaRecord.run_id == bindparam("run")).order_by(DeltaRecord.seq.desc()).limit(64))
LEASE_SEED = update(Lease).where(Lease.id == bindparam("lease")).values(seed=bindparam("lease_seed"))

# -- uploads --------------------------------------------------------------------------------------

# what accept_delta checks before anything is written: the lease, its run and an earlier delivery
UPLOAD_CHECK = (select(Lease.worker_id, Lease.run_id, Lease.shard_id, Lease.base_version, Lease.state, Lease.seed,
                       Run.name.label("run_name"), Run.version.label("run_version"), Run.config_json,
                       DeltaRecord.id.label("delta_id"), DeltaRecord.seq.label("delta_seq"),
                       DeltaRecord.sha256.label("delta_sha256"))
                .join(Run, Run.id == Lease.run_id)
                .outerjoin(DeltaRecord, DeltaRecord.lease_id == Lease.id)
                .where(Lease.id == bindparam("lease")))
# the sparse exchanges a lease made (sparta): what an empty end-of-round delta is credited for
EXCHANGES_OF = select(func.count()).select_from(Exchange).where(Exchange.lease_id == bindparam("lease"))
DELIVERED_OF = select(DeltaRecord.id, DeltaRecord.seq, DeltaRecord.sha256).where(
    DeltaRecord.lease_id == bindparam("lease"))
# Only one delivery per lease: a second (the same upload racing itself, maybe in another process)
# waits for the first's row lock and then finds the lease delivered (no row).
# a lease given up (abandoned) delivers nothing: its shard may be someone else's by now
LEASE_DELIVERED = update(Lease).where(Lease.id == bindparam("lease"),
                                      Lease.state.not_in(("delivered", "abandoned"))).values(
    state="delivered").returning(Lease.deadline)
# A later lease on the same shard that is live or delivered: the shard was re-issued after this lease
# (lease ids only grow), so this lease, expired, may no longer deliver it
SHARD_REISSUED = select(Lease.id).where(Lease.shard_id == bindparam("shard"), Lease.id > bindparam("lease"),
                                        Lease.state.in_(("active", "delivered"))).limit(1)
# Another lease of the run already delivered these exact bytes: identical content is merged once
SAME_CONTENT = select(DeltaRecord.lease_id).where(DeltaRecord.run_id == bindparam("run"),
                                                  DeltaRecord.sha256 == bindparam("digest"),
                                                  DeltaRecord.lease_id != bindparam("lease")).limit(1)
# The shard is done, unless a late delivery finds it leased again to someone else: then that lease
# still holds it (its trained count goes up all the same).
SHARD_TRAINED = update(Shard).where(Shard.id == bindparam("shard")).values(
    times_trained=Shard.times_trained + 1,
    state=case((unheld(bindparam("shard")), "done"), else_=Shard.state))
WORKER_DELIVERED = update(Worker).where(Worker.id == bindparam("worker")).values(
    tokens_trained=Worker.tokens_trained + bindparam("tokens", type_=Worker.tokens_trained.type),
    deltas_accepted=Worker.deltas_accepted + 1,
    bytes_up=Worker.bytes_up + bindparam("size", type_=Worker.bytes_up.type))
# Takes the run's row lock (until the commit): sequence numbers follow the commit order, no gaps.
RUN_DELIVERED = (update(Run).where(Run.id == bindparam("run")).values(
    next_seq=Run.next_seq + 1,
    tokens_trained=Run.tokens_trained + bindparam("tokens", type_=Run.tokens_trained.type),
    worker_steps=Run.worker_steps + bindparam("steps", type_=Run.worker_steps.type),
    bytes_up=Run.bytes_up + bindparam("size", type_=Run.bytes_up.type))
    .returning(Run.next_seq))
INSERT_DELTA = (insert(DeltaRecord).values(run_id=bindparam("run"), lease_id=bindparam("lease"),
                                           worker_id=bindparam("worker"), seq=bindparam("seq_no"),
                                           base_version=bindparam("base"), size_bytes=bindparam("size"),
                                           sha256=bindparam("digest"), tokens=bindparam("round_tokens"),
                                           steps=bindparam("round_steps"), received_at=bindparam("now"),
                                           outcome="queued")
                .returning(DeltaRecord.id))

# -- downloads ------------------------------------------------------------------------------------

# a shard's digest with its run's (no shard row: the run has no such shard; no row: no such run)
SHARD_OF = (select(Run.id.label("run_id"), Run.state, Shard.index, Shard.sha256)
            .outerjoin(Shard, and_(Shard.run_id == Run.id, Shard.index == bindparam("index")))
            .where(Run.name == bindparam("name")))


def snapshot_of(*, latest: bool):
    """A version's snapshot row with its run's: the newest version with a snapshot on disk when
    `latest`, else the version given. Columns: run_id, state, run_version, version (the one looked
    for), sha256 (None when that version has no snapshot); no row: no such run."""
    wanted = newest_snapshot(Run.id).correlate(Run) if latest else bindparam("version", type_=ModelVersion.version.type)
    return (select(Run.id.label("run_id"), Run.state, Run.version.label("run_version"), wanted.label("version"),
                   ModelVersion.sha256)
            .outerjoin(ModelVersion, and_(ModelVersion.run_id == Run.id, ModelVersion.version == wanted))
            .where(Run.name == bindparam("name")))


SNAPSHOT_LATEST = snapshot_of(latest=True)
SNAPSHOT_AT = snapshot_of(latest=False)
