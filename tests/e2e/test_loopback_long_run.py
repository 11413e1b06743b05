"""deploy/run.long.toml end to end over real sockets on 127.0.0.1: its long-run configuration (AdamW
normalised for 8 workers' combined batch, int1 both ways with updates from the worker's copy, rounds of
19, outer lr 1.2 without momentum), with only the sizes made small (model, corpus, shards), trained by
one `idletrain coordinator serve` (re-training every delivered lease's round, spot-check rate 1) and four
`idletrain worker run` processes. The benchmark that chose it (bench/sim.py) does not run the
coordinator's screen: here every honest delta of it passes the screen and the spot checks, and the loss
falls."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from idletrain.cli.operator import build_run_config
from tests import procs

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
ROUNDS = 4  # per worker: 16 deltas, two outer groups of 8
WORKERS = 4  # robust.min_workers: the screens that judge a delta against the median norm are on


@pytest.mark.slow
def test_the_long_run_configuration_trains_over_loopback(tmp_path: Path, corpus_dir: Path):
    cfg = build_run_config("long", str(DEPLOY / "run.long.toml"), {
        "corpus": str(corpus_dir), "corpus_max_bytes": 1 << 20, "shard_tokens": 4096, "eval_tokens": 4096,
        "eval_every": 4, "epochs": 0, "inner.batch_size": 4,
        "model": {"n_layer": 1, "d_model": 32, "n_head": 2, "context": 32}})
    assert (cfg.inner.second_moment_workers, cfg.outer.group, cfg.update_values) == (8, 8, "int1")
    lb = procs.Idletrain(tmp_path)
    data = tmp_path / "data"
    try:
        url = lb.serve(data, corpus_dir, IDLETRAIN_SPOT_CHECK_RATE="1")
        with httpx.Client(base_url=url, timeout=120, headers=procs.admin_headers(data)) as client:
            created = client.post("/api/v1/runs", content=cfg.model_dump_json(),
                                  headers={"Content-Type": "application/json"})
            assert created.status_code == 201, created.text
            lb.train(url, "long", workers=WORKERS, rounds=ROUNDS, timeout_s=300)
            acknowledged = WORKERS * ROUNDS
            final, st = lb.settle(client, "long", acknowledged)
            checks = lb.spot_checks(client, "long", acknowledged)
    finally:
        lb.close()

    procs.assert_trained(st, final, acknowledged)  # every delta merged, none rejected, the loss fell
    assert checks == [{"passed": ROUNDS}] * WORKERS, checks  # each round replayed by the coordinator, as sent
