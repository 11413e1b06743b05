"""Operator actions (pause/resume a run; list, revoke, re-admit workers) and rate limits."""

from __future__ import annotations

from sqlalchemy import select, update

from coordinator.models import Lease, Shard, Worker
from coordinator.settings import CoordinatorSettings
from tests.conftest import API

ADMIN = {"Authorization": "Bearer operator-secret-0123456789"}


def _settings(tmp_path, **kw) -> CoordinatorSettings:
    return CoordinatorSettings(data_dir=tmp_path / "coord", admin_token=ADMIN["Authorization"][7:], **kw)


def test_pause_stops_new_leases_and_resume_restarts_them(tmp_path, open_api, run_config):
    with open_api(_settings(tmp_path)) as api:
        api.create_run(run_config(), headers=ADMIN)
        w = api.register()
        resp = api.client.post(f"{API}/runs/t/pause", headers=ADMIN)
        assert resp.status_code == 200 and resp.json()["state"] == "paused"
        assert api.status()["state"] == "paused"
        resp = api.client.post(f"{API}/runs/t/leases", headers=w)
        assert resp.status_code == 204 and int(resp.headers["Retry-After"]) > 0
        assert api.client.post(f"{API}/runs/t/resume", headers=ADMIN).json()["state"] == "active"
        assert api.client.post(f"{API}/runs/t/leases", headers=w).status_code == 200
        assert api.client.post(f"{API}/runs/nope/pause", headers=ADMIN).status_code == 404


def test_revoke_frees_the_lease_and_locks_the_token_out(tmp_path, open_api, run_config, make_delta):
    with open_api(_settings(tmp_path)) as api:
        api.create_run(run_config(), headers=ADMIN)
        w, other = api.register(name="alice", team="blue"), api.register(name="bob")
        lease = api.lease(w)
        listed = api.client.get(f"{API}/runs/t/workers", headers=ADMIN).json()
        assert [(x["name"], x["team"], x["standing"], x["revoked"]) for x in listed] == [
            ("alice", "blue", "ok", False), ("bob", None, "ok", False)]
        wid = listed[0]["worker_id"]
        resp = api.client.post(f"{API}/runs/t/workers/{wid}/revoke", headers=ADMIN)
        assert resp.status_code == 200 and resp.json()["revoked"] is True
        with api.db() as s:
            assert s.get(Lease, lease.lease_id).state == "abandoned"
            assert s.scalar(select(Shard.state).where(Shard.index == lease.shard_id)) == "pending"
        for resp in (api.client.post(f"{API}/runs/t/leases", headers=w),
                     api.upload(lease.lease_id, make_delta(lease), w)):
            assert resp.status_code == 403 and "revoked" in resp.json()["detail"]
        assert api.client.post(f"{API}/runs/t/leases", headers=other).status_code == 200  # others carry on
        assert api.client.post(f"{API}/runs/t/workers/999/revoke", headers=ADMIN).status_code == 404


def test_banned_worker_is_refused_with_the_reason_until_readmitted(tmp_path, open_api, run_config):
    with open_api(_settings(tmp_path)) as api:
        api.create_run(run_config(), headers=ADMIN)
        w = api.register()
        with api.db() as s:
            s.execute(update(Worker).values(standing="banned", standing_reason="4 of its last 4 deltas rejected"))
            s.commit()
        resp = api.client.post(f"{API}/runs/t/leases", headers=w)
        assert resp.status_code == 403 and "banned: 4 of its last 4 deltas rejected" in resp.json()["detail"]
        assert (api.status()["workers_banned"], api.status()["workers_throttled"]) == (1, 0)
        flagged = [w for w in api.client.get(f"{API}/runs/t/workers", headers=ADMIN).json() if w["standing"] != "ok"]
        assert [f["standing"] for f in flagged] == ["banned"]
        wid = flagged[0]["worker_id"]
        resp = api.client.post(f"{API}/runs/t/workers/{wid}/readmit", headers=ADMIN)
        assert resp.status_code == 200 and resp.json()["standing"] == "ok"
        assert api.client.post(f"{API}/runs/t/leases", headers=w).status_code == 200
        assert api.status()["workers_banned"] == 0


def test_throttled_worker_waits_between_leases(tmp_path, open_api, run_config, make_delta):
    with open_api(_settings(tmp_path)) as api:
        api.create_run(run_config(shard_tokens=2048), headers=ADMIN)
        w = api.register()
        lease = api.lease(w)
        with api.db() as s:
            s.execute(update(Worker).values(standing="throttled", standing_reason="2 of its last 3 deltas rejected"))
            s.commit()
        resp = api.client.post(f"{API}/runs/t/leases", headers=w)  # it leased a moment ago
        assert resp.status_code == 429 and "throttled" in resp.json()["detail"]
        assert int(resp.headers["Retry-After"]) >= 1
        assert api.upload(lease.lease_id, make_delta(lease), w).status_code == 202  # its work still counts


def test_rate_limits_answer_429_with_retry_after(tmp_path, open_api, run_config, make_delta):
    settings = _settings(tmp_path, lease_rate=0.01, lease_burst=2, upload_rate=0.01, upload_burst=1,
                         register_rate=0.01, register_burst=3)
    with open_api(settings) as api:
        api.create_run(run_config(shard_tokens=2048), headers=ADMIN)
        w = api.register()
        first = api.lease(w)
        second = api.lease(w)  # gives up the first
        resp = api.client.post(f"{API}/runs/t/leases", headers=w)
        assert resp.status_code == 429 and int(resp.headers["Retry-After"]) > 1
        other = api.register()
        assert api.client.post(f"{API}/runs/t/leases", headers=other).status_code == 200  # per worker
        assert api.upload(second.lease_id, make_delta(second), w).status_code == 202
        resp = api.upload(second.lease_id, make_delta(second), w)  # even a retry must wait its turn
        assert resp.status_code == 429
        assert first.lease_id != second.lease_id
        api.register()
        resp = api.client.post(f"{API}/runs/t/workers", json={})
        assert resp.status_code == 429 and "registrations" in resp.json()["detail"]
