"""snapshot_every: snapshots every N versions and whenever the queue runs dry; leases and
`latest` point at the newest snapshot; a restart between snapshots writes the missing one."""

from __future__ import annotations

import hashlib

from coordinator.models import ModelVersion
from coordinator.runtime import RunRuntime
from coordinator.settings import CoordinatorSettings
from shared import protocol
from shared.config import RunConfig
from shared.snapshot import decode_snapshot
from tests.conftest import API, schema_of
from tests.coordinator.test_merger import MANY_SHARDS, assert_same, replay


def _versions(api) -> list[int]:
    with api.db() as s:
        return sorted(v for (v,) in s.query(ModelVersion.version).all())


def test_snapshots_every_n_versions_and_when_the_queue_runs_dry(tmp_path, open_api, run_config, make_delta,
                                                                 monkeypatch):
    settings = CoordinatorSettings(data_dir=tmp_path / "c", snapshot_every=3)
    cfg = run_config(**MANY_SHARDS)  # test_merger's replay: the merge rule alone (no ramp)
    with open_api(settings) as api:
        api.create_run(cfg)
        workers = [api.register() for _ in range(5)]
        leases = [api.lease(h) for h in workers]
        sent = []
        for lease, h in zip(leases, workers):
            body = make_delta(lease, seed=lease.lease_id)
            api.accept(lease.lease_id, body, h)
            sent.append((body, lease.base_version))
        assert api.drain() == 5
        assert _versions(api) == [0, 3, 5]  # 3: every third; 5: the queue ran dry
        assert api.status()["version"] == 5
        resp = api.client.get(f"{API}/runs/t/snapshots/latest")
        assert resp.headers[protocol.H_VERSION] == "5"
        assert api.client.get(f"{API}/runs/t/snapshots/4").status_code == 410
        assert api.lease(workers[0]).base_version == 5
        # the snapshot holds the merged model: the same as an independent replay
        rcfg = RunConfig.model_validate(cfg)
        params, _ = decode_snapshot(resp.content, schema=schema_of(leases[0]))
        assert_same(params, replay(rcfg, sent))
        # two more deltas queued together: one snapshot, at the end of the queue
        more = [api.lease(h) for h in workers[1:3]]
        for lease, h in zip(more, workers[1:3]):
            api.accept(lease.lease_id, make_delta(lease, seed=100 + lease.lease_id), h)
        api.drain()
        assert _versions(api) == [0, 3, 5, 6, 7]  # 6 is a multiple of 3, 7 ends the queue

        # a crash between snapshots: merge one more without its snapshot reaching the database
        lease = api.lease(workers[3])
        api.accept(lease.lease_id, make_delta(lease, seed=7), workers[3])
        monkeypatch.setattr(RunRuntime, "merge_batch", _merge_without_snapshot(RunRuntime.merge_batch))
        api.drain()
        monkeypatch.undo()
        assert _versions(api) == [0, 3, 5, 6, 7]
    with open_api(settings) as api:
        assert 8 in _versions(api)  # written at start, so leases can hand version 8 out
        blob = api.snapshot("latest")
        with api.db() as s:
            row = s.query(ModelVersion).filter_by(version=8).one()
        assert hashlib.sha256(blob).hexdigest() == row.sha256
        assert api.lease(api.register()).base_version == 8


def _merge_without_snapshot(merge_batch):
    def patched(self, items, *, write_snapshot=True, prefetch=False):
        return merge_batch(self, items, write_snapshot=False, prefetch=prefetch)

    return patched


def test_costly_snapshots_keep_to_their_share_of_the_merger_time(tmp_path, open_api, run_config, make_delta):
    """snapshot_duty: while the last snapshot's cost is more than that share of the time since it
    began, merges write none (not even when the queue runs dry); the idle merger writes the newest
    version's once the share allows, and leases then hand it out."""
    import time

    settings = CoordinatorSettings(data_dir=tmp_path / "c", snapshot_every=1, snapshot_duty=0.2)
    cfg = run_config(**MANY_SHARDS)  # test_merger's replay: the merge rule alone (no ramp)
    with open_api(settings) as api:
        api.create_run(cfg)
        rt = api.runtime()
        assert rt.snapshot_allowed(0.2)  # nothing written yet by this process: free
        rt.snapshot_cost_s, rt.snapshot_done_at = 10.0, time.monotonic()  # as if a 10 s snapshot just ended
        assert not rt.snapshot_allowed(0.2) and not rt.snapshot_allowed(0.2, now=rt.snapshot_done_at + 39.9)
        assert rt.snapshot_allowed(0.2, now=rt.snapshot_done_at + 40.0)  # 10 s is 20% of the 50 s since it began
        done_at = rt.snapshot_done_at
        for clock in (8188.908823716, 1e6 + 0.1, 3.3):  # the boundary holds whatever the monotonic clock reads
            rt.snapshot_done_at = clock
            assert rt.snapshot_allowed(0.2, now=clock + 40.0) and not rt.snapshot_allowed(0.2, now=clock + 39.9)
        rt.snapshot_done_at = done_at
        assert rt.snapshot_allowed(1.0)
        workers = [api.register() for _ in range(2)]
        sent = []
        for h in workers:
            lease = api.lease(h)
            body = make_delta(lease, seed=lease.lease_id)
            api.accept(lease.lease_id, body, h)
            sent.append((body, lease.base_version))
        assert api.drain() == 2
        assert api.status()["version"] == 2 and _versions(api) == [0]  # held back
        assert api.lease(api.register()).base_version == 0
        assert not api.merger.catch_up_snapshot(rt)  # idle, but still within the 10 s snapshot's share
        rt.snapshot_done_at -= 40.0
        assert api.merger.catch_up_snapshot(rt)
        assert _versions(api) == [0, 2] and rt.snapshot_version == 2
        assert not api.merger.catch_up_snapshot(rt)  # nothing newer to write (a quick snapshot: the duty allows)
        assert api.lease(api.register()).base_version == 2
        params, _ = decode_snapshot(api.snapshot("latest"), schema=schema_of(lease))
        assert_same(params, replay(RunConfig.model_validate(cfg), sent))
        # a quick snapshot (this small model's) is never held back
        assert rt.snapshot_cost_s < RunRuntime.SNAPSHOT_FREE_S and rt.snapshot_allowed(0.01)
