"""End to end over real sockets on 127.0.0.1: `idletrain coordinator serve` and two
`idletrain worker run` processes train a tiny model; the held-out loss must fall."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from idletrain.harness import free_port
from tests import procs

ROUNDS = 4  # per worker
WORKERS = 2
STEPS, BATCH, CONTEXT = 20, 8, 32


@pytest.mark.slow
def test_two_workers_train_a_model_over_loopback(tmp_path: Path, corpus_dir: Path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    running = procs.Idletrain(tmp_path)
    logs, spawn = running.logs, running.spawn

    try:
        coord = spawn("coordinator", "--log-level", "WARNING", "coordinator", "serve", "--host", "127.0.0.1",
                      "--port", str(port), "--data-dir", str(tmp_path / "data"), "--corpus-dir", str(corpus_dir))
        with httpx.Client(base_url=url, timeout=120) as client:
            procs.wait_healthy(client, coord, logs / "coordinator.log")
            client.headers.update(procs.admin_headers(tmp_path / "data"))  # this client is the operator's only
            created = client.post("/api/v1/runs", json={
                "name": "loop", "corpus": str(corpus_dir), "shard_tokens": 4096, "eval_tokens": 4096,
                "eval_every": 2, "epochs": 0, "model": {"n_layer": 1, "d_model": 32, "n_head": 2, "context": CONTEXT},
                "inner": {"steps": STEPS, "batch_size": BATCH, "lr": 3e-3, "warmup_steps": 5},
                "compression": {"index": "topk", "fraction": 0.1, "values": "int8"},
                "outer": {"group": WORKERS}})
            assert created.status_code == 201, created.text
            first = client.get("/api/v1/runs/loop/status").json()
            assert first["version"] == 0 and len(first["eval_history"]) == 1

            running.train(url, "loop", workers=WORKERS, rounds=ROUNDS)
            for i in range(WORKERS):
                assert (tmp_path / f"worker{i}" / "tokens.json").exists()

            acknowledged = WORKERS * ROUNDS
            st = procs.wait_merged(client, "loop", acknowledged, log=logs / "coordinator.log")

            final = client.post("/api/v1/runs/loop/evaluate")
            assert final.status_code == 200, final.text
            st = client.get("/api/v1/runs/loop/status").json()
            assert st["merged_deltas"] == acknowledged, st
            assert st["rejected_deltas"] == 0 and st["version"] == acknowledged
            assert st["workers_total"] == WORKERS
            assert st["tokens_trained"] == acknowledged * STEPS * BATCH * CONTEXT
            assert st["bytes_up"] > 0 and st["bytes_down_model"] > 0 and st["bytes_down_data"] > 0
            assert st["traffic_ratio_vs_dense"] > 1  # compressed rounds move less than dense gradients would
            loss0 = st["eval_history"][0]["loss"]
            print("eval losses", [(e["version"], round(e["loss"], 3)) for e in st["eval_history"]])
            loss_end = final.json()["loss"]
            assert final.json()["version"] == acknowledged
            assert loss_end < loss0 - 1.0, (loss0, [e["loss"] for e in st["eval_history"]], loss_end)
            assert coord.poll() is None, procs.tail(logs / "coordinator.log")
    finally:
        running.close()
