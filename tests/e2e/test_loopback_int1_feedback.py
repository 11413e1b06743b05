"""int1 both ways end to end over real sockets on 127.0.0.1: one `idletrain coordinator serve` and two
`idletrain worker run` processes train a run whose deltas are dense int1 (a sign a value, one magnitude
per 256) with error feedback, and whose model updates are int1 too, each taken from the worker's own
copy (update_feedback): every delta merges, the loss falls, and each time a worker's base moves it
downloads an int1 update, never a snapshot, and the coordinator keeps the copy it made."""

from __future__ import annotations

import math
import re
from pathlib import Path

import httpx
import pytest

from shared.algorithms.compress import round_bound
from shared.config import CompressionConfig
from shared.model import ModelConfig, meta_schema
from tests import procs

ROUNDS = 4  # per worker: the later ones start from versions merged meanwhile
WORKERS = 2
MODEL = {"n_layer": 1, "d_model": 32, "n_head": 2, "context": 32}
COMPRESSION = {"index": "dense", "values": "int1", "error_feedback": True}


@pytest.mark.slow
def test_two_workers_train_with_int1_both_ways_over_loopback(tmp_path: Path, corpus_dir: Path):
    lb = procs.Idletrain(tmp_path)
    data = tmp_path / "data"
    try:
        url = lb.serve(data, corpus_dir)
        with httpx.Client(base_url=url, timeout=120, headers=procs.admin_headers(data)) as client:
            created = client.post("/api/v1/runs", json={
                "name": "int1", "corpus": str(corpus_dir), "shard_tokens": 4096, "eval_tokens": 4096,
                "eval_every": 2, "epochs": 0, "model": MODEL,
                "inner": {"steps": 10, "batch_size": 4, "lr": 3e-3, "warmup_steps": 3},
                "compression": COMPRESSION, "update_values": "int1", "update_feedback": True,
                "outer": {"group": WORKERS}})
            assert created.status_code == 201, created.text
            logs = lb.train(url, "int1", workers=WORKERS, rounds=ROUNDS)
            acknowledged = WORKERS * ROUNDS
            final, st = lb.settle(client, "int1", acknowledged)
    finally:
        lb.close()

    procs.assert_trained(st, final, acknowledged)
    # a delta: at most one bit a value and a magnitude per 256 (zstd shrinks a tensor whose change has one sign)
    schema = meta_schema(ModelConfig.from_dict(MODEL))
    n_params = sum(math.prod(s) for s in schema.values())
    int1_bound = round_bound(schema, CompressionConfig(**COMPRESSION))
    per_delta = st["bytes_up"] / acknowledged
    assert n_params / 16 < per_delta <= int1_bound and per_delta < round_bound(schema, CompressionConfig()) / 3
    # each worker's bases: version 0 built from the run's seed (nothing downloaded), then each move an update
    bases = [[int(v) for v in re.findall(r": shard \d+ from v(\d+),", log)] for log in logs]
    assert all(len(b) == ROUNDS and b[0] == 0 for b in bases), bases
    moves = sum(a != b for b_ in bases for a, b in zip(b_, b_[1:]))
    assert moves >= 1, bases  # rounds start from versions merged meanwhile
    # every byte of model sent down was an int1 update (one is the size of a delta; a snapshot is 4 bytes
    # a value), and each made a copy the coordinator keeps, taken from by the worker's next update
    assert 0 < st["bytes_down_model"] <= moves * int1_bound, (st["bytes_down_model"], moves, int1_bound)
    # only the moves from version 0 as built (before the worker learns that the run's updates come from its
    # copy) were asked from a version: kept like plain updates. A copy is named by its bytes, and those
    # follow from the versions the worker's base went through: workers whose bases went the same way hold
    # the same copy, so the coordinator keeps one copy for each distinct way
    from_zero = {(a, b) for b_ in bases for a, b in zip(b_, b_[1:]) if a == 0 and b != 0}
    assert len(list((data / "runs").glob("*/updates/*.delta"))) == len(from_zero), bases
    ways = {tuple(sorted(set(b_[:i + 1]))) for b_ in bases for i in range(1, len(b_)) if b_[i] != b_[i - 1]}
    copies = list((data / "runs").glob("*/copies/*.f32"))
    assert len(copies) == len(ways), (copies, bases)
    assert all(f.stat().st_size == 4 * n_params for f in copies)
