"""Leases: expiry, abandonment, late deltas, no-work answers and epochs (the run has 4 shards)."""

from __future__ import annotations

import time
from datetime import timedelta

from coordinator.models import Lease, Shard, utcnow
from shared import protocol

API = protocol.API_PREFIX
LATER = timedelta(days=30)  # past any lease's deadline in these runs (lease_ttl_s defaults to 600 s)


def _lease_states(api) -> dict[int, str]:
    with api.coordinator.sessions() as s:
        return {lease.id: lease.state for lease in s.query(Lease).all()}


def _shard_states(api) -> dict[int, str]:
    with api.coordinator.sessions() as s:
        return {shard.index: shard.state for shard in s.query(Shard).all()}


def test_expiry_returns_the_shard_to_the_queue(api, run):
    a, b = api.register(), api.register()
    first = api.lease(a)
    assert _shard_states(api)[first.shard_id] == "leased"
    assert api.coordinator.expire_leases() == 0  # not yet due
    assert api.coordinator.expire_leases(now=utcnow() + LATER) == 1
    assert _lease_states(api)[first.lease_id] == "expired"
    assert _shard_states(api)[first.shard_id] == "pending"
    assert api.status()["workers_active"] == 0
    assert api.coordinator.expire_leases(now=utcnow() + LATER) == 0  # expired once only
    # the least-trained pending shard with the lowest index goes out next: the same one
    again = api.lease(b)
    assert again.shard_id == first.shard_id and again.lease_id != first.lease_id


def test_a_short_ttl_expires_on_the_next_lease_request(api, run_config):
    api.create_run(run_config(lease_ttl_s=1.0))
    a, b = api.register(), api.register()
    first = api.lease(a)
    assert api.lease(b).shard_id != first.shard_id  # still held
    time.sleep(max(0.0, (first.deadline - utcnow()).total_seconds()) + 0.05)
    c = api.register()
    third = api.lease(c)  # granting expires the dead leases first
    assert third.shard_id == first.shard_id
    assert _lease_states(api)[first.lease_id] == "expired"


def test_a_new_lease_abandons_the_old_one(api, run, make_delta):
    a, b = api.register(), api.register()
    old = api.lease(a)
    new = api.lease(a)
    assert new.lease_id != old.lease_id
    states = _lease_states(api)
    assert states[old.lease_id] == "abandoned" and states[new.lease_id] == "active"
    other = api.lease(b)
    assert other.shard_id != new.shard_id  # the worker holds one shard, not two
    assert sorted(s for s in _shard_states(api).values()).count("leased") == 2
    assert api.status()["workers_active"] == 2

    late = api.upload(old.lease_id, make_delta(old), a)
    assert late.status_code == 410
    assert "newer lease" in late.json()["detail"]
    assert api.status()["pending_deltas"] == 0
    assert api.accept(new.lease_id, make_delta(new), a).will_merge_into == 1


def test_a_lease_still_uploading_is_kept_when_named(api, run, make_delta):
    """A worker that trains its next round while the last delta uploads names that lease (?keep=):
    it stays live (and its shard held); every other earlier lease is given up as before."""
    a, b = api.register(), api.register()
    first = api.lease(a)
    second = api.lease(a)  # first is given up: no keep
    resp = api.client.post(f"{API}/runs/t/leases", params={"keep": second.lease_id}, headers=a)
    assert resp.status_code == 200, resp.text
    third = protocol.Lease.model_validate(resp.json())
    states = _lease_states(api)
    assert (states[first.lease_id], states[second.lease_id], states[third.lease_id]) == \
        ("abandoned", "active", "active")
    assert third.shard_id != second.shard_id
    assert api.accept(second.lease_id, make_delta(second), a).will_merge_into == 1  # the kept one delivers
    assert api.accept(third.lease_id, make_delta(third, seed=1), a).will_merge_into == 2
    # keep must name one of the worker's own leases; a refusal changes nothing
    mine = api.lease(b)
    for keep, code in ((mine.lease_id, 403), (99999, 404), (-1, 422)):
        resp = api.client.post(f"{API}/runs/t/leases", params={"keep": keep}, headers=a)
        assert resp.status_code == code, resp.text
    assert _lease_states(api)[mine.lease_id] == "active"
    assert api.client.get("/healthz").json()["keeps_delivering_lease"] is True


def test_a_late_delta_on_an_expired_lease_is_still_merged(api, run, make_delta):
    slow, fast = api.register(), api.register()
    late_lease = api.lease(slow)
    api.coordinator.expire_leases(now=utcnow() + LATER)
    # the shard went back to the queue and someone else trained it meanwhile
    redo = api.lease(fast)
    assert redo.shard_id == late_lease.shard_id
    api.accept(redo.lease_id, make_delta(redo, seed=1), fast)
    assert api.drain() == 1

    ack = api.accept(late_lease.lease_id, make_delta(late_lease, seed=2), slow)
    assert ack.will_merge_into == 2 and not ack.duplicate
    assert api.drain() == 1
    st = api.status()
    assert (st["version"], st["merged_deltas"], st["rejected_deltas"]) == (2, 2, 0)
    from coordinator.models import DeltaRecord
    with api.coordinator.sessions() as s:
        rec = s.query(DeltaRecord).filter_by(seq=2).one()
        assert (rec.outcome, rec.staleness, rec.weight) == ("merged", 1, 1.0)


def test_a_delta_beyond_max_staleness_is_refused(api, run_config, make_delta):
    api.create_run(run_config(outer={"max_staleness": 1}))
    slow, fast = api.register(), api.register()
    stale = api.lease(slow)
    for seed in (1, 2):
        lease = api.lease(fast)
        api.accept(lease.lease_id, make_delta(lease, seed=seed), fast)
    assert api.drain() == 2
    resp = api.upload(stale.lease_id, make_delta(stale), slow)
    assert resp.status_code == 410
    assert "stale" in resp.json()["detail"]
    st = api.status()
    assert (st["version"], st["merged_deltas"], st["pending_deltas"]) == (2, 2, 0)


def test_no_work_while_every_shard_is_leased(api, run, make_delta):
    workers = [api.register() for _ in range(5)]
    leases = [api.lease(h) for h in workers[:4]]
    assert sorted(lease.shard_id for lease in leases) == [0, 1, 2, 3]
    resp = api.client.post(f"{API}/runs/t/leases", headers=workers[4])
    assert resp.status_code == 204
    assert resp.content == b""
    assert float(resp.headers["retry-after"]) > 0
    # a delivered shard is done for this epoch, not pending: still no work
    api.accept(leases[0].lease_id, make_delta(leases[0]), workers[0])
    assert api.client.post(f"{API}/runs/t/leases", headers=workers[4]).status_code == 204
    # an expired lease frees its shard
    api.coordinator.expire_leases(now=utcnow() + LATER)
    assert api.lease(workers[4]).shard_id == leases[1].shard_id
    assert api.status()["epoch"] == 0


def test_a_new_epoch_starts_when_every_shard_is_done(api, run, make_delta):
    headers = api.register()
    seen = []
    for i in range(4):
        lease = api.lease(headers)
        seen.append(lease.shard_id)
        api.accept(lease.lease_id, make_delta(lease, seed=i), headers)
    assert sorted(seen) == [0, 1, 2, 3]
    st = api.status()
    assert (st["epoch"], st["shards_done"], st["shards_total"]) == (0, 4, 4)

    nxt = api.lease(headers)
    assert nxt.shard_id == 0
    st = api.status()
    assert st["epoch"] == 1
    assert st["shards_done"] == 0
    states = _shard_states(api)
    assert states[0] == "leased" and [states[i] for i in (1, 2, 3)] == ["pending"] * 3
    with api.coordinator.sessions() as s:
        assert {sh.times_trained for sh in s.query(Shard).all()} == {1}
    # the epoch counts once: the second lease of the new epoch does not bump it again
    api.accept(nxt.lease_id, make_delta(nxt), headers)
    assert api.lease(headers).shard_id == 1
    assert api.status()["epoch"] == 1


def test_the_lr_follows_the_schedule(api, run_config, make_delta):
    cfg = run_config(schedule_tokens=768, inner={"lr": 1e-2, "min_lr_ratio": 0.1})
    api.create_run(cfg)
    headers = api.register()
    lrs = []
    for i in range(3):  # each delivered round is 3 * 4 * 32 = 384 tokens: half the schedule
        lease = api.lease(headers)
        lrs.append(lease.lr)
        api.accept(lease.lease_id, make_delta(lease, seed=i), headers)
    assert abs(lrs[0] - 1e-2) < 1e-12
    assert abs(lrs[1] - (1e-3 + 0.5 * 9e-3)) < 1e-12  # cosine half way: the midpoint
    assert abs(lrs[2] - 1e-3) < 1e-12  # the floor, and it stays there


def test_a_late_delta_does_not_free_a_shard_someone_else_holds(api, run, make_delta):
    """Lease A expires, B takes the shard; A delivers late: the shard stays B's (not done, not
    free to lease again, no early epoch) until B delivers."""
    slow, fast, other = api.register(), api.register(), api.register()
    a = api.lease(slow)
    api.coordinator.expire_leases(now=utcnow() + LATER)
    b = api.lease(fast)
    assert b.shard_id == a.shard_id
    api.accept(a.lease_id, make_delta(a, seed=1), slow)
    assert _shard_states(api)[a.shard_id] == "leased"  # still B's
    for _ in range(3):  # the other three shards
        lease = api.lease(other)
        assert lease.shard_id != a.shard_id
        api.accept(lease.lease_id, make_delta(lease), other)
    resp = api.client.post(f"{API}/runs/t/leases", headers=other)
    assert resp.status_code == 204  # no new epoch while B still trains its shard
    api.accept(b.lease_id, make_delta(b, seed=2), fast)
    assert _shard_states(api)[a.shard_id] == "done"
    assert api.lease(other).shard_id in range(4) and api.status()["epoch"] == 1
    with api.coordinator.sessions() as s:
        assert s.query(Shard).filter_by(index=a.shard_id).one().times_trained == 2


def test_renewal_extends_a_live_lease_only(api, run, make_delta):
    from datetime import datetime

    w, other = api.register(), api.register()
    lease = api.lease(w)
    resp = api.client.post(f"{API}/leases/{lease.lease_id}/renew", headers=w)
    assert resp.status_code == 200, resp.text
    new = datetime.fromisoformat(resp.json()["deadline"])
    assert new >= lease.deadline
    with api.coordinator.sessions() as s:
        stored = s.get(Lease, lease.lease_id).deadline
    assert stored.replace(tzinfo=None) == new.replace(tzinfo=None)
    assert api.client.post(f"{API}/leases/{lease.lease_id}/renew", headers=other).status_code == 403
    assert api.client.post(f"{API}/leases/98765/renew", headers=w).status_code == 404
    # an expired lease is not brought back (its shard may be someone else's)
    api.coordinator.expire_leases(now=utcnow() + LATER)
    resp = api.client.post(f"{API}/leases/{lease.lease_id}/renew", headers=w)
    assert resp.status_code == 410 and "expired" in resp.json()["detail"]
    # nor a delivered one
    lease2 = api.lease(w)
    api.accept(lease2.lease_id, make_delta(lease2), w)
    assert api.client.post(f"{API}/leases/{lease2.lease_id}/renew", headers=w).status_code == 410


def test_a_worker_gives_a_lease_back(api, run, make_delta):
    """DELETE /leases/{id}: the shard is free at once (a worker stopping with a lease it fetched
    ahead); again changes nothing; another worker's lease, an unknown one and a delivered one are
    refused with the reason."""
    a, b = api.register(), api.register()
    first = api.lease(a)
    gone = api.client.delete(f"{API}/leases/{first.lease_id}", headers=a)
    assert gone.status_code == 204 and gone.content == b""
    assert _lease_states(api)[first.lease_id] == "abandoned"
    assert _shard_states(api)[first.shard_id] == "pending"
    assert api.client.delete(f"{API}/leases/{first.lease_id}", headers=a).status_code == 204
    assert api.lease(b).shard_id == first.shard_id  # handed out again right away

    second = api.lease(a)
    other = api.client.delete(f"{API}/leases/{second.lease_id}", headers=b)
    assert other.status_code == 403 and "another worker" in other.json()["detail"]
    assert api.client.delete(f"{API}/leases/999999", headers=a).status_code == 404
    assert api.client.delete(f"{API}/leases/{second.lease_id}").status_code == 401
    api.accept(second.lease_id, make_delta(second), a)
    done = api.client.delete(f"{API}/leases/{second.lease_id}", headers=a)
    assert done.status_code == 409 and "delivered" in done.json()["detail"]
    assert _lease_states(api)[second.lease_id] == "delivered"
