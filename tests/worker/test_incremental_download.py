"""After its first snapshot, a worker downloads only the int8 change to each new base version
(GET /updates/{from}/{to}), re-syncs from a full snapshot every MAX_HOPS updates, and falls back
to the snapshot when the coordinator no longer keeps the version it holds."""

from __future__ import annotations

import re

import pytest
import torch

from shared.algorithms import sync
from shared.snapshot import decode_snapshot
from tests.conftest import schema_of
from tests.worker.test_resume import URL, AppTransport
from worker.client import CoordinatorClient, CoordinatorError
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
    # what the worker holds is version 2, up to int8 rounding of each change
    version, held = worker._snapshot
    assert version == 2
    lease_model = api.lease(api.register())
    exact, _ = decode_snapshot(api.snapshot(2), schema=schema_of(lease_model))
    v0, _ = decode_snapshot(api.snapshot(0), schema=schema_of(lease_model))
    for n in exact:
        assert (held[n] - exact[n]).abs().max() <= 2 * (exact[n] - v0[n]).abs().max() / 254 + 1e-6, n
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

    def gone(run, a, b):
        raise CoordinatorError(status, f"version {a} is no longer kept")

    monkeypatch.setattr(worker.client, "model_update", gone)
    assert worker.run() == 2
    assert [p.rsplit("/", 1)[1] for p in _gets(transport, "snapshots")] == ["0", "1"]
