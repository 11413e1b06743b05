"""A crash loses no answered exchange: exchanges and deltas are replayed in their original order.

The "crash" here is a shutdown whose final checkpoint never happens (as after SIGKILL): the
restart must rebuild the global model from the last checkpoint, the logged exchanges and the
acknowledged deltas, bit for bit."""

from __future__ import annotations

import logging

import torch

from coordinator import checkpoints
from coordinator.settings import CoordinatorSettings
from shared import codec
from shared.algorithms.sparta import exchange_seed, select
from tests.conftest import API

STEPS, EVERY = 4, 2


def _exchange(api, lease, step, headers, seed):
    g = torch.Generator().manual_seed(seed)
    # drift within what the run's AdamW steps can move an element (the coordinator refuses more)
    live = {n: t.clone() + 1e-3 * torch.randn(t.shape, generator=g) for n, t in api.runtime().state.params.items()}
    sent = select(live, p=0.2, seed=exchange_seed(lease.seed, step), values="fp16", base_version=lease.base_version)
    resp = api.client.post(f"{API}/leases/{lease.lease_id}/exchange", params={"step": step},
                           content=codec.encode(sent), headers={**headers, "Content-Type": "application/octet-stream"})
    assert resp.status_code == 200, resp.text


def test_exchanges_and_deltas_replay_in_order_after_a_crash(tmp_path, open_api, run_config, make_delta,
                                                             monkeypatch, caplog):
    settings = CoordinatorSettings(data_dir=tmp_path / "coord", checkpoint_every=3)
    cfg = run_config(algorithm="sparta+diloco", shard_tokens=2048, inner={"steps": STEPS, "batch_size": 2},
                     sparta={"p": 0.2, "every": EVERY}, outer={"group": 2})
    with open_api(settings) as api:
        api.create_run(cfg)
        workers = [api.register() for _ in range(2)]
        seed = 0
        for _ in range(3):  # rounds: exchanges interleaved with merges, checkpoints at version 3 and 6
            leases = [api.lease(h) for h in workers]
            for i, step in ((0, EVERY), (1, EVERY), (0, 2 * EVERY)):
                seed += 1
                _exchange(api, leases[i], step, workers[i], seed)
            api.accept(leases[0].lease_id, make_delta(leases[0], seed=seed), workers[0])
            api.drain()  # a merge between two exchanges of worker 1's lease
            _exchange(api, leases[1], 2 * EVERY, workers[1], seed + 50)
            api.accept(leases[1].lease_id, make_delta(leases[1], seed=seed + 100), workers[1])
            api.drain()
        lease = api.lease(workers[0])
        _exchange(api, lease, EVERY, workers[0], 999)  # after the last merge: only in the exchange log
        rt = api.runtime()
        assert rt.version == 6
        before = {n: t.clone() for n, t in rt.state.params.items()}
        momentum = {n: t.clone() for n, t in rt.state.momentum.items()}
        status = api.status()
        assert status["exchanges"] == 13
        monkeypatch.setattr(checkpoints, "write", lambda rt: None)  # the crash: no final checkpoint
    monkeypatch.undo()

    caplog.set_level(logging.INFO, logger="coordinator")
    with open_api(settings) as api:
        rt = api.runtime()
        assert rt.version == 6
        for n in before:
            assert torch.equal(rt.state.params[n], before[n]), n
            assert torch.equal(rt.state.momentum[n], momentum[n]), n
        # the checkpoint at version 6 already held its exchanges up to that merge; the one after is replayed
        assert "resumed at version 6 (0 deltas replayed, 1 exchanges)" in caplog.text
        assert api.status()["exchanges"] == 13


def test_replay_from_an_older_checkpoint_replays_exchanges_too(tmp_path, open_api, run_config, make_delta, caplog):
    settings = CoordinatorSettings(data_dir=tmp_path / "coord", checkpoint_every=1000)
    cfg = run_config(algorithm="sparta+diloco", shard_tokens=2048, inner={"steps": STEPS, "batch_size": 2},
                     sparta={"p": 0.2, "every": EVERY}, outer={"group": 2})
    with open_api(settings) as api:
        api.create_run(cfg)
        workers = [api.register() for _ in range(2)]
        leases = [api.lease(h) for h in workers]
        _exchange(api, leases[0], EVERY, workers[0], 1)
        api.accept(leases[0].lease_id, make_delta(leases[0], seed=1), workers[0])
        api.drain()
        _exchange(api, leases[1], EVERY, workers[1], 2)
        _exchange(api, leases[1], 2 * EVERY, workers[1], 3)
        api.accept(leases[1].lease_id, make_delta(leases[1], seed=2), workers[1])
        api.drain()
        rt = api.runtime()
        before = {n: t.clone() for n, t in rt.state.params.items()}
        storage, run_id = api.coordinator.storage, rt.run_id
    # shutdown wrote a checkpoint at version 2; remove it: only version 0's (from creation) is left
    storage.delete(storage.checkpoint(run_id, 2))
    caplog.set_level(logging.INFO, logger="coordinator")
    with open_api(settings) as api:
        rt = api.runtime()
        for n in before:
            assert torch.equal(rt.state.params[n], before[n]), n
        assert "resumed at version 2 (2 deltas replayed, 3 exchanges)" in caplog.text
