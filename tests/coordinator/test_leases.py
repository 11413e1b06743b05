"""Leases: expiry, abandonment, late deltas, no-work answers and epochs (the run has 4 shards)."""

from __future__ import annotations

import time
from datetime import timedelta

from coordinator.models import Lease, Shard, utcnow
from shared import protocol

API = protocol.API_PREFIX
LATER = timedelta(days=30)  # past any lease's deadline in these runs (lease_ttl_s defaults to 600 s)


def _lease_states(api) -> dict[int, str]:
    with api.db() as s:
        return {lease.id: lease.state for lease in s.query(Lease).all()}


def _shard_states(api) -> dict[int, str]:
    with api.db() as s:
        return {shard.index: shard.state for shard in s.query(Shard).all()}


def test_expiry_returns_the_shard_to_the_queue(api, run):
    a, b = api.register(), api.register()
    first = api.lease(a)
    assert _shard_states(api)[first.shard_id] == "leased"
    assert api.coordinator.leases.expire() == 0  # not yet due
    assert api.coordinator.leases.expire(now=utcnow() + LATER) == 1
    assert _lease_states(api)[first.lease_id] == "expired"
    assert _shard_states(api)[first.shard_id] == "pending"
    assert api.status()["workers_active"] == 0
    assert api.coordinator.leases.expire(now=utcnow() + LATER) == 0  # expired once only
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
    """A slow honest worker keeps its round while nobody took its shard: its lease expired, but the
    shard still waits in the queue, so the late delta is merged and the shard is done."""
    slow = api.register()
    late_lease = api.lease(slow)
    api.coordinator.leases.expire(now=utcnow() + LATER)
    assert _shard_states(api)[late_lease.shard_id] == "pending"

    ack = api.accept(late_lease.lease_id, make_delta(late_lease, seed=2), slow)
    assert ack.will_merge_into == 1 and not ack.duplicate
    assert api.drain() == 1
    st = api.status()
    assert (st["version"], st["merged_deltas"], st["rejected_deltas"]) == (1, 1, 0)
    assert _shard_states(api)[late_lease.shard_id] == "done"


def test_an_expired_lease_whose_shard_was_reissued_cannot_deliver(api, run, make_delta):
    """Issue 18: an expired lease whose shard went to another worker (or was trained since) is
    refused 410 with the reason, and nothing changes: no version, no tokens, no credit, no mark
    against the slow worker's standing (the expiry was not proof of bad faith)."""
    from coordinator.models import DeltaRecord, Refusal, Worker

    slow, fast = api.register(name="slow"), api.register(name="fast")
    late_lease = api.lease(slow)
    api.coordinator.leases.expire(now=utcnow() + LATER)
    redo = api.lease(fast)  # the shard went back to the queue and someone else took it
    assert redo.shard_id == late_lease.shard_id
    snap = api.snapshot("latest")

    resp = api.upload(late_lease.lease_id, make_delta(late_lease, seed=2), slow)  # while the other holds it
    assert resp.status_code == 410, resp.text
    assert "leased again" in resp.json()["detail"]
    assert _shard_states(api)[redo.shard_id] == "leased"
    api.accept(redo.lease_id, make_delta(redo, seed=1), fast)
    assert api.drain() == 1
    resp = api.upload(late_lease.lease_id, make_delta(late_lease, seed=3), slow)  # once the other trained it
    assert resp.status_code == 410, resp.text
    assert api.drain() == 0
    st = api.status()
    assert (st["version"], st["merged_deltas"], st["pending_deltas"]) == (1, 1, 0)
    assert api.snapshot(0) == snap
    with api.db() as s:
        assert s.query(DeltaRecord).filter_by(lease_id=late_lease.lease_id).count() == 0
        assert _lease_states(api)[late_lease.lease_id] == "expired"
        w = s.query(Worker).filter_by(name="slow").one()
        assert (w.credit, w.tokens_trained, w.deltas_accepted, w.standing) == (0.0, 0, 0, "ok")
        assert s.query(Refusal).filter_by(worker_id=w.id).count() == 0
        assert s.query(Shard).filter_by(index=redo.shard_id).one().times_trained == 1


def test_a_lease_given_up_while_its_delta_uploads_cannot_deliver(api, run, make_delta, monkeypatch):
    """A lease given up (the worker took a newer one without keeping it) between the upload's checks and
    its acknowledgement delivers nothing: 410, no delta row, no staged file, its shard left to whoever
    holds it now. Before, the acknowledgement marked any lease but a delivered one delivered."""
    from sqlalchemy import update

    from coordinator.models import DeltaRecord

    headers = api.register()
    lease = api.lease(headers)
    coord = api.coordinator
    ack = coord.uploads.ack

    def given_up_meanwhile(c, lease_id, *args, **kwargs):
        with coord.db.engine.begin() as other:  # another request of the worker gives the lease up
            other.execute(update(Lease).where(Lease.id == lease_id).values(state="abandoned"))
        return ack(c, lease_id, *args, **kwargs)

    monkeypatch.setattr(coord.uploads, "ack", given_up_meanwhile)
    resp = api.upload(lease.lease_id, make_delta(lease), headers)
    assert resp.status_code == 410, resp.text
    assert "given up" in resp.json()["detail"]
    monkeypatch.undo()
    assert api.drain() == 0 and api.status()["version"] == 0
    with api.db() as s:
        assert s.query(DeltaRecord).filter_by(lease_id=lease.lease_id).count() == 0
    assert _lease_states(api)[lease.lease_id] == "abandoned"
    assert not list(coord.storage.staged_deltas(lease_id_run(api)))


def lease_id_run(api) -> int:
    return api.runtime().run_id


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
    api.coordinator.leases.expire(now=utcnow() + LATER)
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
    with api.db() as s:
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
    """Lease A expires, B takes the shard; A tries to deliver late: refused (410: the shard was
    re-issued), and the shard stays B's (not done, not free to lease again, no early epoch) until
    B delivers. (Before issue 18 A's delta was merged too: the shard trained twice.)"""
    slow, fast, other = api.register(), api.register(), api.register()
    a = api.lease(slow)
    api.coordinator.leases.expire(now=utcnow() + LATER)
    b = api.lease(fast)
    assert b.shard_id == a.shard_id
    assert api.upload(a.lease_id, make_delta(a, seed=1), slow).status_code == 410
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
    with api.db() as s:
        assert s.query(Shard).filter_by(index=a.shard_id).one().times_trained == 1  # B's round only


def test_renewal_extends_a_live_lease_only(api, run, make_delta):
    from datetime import datetime

    w, other = api.register(), api.register()
    lease = api.lease(w)
    resp = api.client.post(f"{API}/leases/{lease.lease_id}/renew", params={"step": 1}, headers=w)
    assert resp.status_code == 200, resp.text
    new = datetime.fromisoformat(resp.json()["deadline"])
    assert new >= lease.deadline
    with api.db() as s:
        stored = s.get(Lease, lease.lease_id).deadline
    assert stored.replace(tzinfo=None) == new.replace(tzinfo=None)
    assert api.client.post(f"{API}/leases/{lease.lease_id}/renew", headers=other).status_code == 403
    assert api.client.post(f"{API}/leases/98765/renew", headers=w).status_code == 404
    # an expired lease is not brought back (its shard may be someone else's)
    api.coordinator.leases.expire(now=utcnow() + LATER)
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


def _renew(api, lease_id: int, headers: dict, step: int | None):
    return api.client.post(f"{API}/leases/{lease_id}/renew", params={} if step is None else {"step": step},
                           headers=headers)


def test_a_renewal_must_show_progress(api, run):
    """Issue 18 (hoarding): a renewal reports the round's local step, past the one the last renewal
    reported; no step (422), no progress (409) and a step the round does not have (422, counted
    against the worker) are refused and change nothing."""
    from coordinator.models import Refusal

    w = api.register()
    lease = api.lease(w)

    def stored():
        with api.db() as s:
            row = s.get(Lease, lease.lease_id)
            return row.deadline, row.progress_step

    resp = _renew(api, lease.lease_id, w, None)
    assert resp.status_code == 422 and "step" in resp.json()["detail"]
    assert _renew(api, lease.lease_id, w, 1).status_code == 200
    after_first = stored()
    assert after_first[1] == 1
    for step in (1, 0):  # the round did not move
        resp = _renew(api, lease.lease_id, w, step)
        assert resp.status_code == 409, resp.text
        assert "no progress" in resp.json()["detail"]
    assert stored() == after_first
    resp = _renew(api, lease.lease_id, w, run.inner.steps + 1)
    assert resp.status_code == 422 and f"{run.inner.steps} steps" in resp.json()["detail"]
    assert stored() == after_first
    with api.db() as s:
        assert [r.kind for r in s.query(Refusal).all()] == ["renew"]  # the impossible step counts
    assert _renew(api, lease.lease_id, w, 2).status_code == 200
    assert stored()[1] == 2


def test_the_lease_lifetime_caps_renewals_and_the_sweep_reissues_the_shard(open_api, settings, run_config):
    """Issue 18 (hoarding): renewing with progress extends a lease at most to its lifetime (here,
    before any delivery: 4 x lease_ttl_s = 240 s); past it the renewal is refused (409), the
    deadline stays bounded, and the expiry sweep hands the shard to another worker."""
    from datetime import timezone

    from coordinator.errors import Conflict

    with open_api(settings.model_copy(update={"lease_lifetime_rounds": 4.0})) as api:
        api.create_run(run_config(lease_ttl_s=60.0, inner={"steps": 20}))
        coord = api.coordinator
        hoarder, honest = api.register(), api.register()
        lease = api.lease(hoarder)
        worker = coord.workers.authenticate(hoarder["Authorization"][7:])
        with api.db() as s:
            t0 = s.get(Lease, lease.lease_id).created_at
        t0 = t0 if t0.tzinfo else t0.replace(tzinfo=timezone.utc)  # SQLite hands datetimes back naive (UTC)
        at = lambda s_: t0 + timedelta(seconds=s_)  # noqa: E731
        assert coord.leases.renew(lease.lease_id, worker, step=1, now=at(50)).deadline == at(110)
        assert coord.leases.renew(lease.lease_id, worker, step=2, now=at(100)).deadline == at(160)
        assert coord.leases.renew(lease.lease_id, worker, step=3, now=at(150)).deadline == at(210)
        assert coord.leases.renew(lease.lease_id, worker, step=4, now=at(200)).deadline == at(240)  # capped
        try:
            coord.leases.renew(lease.lease_id, worker, step=5, now=at(230))
            raise AssertionError("a renewal past the lease's lifetime was granted")
        except Conflict as exc:
            assert exc.status_code == 409 and "lifetime" in exc.detail
        with api.db() as s:
            row = s.get(Lease, lease.lease_id)
            assert row.progress_step == 4
            deadline = row.deadline if row.deadline.tzinfo else row.deadline.replace(tzinfo=timezone.utc)
        assert deadline == at(240)
        assert coord.leases.expire(now=at(239)) == 0
        assert coord.leases.expire(now=at(240)) == 1
        assert _lease_states(api)[lease.lease_id] == "expired"
        assert _shard_states(api)[lease.shard_id] == "pending"
        assert api.lease(honest).shard_id == lease.shard_id  # re-issued


def test_one_address_cannot_hoard_every_shard(open_api, settings, run_config):
    """Issue 18 (hoarding): tokens minted from one address hold at most max_leases_per_address live
    leases of a run (an IPv6 address counts by its /64); past it 429 + Retry-After with the reason,
    and nothing changes. An honest worker from another address still gets a lease."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from fastapi.testclient import TestClient
    from tests.conftest import Api

    def client_at(api, host: str) -> Api:
        return Api(TestClient(api.client.app, base_url=str(api.client.base_url), client=(host, 40000)))

    with open_api(settings.model_copy(update={"max_leases_per_address": 2})) as api:
        api.create_run(run_config(shard_tokens=2048))  # 18 shards: the cap, not the shards, stops the hoarder
        hoarder = [api.register() for _ in range(4)]  # all from one address ("testclient")
        held = [api.lease(h) for h in hoarder[:2]]
        shards_before, leases_before = _shard_states(api), _lease_states(api)
        for h in hoarder[2:]:
            resp = api.client.post(f"{API}/runs/t/leases", headers=h)
            assert resp.status_code == 429, resp.text
            assert "max_leases_per_address" in resp.json()["detail"] and int(resp.headers["retry-after"]) >= 1
        assert _shard_states(api) == shards_before and _lease_states(api) == leases_before  # nothing changed
        assert list(_shard_states(api).values()).count("pending") == 16
        # a worker of the address asking again gives its own lease up first: it still gets one
        again = api.lease(hoarder[0])
        assert _lease_states(api)[held[0].lease_id] == "abandoned" and again.lease_id != held[0].lease_id

        honest = client_at(api, "198.51.100.7")
        assert honest.lease(honest.register()).shard_id in range(18)
        # IPv6: one /64 is one address; the next /64 is another
        same = [client_at(api, f"2001:db8:0:1::{i}") for i in (1, 2, 3)]
        same_headers = [c.register() for c in same]
        same[0].lease(same_headers[0])
        same[1].lease(same_headers[1])
        resp = same[2].client.post(f"{API}/runs/t/leases", headers=same_headers[2])
        assert resp.status_code == 429, resp.text
        neighbour = client_at(api, "2001:db8:0:2::1")
        assert neighbour.lease(neighbour.register()).shard_id in range(18)


def test_the_registration_burst_is_small(open_api, settings, run_config):
    """Issue 18 (hoarding): one address could register 100 workers at once (58 tokens in 0.6 s);
    the default burst now stops it within a handful, with 429 + Retry-After, and what was refused
    created no worker."""
    from coordinator.models import Worker

    assert settings.register_burst <= 10
    with open_api(settings) as api:
        api.create_run(run_config())
        # the limiter's clock stands still: on a loaded machine 20 registrations took long enough for
        # the 1/s refill to let an eleventh through, and the burst is what this test is about
        limiter = api.coordinator.workers.limiter
        limiter.clock = lambda now=limiter.clock(): now
        codes = [api.client.post(f"{API}/runs/t/workers", json={}).status_code for _ in range(20)]
        assert codes.count(201) <= 10 and codes[-1] == 429
        resp = api.client.post(f"{API}/runs/t/workers", json={})
        assert resp.status_code == 429 and int(resp.headers["retry-after"]) >= 1
        with api.db() as s:
            assert s.query(Worker).count() == codes.count(201)


def test_a_banned_worker_s_leases_go_back_to_the_queue(api, run):
    """A banned worker delivers nothing more, so the shards it holds return now, not at their deadlines:
    an attacker banned mid-round once held its shard while the honest workers found no work (204)."""
    headers = api.register()
    lease = api.lease(headers)
    wid = api.coordinator.workers.authenticate(headers["Authorization"].split()[1]).id
    for i in range(4):  # ban_after refusals of its own doing
        api.coordinator.workers.count_refusal(wid, lease_run_id(api, lease.lease_id), 0, reason=f"refused {i}",
                                              kind="exchange")
    with api.db() as s:
        row = s.get(Lease, lease.lease_id)
        assert row.state == "abandoned"
        assert s.get(Shard, row.shard_id).state == "pending"
    other = api.lease(api.register())
    assert other.shard_id == lease.shard_id  # the next worker gets it at once


def lease_run_id(api, lease_id: int) -> int:
    with api.db() as s:
        return s.get(Lease, lease_id).run_id


def test_a_worker_asks_whether_its_lease_still_stands(api, run, make_delta):
    """GET /leases/{id} (a worker resuming a saved round asks before training on): live; expired but
    still taken while its shard is not leased again; expired and leased again; given up; delivered.
    Another worker's lease is 403, none is 404."""
    a, b = api.register(), api.register()
    first = api.lease(a)

    def standing(lease_id: int, who: dict = a) -> dict:
        resp = api.client.get(f"{API}/leases/{lease_id}", headers=who)
        assert resp.status_code == 200, resp.text
        return resp.json()

    assert standing(first.lease_id) | {"reason": ""} == {"lease_id": first.lease_id, "state": "active",
                                                          "deliverable": True, "reason": ""}
    assert api.client.get(f"{API}/leases/{first.lease_id}", headers=b).status_code == 403
    assert api.client.get(f"{API}/leases/{first.lease_id + 99}", headers=a).status_code == 404
    api.coordinator.leases.expire(now=utcnow() + LATER)
    got = standing(first.lease_id)
    assert (got["state"], got["deliverable"]) == ("expired", True) and "not leased again yet" in got["reason"]
    again = api.lease(b)
    assert again.shard_id == first.shard_id
    got = standing(first.lease_id)
    assert (got["state"], got["deliverable"]) == ("expired", False) and "leased to another worker" in got["reason"]
    second = api.lease(a)
    third = api.lease(a)  # gives the second up
    assert (standing(second.lease_id)["state"], standing(second.lease_id)["deliverable"]) == ("abandoned", False)
    api.accept(third.lease_id, make_delta(third), a)
    assert (standing(third.lease_id)["state"], standing(third.lease_id)["deliverable"]) == ("delivered", False)
