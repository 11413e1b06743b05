"""Lease policy: the shard a lease claims (the SQL pick, on a real database of each backend), and the
pure rules of coordinator/scheduler.py (no database, no clock)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy import delete, insert

from coordinator.db import Database
from coordinator.models import Run, Shard
from coordinator.queries import leases as lease_rows
from coordinator.queries import runs as run_rows
from coordinator.scheduler import dense_equivalent_bytes, is_expired, lease_deadline, lease_seed, round_tokens
from coordinator.services.leases import Retry, pick_shard


@dataclass(frozen=True)
class ShardView:
    id: int
    index: int
    state: str  # pending | leased | done
    times_trained: int


@pytest.fixture
def db(settings):
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    database = Database(settings.resolved_database_url)
    yield database
    database.dispose()


def pick(db: Database, shards: list[ShardView]) -> tuple[int | None, bool]:
    """(id of the shard a lease of a run with these shards claims, or None; whether that opened a new
    epoch), through the statements a lease request runs, its retry included."""
    with db.begin() as c:
        c.execute(delete(Shard))
        c.execute(delete(Run))
        run_id = run_rows.insert_creating(c, name="r", config_json="{}", n_params=1, train_tokens=1, eval_tokens=1,
                                          join_key_hash=None)
        if shards:
            c.execute(insert(Shard), [{"id": s.id, "run_id": run_id, "index": s.index, "state": s.state,
                                       "times_trained": s.times_trained, "n_tokens": 1, "sha256": "0" * 64}
                                      for s in shards])
    claim = lease_rows.claim_statement(skip_locked=db.skip_locked)
    with db.read() as c:
        epoch = run_rows.by_id(c, run_id).epoch
    got: object = Retry.AGAIN
    for _ in range(2):  # a new epoch: the pick asks again, as LeaseService.grant does
        with db.begin() as c:
            got = pick_shard(c, claim, run_id, run_rows.by_id(c, run_id).epoch)
        if got is not Retry.AGAIN:
            break
    with db.read() as c:
        new_epoch = run_rows.by_id(c, run_id).epoch != epoch
    return (None if got is None else got.id), new_epoch


def shard(index: int, state: str = "pending", times: int = 0, id_offset: int = 100) -> ShardView:
    return ShardView(id=index + id_offset, index=index, state=state, times_trained=times)


def test_least_trained_pending_first(db):
    shards = [shard(0, times=2), shard(1, times=1), shard(2, "leased", times=0), shard(3, times=1)]
    assert pick(db, shards) == (101, False)  # 1 and 3 tie on times: lower index wins


def test_ties_broken_by_index_not_by_id_or_order(db):
    shards = [ShardView(id=7, index=5, state="pending", times_trained=0),
              ShardView(id=9, index=2, state="pending", times_trained=0),
              ShardView(id=1, index=8, state="pending", times_trained=0)]
    assert pick(db, shards) == (9, False)
    assert pick(db, list(reversed(shards))) == (9, False)


def test_pending_beats_done_even_if_done_is_less_trained(db):
    shards = [shard(0, "done", times=0), shard(1, "pending", times=5)]
    assert pick(db, shards) == (101, False)


def test_new_epoch_when_every_shard_is_done(db):
    shards = [shard(0, "done", times=3), shard(1, "done", times=2), shard(2, "done", times=2)]
    assert pick(db, shards) == (101, True)


@pytest.mark.parametrize("states", [["leased"], ["leased", "done"], ["done", "leased", "done"]])
def test_nothing_while_the_rest_are_leased(db, states):
    shards = [shard(i, s) for i, s in enumerate(states)]
    assert pick(db, shards) == (None, False)


def test_no_shards(db):
    assert pick(db, []) == (None, False)


def test_lease_deadline_and_expiry():
    now = datetime(2024, 5, 1, 12, 0, 0, tzinfo=timezone.utc)
    deadline = lease_deadline(now, 600.0)
    assert deadline == now + timedelta(minutes=10)
    assert lease_deadline(now, 0.25) == now + timedelta(milliseconds=250)
    assert not is_expired(deadline, now)
    assert not is_expired(deadline, deadline - timedelta(microseconds=1))
    assert is_expired(deadline, deadline)  # expiry is inclusive
    assert is_expired(deadline, deadline + timedelta(seconds=1))


def test_lease_seed():
    a = lease_seed(0, 1)
    assert a == lease_seed(0, 1)  # deterministic
    # pinned: a worker and the coordinator of another version must derive the same seeds
    assert a == 7359998640416684799 and lease_seed(42, 7) == 7990236334482511455
    seeds = [lease_seed(run, lease) for run in range(5) for lease in range(200)]
    assert all(0 <= s < 2**63 for s in seeds)  # 63 bits: fits a signed int64 everywhere
    assert len(set(seeds)) == len(seeds)
    assert max(seeds) >= 2**62  # uses the top bit of the 63, not a narrower range
    assert lease_seed(1, 2) != lease_seed(2, 1) and lease_seed(12, 3) != lease_seed(1, 23)


def test_round_tokens():
    assert round_tokens(steps=100, batch_size=16, context=128) == 204_800


def test_dense_equivalent_bytes():
    # one fp32 gradient up and one down per step
    assert dense_equivalent_bytes(worker_steps=1, n_params=1) == 8
    assert dense_equivalent_bytes(worker_steps=100, n_params=640_000) == 100 * 2 * 4 * 640_000
    assert dense_equivalent_bytes(worker_steps=0, n_params=10) == 0


def test_a_leases_lifetime_is_a_few_expected_rounds_within_bounds():
    from coordinator.scheduler import lease_lifetime_s

    # before any delivery the run's own lease_ttl_s is the expected round
    assert lease_lifetime_s([], lease_ttl_s=600, rounds=4, cap_s=6 * 3600) == 2400
    # the 90th percentile of recent rounds (slower machines than most still finish), times 4
    times = [10.0] * 9 + [100.0]
    assert lease_lifetime_s(times, lease_ttl_s=60, rounds=4, cap_s=6 * 3600) == 400
    assert lease_lifetime_s([10.0] * 20, lease_ttl_s=60, rounds=4, cap_s=6 * 3600) == 60  # never below the TTL
    assert lease_lifetime_s([5000.0], lease_ttl_s=60, rounds=4, cap_s=3600) == 3600  # the absolute cap
    assert lease_lifetime_s([5000.0], lease_ttl_s=7200, rounds=4, cap_s=3600) == 7200  # ...but never below the TTL
    assert lease_lifetime_s([-1.0, 0.0], lease_ttl_s=60, rounds=4, cap_s=3600) == 240  # clock skew is ignored


def test_a_renewal_never_passes_the_lifetime():
    from coordinator.scheduler import renewed_deadline

    t0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
    at = lambda s: t0 + timedelta(seconds=s)  # noqa: E731
    assert renewed_deadline(at(50), created_at=t0, ttl_s=60, lifetime_s=240) == at(110)
    assert renewed_deadline(at(200), created_at=t0, ttl_s=60, lifetime_s=240) == at(240)
    assert renewed_deadline(at(300), created_at=t0, ttl_s=60, lifetime_s=240) == at(240)
