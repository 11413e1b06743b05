"""The group-normalised AdamW end to end over real sockets on 127.0.0.1: one `idletrain coordinator
serve` (re-training every delivered lease's round, spot-check rate 1) and two `idletrain worker run`
processes train a run with inner.second_moment_workers = 2. The lease carries the setting, each
worker's optimiser keeps the group's estimates (its saved state holds them), every delta merges, and
the coordinator's replays, made with the run's optimiser, pass every round."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests import procs
from worker.state import decode_state

ROUNDS = 3  # per worker
WORKERS = 2


@pytest.mark.slow
def test_two_workers_train_with_the_groups_second_moment_over_loopback(tmp_path: Path, corpus_dir: Path):
    lb = procs.Idletrain(tmp_path)
    data = tmp_path / "data"
    try:
        url = lb.serve(data, corpus_dir, IDLETRAIN_SPOT_CHECK_RATE="1")
        with httpx.Client(base_url=url, timeout=120, headers=procs.admin_headers(data)) as client:
            created = client.post("/api/v1/runs", json={
                "name": "group", "corpus": str(corpus_dir), "shard_tokens": 4096, "eval_tokens": 4096,
                "eval_every": 2, "epochs": 0, "model": {"n_layer": 1, "d_model": 32, "n_head": 2, "context": 32},
                "inner": {"steps": 10, "batch_size": 4, "lr": 3e-3, "warmup_steps": 3,
                          "second_moment_workers": WORKERS},
                "outer": {"group": WORKERS}})
            assert created.status_code == 201, created.text

            lb.train(url, "group", workers=WORKERS, rounds=ROUNDS)
            acknowledged = WORKERS * ROUNDS
            final, st = lb.settle(client, "group", acknowledged)
            checks = lb.spot_checks(client, "group", acknowledged)
    finally:
        lb.close()

    procs.assert_trained(st, final, acknowledged)
    assert checks == [{"passed": ROUNDS}] * WORKERS, checks

    for i in range(WORKERS):  # each worker's optimiser is the group's: its saved state holds the estimates
        (state_file,) = (tmp_path / f"worker{i}").glob("runs/*/state.st")
        state = decode_state(state_file.read_bytes())
        assert state.inner["second_moment_workers"] == WORKERS
        per_param = next(iter(state.optimizer.tensors.values()))
        assert {"exp_avg", "signal", "noise", "prev_grad"} <= set(per_param), set(per_param)
        assert "exp_avg_sq" not in per_param
        assert state.optimizer.groups[0]["workers"] == WORKERS
