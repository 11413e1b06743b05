"""Concurrent lease requests never get the same shard (SQLite ignores SELECT ... FOR UPDATE;
the claim is a conditional UPDATE, so exactly one request wins each shard)."""

from __future__ import annotations

import threading

from sqlalchemy import func, select

from coordinator.models import Lease
from shared import protocol


def test_concurrent_lease_requests_get_distinct_shards(api, run_config):
    api.create_run(run_config(shard_tokens=2048))  # 18 shards
    coord = api.coordinator
    workers = [coord.authenticate(api.register()["Authorization"][7:]) for _ in range(12)]
    barrier = threading.Barrier(len(workers))
    got: list[protocol.Lease | None] = []
    errors: list[BaseException] = []

    def take(w):
        try:
            barrier.wait()
            got.append(coord.grant_lease("t", w))
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=take, args=(w,)) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    shards = [lease.shard_id for lease in got if lease is not None]
    assert len(shards) == len(workers), "every request found work: there are more shards than workers"
    assert len(set(shards)) == len(shards), f"a shard was leased twice: {sorted(shards)}"
    with coord.sessions() as s:
        live = s.execute(select(Lease.shard_id, func.count()).where(Lease.state == "active")
                         .group_by(Lease.shard_id)).all()
    assert all(n == 1 for _, n in live)


def test_a_new_epoch_opens_once_under_concurrency(api, run_config, make_delta):
    api.create_run(run_config(shard_tokens=8192))  # 4 shards
    coord = api.coordinator
    headers = [api.register() for _ in range(4)]
    for h in headers:  # one epoch: every shard done
        lease = api.lease(h)
        api.accept(lease.lease_id, make_delta(lease), h)
    workers = [coord.authenticate(h["Authorization"][7:]) for h in headers]
    barrier = threading.Barrier(4)
    got = []

    def take(w):
        barrier.wait()
        got.append(coord.grant_lease("t", w))

    threads = [threading.Thread(target=take, args=(w,)) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(lease.shard_id for lease in got) == [0, 1, 2, 3]
    assert api.status()["epoch"] == 1
