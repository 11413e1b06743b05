"""The long-run configuration end to end over real sockets on 127.0.0.1 (AdamW normalised for 8 workers'
combined batch, int1 both ways with updates from the worker's copy, rounds of 19, outer lr 1.2 without
momentum): a run that gives only its sizes (model, corpus, shards) and a length of 600 local steps a
worker gets it from the coordinator's defaults (RunConfig's regime), as deploy/run.long.toml spells it
out, and is trained by one `idletrain coordinator serve` (re-training every delivered lease's round,
spot-check rate 1) and four `idletrain worker run` processes. The benchmark that chose it (bench/sim.py)
does not run the coordinator's screen: here every honest delta of it passes the screen and the spot
checks, and the loss falls."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from idletrain.cli.operator import build_run_config
from shared.config import LONG_RUN_STEPS, RunConfig
from tests import procs

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
ROUNDS = 4  # per worker: 16 deltas, two outer groups of 8
WORKERS = 4  # robust.min_workers: the screens that judge a delta against the median norm are on


def knobs(cfg: RunConfig) -> tuple:
    return (cfg.inner.lr, cfg.inner.steps, cfg.inner.second_moment_workers, cfg.compression.values, cfg.update_values,
            cfg.update_feedback, cfg.outer.lr, cfg.outer.momentum)


SMALL = {"corpus_max_bytes": 1 << 20, "shard_tokens": 4096, "eval_tokens": 4096, "eval_every": 4, "epochs": 0,
         "model": {"n_layer": 1, "d_model": 32, "n_head": 2, "context": 32}}


def from_the_regime(corpus_dir: Path) -> dict:
    """Only the sizes and the run's length: the coordinator gives a run of 600 local steps a worker (8 x 4 x 32
    tokens each) the long-run defaults itself."""
    return {"name": "long", **SMALL, "corpus": str(corpus_dir), "inner": {"batch_size": 4}, "outer": {"group": 8},
            "schedule_tokens": LONG_RUN_STEPS * 8 * 4 * 32}


@pytest.mark.slow
def test_the_long_run_configuration_trains_over_loopback(tmp_path: Path, corpus_dir: Path):
    # the file spells out what the regime gives (at the lr its model takes): one run trains both
    spelled = build_run_config("long", str(DEPLOY / "run.long.toml"), {**SMALL, "corpus": str(corpus_dir),
                                                                      "inner.batch_size": 4})
    assert knobs(spelled)[1:] == knobs(RunConfig.model_validate(from_the_regime(corpus_dir)))[1:]
    lb = procs.Idletrain(tmp_path)
    data = tmp_path / "data"
    try:
        url = lb.serve(data, corpus_dir, IDLETRAIN_SPOT_CHECK_RATE="1")
        with httpx.Client(base_url=url, timeout=120, headers=procs.admin_headers(data)) as client:
            created = client.post("/api/v1/runs", json=from_the_regime(corpus_dir))
            assert created.status_code == 201, created.text
            served = RunConfig.model_validate(client.get("/api/v1/runs/long/config").json())
            assert knobs(served) == (pytest.approx(1.4e-3), 19, 8, "int1", "int1", True, 1.2, 0.0)
            lb.train(url, "long", workers=WORKERS, rounds=ROUNDS, timeout_s=300)
            acknowledged = WORKERS * ROUNDS
            final, st = lb.settle(client, "long", acknowledged)
            checks = lb.spot_checks(client, "long", acknowledged)
    finally:
        lb.close()

    procs.assert_trained(st, final, acknowledged)  # every delta merged, none rejected, the loss fell
    assert checks == [{"passed": ROUNDS}] * WORKERS, checks  # each round replayed by the coordinator, as sent
