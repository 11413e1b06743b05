"""Concurrent requests on the same rows: lease requests never get the same shard (the claim is one
conditional UPDATE whose pick skips rows others are claiming, coordinator/queries.py), an epoch
opens once, and uploads of one lease racing each other deliver it once."""

from __future__ import annotations

import threading

from sqlalchemy import func, select

from coordinator.errors import Conflict
from coordinator.models import DeltaRecord, Lease, Run, Shard, Worker
from shared import protocol


def test_concurrent_lease_requests_get_distinct_shards(open_api, settings, run_config):
    # 12 workers register from one address (testclient): more than the registration burst allows
    with open_api(settings.model_copy(update={"register_rate": 0.0})) as api:
        _concurrent_lease_requests_get_distinct_shards(api, run_config)


def _concurrent_lease_requests_get_distinct_shards(api, run_config):
    api.create_run(run_config(shard_tokens=2048))  # 18 shards
    coord = api.coordinator
    workers = [coord.workers.authenticate(api.register()["Authorization"][7:]) for _ in range(12)]
    barrier = threading.Barrier(len(workers))
    got: list[protocol.Lease | None] = []
    errors: list[BaseException] = []

    def take(w):
        try:
            barrier.wait()
            got.append(coord.leases.grant("t", w))
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
    with api.db() as s:
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
    workers = [coord.workers.authenticate(h["Authorization"][7:]) for h in headers]
    barrier = threading.Barrier(4)
    got = []

    def take(w):
        barrier.wait()
        got.append(coord.leases.grant("t", w))

    threads = [threading.Thread(target=take, args=(w,)) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(lease.shard_id for lease in got) == [0, 1, 2, 3]
    assert api.status()["epoch"] == 1


def test_uploads_of_one_lease_racing_each_other_deliver_it_once(api, run, make_delta, monkeypatch):
    coord = api.coordinator
    h = api.register()
    lease = api.lease(h)
    worker = coord.workers.authenticate(h["Authorization"][7:])
    same, other = make_delta(lease, seed=1), make_delta(lease, seed=2)
    # all three pass their checks and stage their bytes before any of them acknowledges
    barrier = threading.Barrier(3)
    write = coord.storage.write
    monkeypatch.setattr(coord.storage, "write", lambda name, data: (write(name, data), barrier.wait(timeout=30)))
    answers: dict[int, object] = {}

    def upload(i, body):
        try:
            answers[i] = coord.uploads.accept(lease.lease_id, worker, body)
        except Conflict as exc:
            answers[i] = exc

    threads = [threading.Thread(target=upload, args=(i, body)) for i, body in enumerate((same, same, other))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    monkeypatch.setattr(coord.storage, "write", write)
    accepted = [a for a in answers.values() if not isinstance(a, Conflict)]
    conflicts = [a for a in answers.values() if isinstance(a, Conflict)]
    # either the pair of identical bodies won (one of them a duplicate) or the other body did
    assert (len(accepted), len(conflicts)) in ((2, 1), (1, 2)), answers
    assert len({a.delta_id for a in accepted}) == 1 and sum(not a.duplicate for a in accepted) == 1
    winner = same if len(accepted) == 2 else other
    with api.db() as s:
        assert s.scalar(select(func.count()).select_from(DeltaRecord)) == 1
        assert s.scalar(select(Run.next_seq)) == 2
        assert s.scalar(select(Worker.deltas_accepted).where(Worker.id == worker.id)) == 1
        assert s.scalar(select(Shard.times_trained).where(Shard.index == lease.shard_id)) == 1
        assert s.get(Lease, lease.lease_id).state == "delivered"
    staged = [n for n in coord.storage.list(coord.storage.deltas(api.runtime().run_id)) if n.endswith(".staged")]
    assert [coord.storage.read(n) for n in staged] == [winner]  # the loser's bytes are gone
    assert api.drain() == 1
