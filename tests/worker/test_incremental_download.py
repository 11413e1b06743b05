"""A worker builds version 0 from the run's seed (checking only its hash); after its first copy it
downloads only the change (int4 or int8, the run's update_values) to each new base version
(GET /updates/{from}/{to}), re-syncs from a full snapshot every MAX_HOPS updates, and falls back
to the snapshot when the coordinator no longer keeps the version it holds. In a run with
update_feedback each update is taken from the copy it holds (GET /updates/{from}/{to}/{copy_digest})
and no number of them calls for a snapshot."""

from __future__ import annotations

import re

import httpx
import pytest
import torch

from shared import protocol
from shared.algorithms import sync
from shared.snapshot import decode_snapshot
from tests.conftest import schema_of
from tests.worker.test_resume import URL, AppTransport
from worker.client import CoordinatorClient, CoordinatorError, IntegrityError
from worker.loop import Worker
from worker.settings import WorkerSettings


class MergingTransport(AppTransport):
    """The in-process app, merging each delta as soon as it arrives (as the merger thread would)."""

    def handle_request(self, request):
        resp = super().handle_request(request)
        if request.method == "POST" and request.url.path.endswith("/delta"):
            resp.read()
            self.api.drain()
        return resp


def _worker(api, tmp_path, rounds):
    transport = MergingTransport(api)
    settings = WorkerSettings(coordinator=URL, run="t", state_dir=tmp_path / "worker", device="cpu",
                              max_rounds=rounds)
    worker = Worker(settings, client=CoordinatorClient(URL, transport=transport, max_retries=2))
    # rounds in sequence: each lease after the previous delta was merged (leasing ahead, the next round
    # would start from the version before it, and there would be fewer versions to update across)
    worker.lease_ahead = False
    return worker, transport


def _gets(transport, kind):
    return [p for m, p in transport.log if m == "GET" and re.search(rf"/{kind}/", p)]


def test_rounds_after_the_first_download_only_the_change(api, run, tmp_path):
    worker, transport = _worker(api, tmp_path, rounds=3)
    assert worker.run() == 3
    assert [p.rsplit("/", 1)[1] for p in _gets(transport, "snapshots")] == ["0"]
    assert [p.split("/updates/")[1] for p in _gets(transport, "updates")] == ["0/1", "1/2"]
    # what the worker holds is version 2, up to the int4 rounding (the run's update_values) of each change
    version, held = worker.downloads.held
    assert version == 2
    lease_model = api.lease(api.register())
    exact, _ = decode_snapshot(api.snapshot(2), schema=schema_of(lease_model))
    v0, _ = decode_snapshot(api.snapshot(0), schema=schema_of(lease_model))
    for n in exact:
        assert (held[n] - exact[n]).abs().max() <= 2 * (exact[n] - v0[n]).abs().max() / 14 + 1e-6, n
    # and it is not the exact copy: it really came from the updates
    assert any(not torch.equal(held[n], exact[n]) for n in exact)


def test_a_full_snapshot_every_max_hops(api, run, tmp_path, monkeypatch):
    monkeypatch.setattr(sync, "MAX_HOPS", 1)
    worker, transport = _worker(api, tmp_path, rounds=3)
    worker.run()
    assert [p.rsplit("/", 1)[1] for p in _gets(transport, "snapshots")] == ["0", "2"]
    assert [p.split("/updates/")[1] for p in _gets(transport, "updates")] == ["0/1"]


@pytest.mark.parametrize("status", [404, 410])
def test_falls_back_to_the_snapshot_when_the_update_is_gone(api, run, tmp_path, monkeypatch, status):
    worker, transport = _worker(api, tmp_path, rounds=2)

    def gone(run, a, b, *, copy=None, max_bytes=None):
        raise CoordinatorError(status, f"version {a} is no longer kept")

    monkeypatch.setattr(worker.client, "model_update", gone)
    assert worker.run() == 2
    assert [p.rsplit("/", 1)[1] for p in _gets(transport, "snapshots")] == ["0", "1"]


def test_version_zero_is_built_from_the_run_seed_and_only_its_hash_checked(api, run, tmp_path):
    worker, transport = _worker(api, tmp_path, rounds=1)
    lease = api.lease(api.register())
    assert lease.base_version == 0 and lease.init_seed is not None
    params = worker.downloads.base(lease)
    assert _gets(transport, "snapshots") == ["/api/v1/runs/t/snapshots/0"]
    assert worker.client.bytes_down == 0  # a 304: the coordinator's snapshot 0 has this copy's hash
    want, _ = decode_snapshot(api.snapshot(0), schema=schema_of(lease))
    assert all(torch.equal(params[n], want[n]) for n in want)
    assert worker.downloads.held[0] == 0


@pytest.mark.parametrize("seed", ["other", None])
def test_version_zero_is_downloaded_when_the_seed_does_not_give_it(api, run, tmp_path, seed):
    """A seed that builds other weights (or none: an older coordinator) costs the download, nothing else."""
    worker, transport = _worker(api, tmp_path, rounds=1)
    lease = api.lease(api.register())
    lease = lease.model_copy(update={"init_seed": None if seed is None else lease.init_seed + 1})
    params = worker.downloads.base(lease)
    blob = api.snapshot(0)
    assert worker.client.bytes_down == len(blob)
    want, _ = decode_snapshot(blob, schema=schema_of(lease))
    assert all(torch.equal(params[n], want[n]) for n in want)


def test_a_304_for_another_hash_is_refused():
    """An answer that claims a copy is current must name that copy's hash."""
    def answer(request):
        assert request.headers["If-None-Match"] == '"' + "0" * 64 + '"'
        return httpx.Response(304, headers={protocol.H_SHA256: "f" * 64, protocol.H_VERSION: "0"})

    client = CoordinatorClient(URL, transport=httpx.MockTransport(answer), max_retries=0)
    with pytest.raises(IntegrityError, match="304"):
        client.snapshot("t", 0, if_sha256="0" * 64)


def test_with_update_feedback_each_update_is_taken_from_the_copy_held(api, run_config, tmp_path, monkeypatch):
    monkeypatch.setattr(sync, "MAX_HOPS", 1)  # would take a snapshot after every update, but for the feedback
    api.create_run(run_config(update_values="int1", update_feedback=True))
    worker, transport = _worker(api, tmp_path, rounds=4)
    assert worker.run() == 4
    assert [p.rsplit("/", 1)[1] for p in _gets(transport, "snapshots")] == ["0"]
    updates = [p.split("/updates/")[1] for p in _gets(transport, "updates")]
    # the first from version 0 as the worker holds it (it learns the run's updates come from copies), then
    # from its copy, named by its digest
    assert updates[0] == "0/1" and [u.rsplit("/", 1)[0] for u in updates[1:]] == ["1/2", "2/3"]
    assert all(len(u.rsplit("/", 1)[1]) == 64 for u in updates[1:])
    version, held = worker.downloads.held
    assert version == 3 and worker.downloads.hops == 0 and "t" in worker.downloads.feedback_runs
    # the coordinator keeps the very copy the worker holds: the next update would be taken from it
    assert api.coordinator.storage.exists(api.coordinator.storage.copy(1, sync.copy_digest(held)))


def test_a_copy_the_coordinator_no_longer_keeps_costs_one_snapshot(api, run_config, tmp_path, make_delta):
    api.create_run(run_config(update_values="int1", update_feedback=True))
    worker, transport = _worker(api, tmp_path, rounds=2)
    assert worker.run() == 2 and worker.downloads.held[0] == 1 and "t" in worker.downloads.feedback_runs
    storage = api.coordinator.storage
    for name in storage.list(storage.copies(1)):
        storage.delete(name)  # pruned (more workers than MAX_COPIES), or the coordinator moved to a new data dir
    other = api.register()
    lease = api.lease(other)
    api.accept(lease.lease_id, make_delta(lease, seed=5, scale=2e-3), other)
    api.drain()
    params = worker.downloads.base(lease.model_copy(update={"base_version": 3}))  # asks from its copy: 410
    assert [p.rsplit("/", 1)[1] for p in _gets(transport, "snapshots")] == ["0", "3"]
    exact, _ = decode_snapshot(api.snapshot(3), schema=schema_of(lease))
    assert all(torch.equal(params[n], exact[n]) for n in exact)
    assert worker.downloads.held[0] == 3 and worker.downloads.hops == 0
