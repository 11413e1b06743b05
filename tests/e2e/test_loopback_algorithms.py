"""Each algorithm end to end over real sockets on 127.0.0.1: one `idletrain coordinator serve`
for the module, and per algorithm a run trained by two `idletrain worker run` processes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from idletrain.harness import free_port
from tests import procs

ROUNDS = 3  # per worker
WORKERS = 2
STEPS, BATCH, CONTEXT, EVERY = 10, 8, 32, 2


class Loopback(procs.Idletrain):
    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.url = f"http://127.0.0.1:{free_port()}"


@pytest.fixture(scope="module")
def loopback(tmp_path_factory, corpus_dir) -> Iterator[tuple[Loopback, httpx.Client]]:
    lb = Loopback(tmp_path_factory.mktemp("loopback-algorithms"))
    try:
        coord = lb.spawn("coordinator", "--log-level", "WARNING", "coordinator", "serve", "--host", "127.0.0.1",
                         "--port", lb.url.rsplit(":", 1)[1], "--data-dir", str(lb.root / "data"),
                         "--corpus-dir", str(corpus_dir))
        with httpx.Client(base_url=lb.url, timeout=120) as client:
            procs.wait_healthy(client, coord, lb.logs / "coordinator.log")
            client.headers.update(procs.admin_headers(lb.root / "data"))  # this client is the operator's only
            yield lb, client
    finally:
        lb.close()


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["diloco", "sparta", "sparta+diloco"])
def test_two_workers_train_each_algorithm_over_loopback(loopback, corpus_dir: Path, algorithm: str):
    lb, client = loopback
    run = algorithm.replace("+", "-")
    coord_log = lb.logs / "coordinator.log"
    created = client.post("/api/v1/runs", json={
        "name": run, "algorithm": algorithm, "corpus": str(corpus_dir), "shard_tokens": 4096, "eval_tokens": 4096,
        "eval_every": 2, "epochs": 0, "model": {"n_layer": 1, "d_model": 32, "n_head": 2, "context": CONTEXT},
        "inner": {"steps": STEPS, "batch_size": BATCH, "lr": 3e-3, "warmup_steps": 3},
        "compression": {"index": "topk", "fraction": 0.1, "values": "int8"}, "outer": {"group": WORKERS},
        "sparta": {"p": 0.2, "every": EVERY, "alpha": 0.5, "values": "fp16"}})
    assert created.status_code == 201, created.text
    first = client.get(f"/api/v1/runs/{run}/status").json()
    assert first["version"] == 0 and first["algorithm"] == algorithm and len(first["eval_history"]) == 1

    logs = lb.train(lb.url, run, workers=WORKERS, rounds=ROUNDS, prefix=f"{run}-")

    acknowledged = WORKERS * ROUNDS
    st = procs.wait_merged(client, run, acknowledged, log=coord_log)

    final = client.post(f"/api/v1/runs/{run}/evaluate")
    assert final.status_code == 200, final.text
    st = client.get(f"/api/v1/runs/{run}/status").json()
    assert st["merged_deltas"] == acknowledged and st["rejected_deltas"] == 0, st
    assert st["version"] == acknowledged and final.json()["version"] == acknowledged
    most = acknowledged * STEPS // EVERY
    if algorithm == "sparta":  # its empty deltas are evidence of nothing: a round counts the exchanges it made
        assert st["tokens_trained"] == acknowledged * STEPS * BATCH * CONTEXT * st["exchanges"] // most, st
    else:
        assert st["tokens_trained"] == acknowledged * STEPS * BATCH * CONTEXT
    if "sparta" in algorithm:
        # an exchange may be skipped (too many in flight) but none refused on a healthy loopback
        assert 0 < st["exchanges"] <= most, st
        assert all("exchanges (" in log for log in logs)
        assert not any("exchange after step" in log and "failed" in log for log in logs), logs
    else:
        assert st["exchanges"] == 0
    loss0 = st["eval_history"][0]["loss"]
    print(algorithm, "eval losses", [(e["version"], round(e["loss"], 3)) for e in st["eval_history"]],
          "final", round(final.json()["loss"], 3), "exchanges", st["exchanges"])
    assert final.json()["loss"] < loss0, (loss0, [e["loss"] for e in st["eval_history"]], final.json())
    assert lb.started[0].poll() is None, procs.tail(coord_log)
