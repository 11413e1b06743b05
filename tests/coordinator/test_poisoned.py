"""Poisoned updates: 1 of 8 workers sends sign-flipped or 100x-scaled deltas. Robust merging
keeps the model within 2% of the clean run's eval loss, and the operator sees the worker flagged."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from coordinator.settings import CoordinatorSettings
from shared import codec, protocol
from tests.conftest import API, schema_of
from worker.trainer import LocalTrainer

WORKERS, ROUNDS = 8, 6
# The merge rule is what is tested here, not the database: SQLite only (the PostgreSQL backend is
# covered by every other API test), and the clean run is trained once for both attacks.
OWN_DB_BACKENDS = True
_CLEAN: dict[str, tuple] = {}


@pytest.fixture
def db_backend() -> str:
    return "sqlite"
ADMIN = "a-very-secret-admin-token"


def poison(body: bytes, attack: str, schema) -> bytes:
    delta = codec.decode(body, schema=schema)
    factor = -1.0 if attack == "flip" else 100.0
    entries = tuple(codec.Entry(e.name, e.numel, e.index_kind, codec.ValueKind.FP32,
                                np.asarray(e.values, dtype=np.float32) * factor, e.indices, e.seed)
                    for e in delta.entries)
    return codec.encode(codec.Delta(delta.base_version, entries))


def train_run(open_api, tmp_path, run_config, train_delta, attack: str | None) -> tuple[float, dict, list, list]:
    torch.manual_seed(0)
    settings = CoordinatorSettings(data_dir=tmp_path / f"coord-{attack}", admin_token=ADMIN)
    admin = {"Authorization": f"Bearer {ADMIN}"}
    name = attack or "clean"  # both runs may share one database (the PostgreSQL variant): distinct names
    cfg = run_config(name, shard_tokens=2048, inner={"steps": 6, "batch_size": 8, "lr": 3e-3, "warmup_steps": 2},
                     outer={"group": WORKERS}, eval_every=1000)
    with open_api(settings) as api:
        api.create_run(cfg, headers=admin)
        workers = [api.register(name, name=f"w{i}") for i in range(WORKERS)]
        trainers = [LocalTrainer(torch.device("cpu")) for _ in range(WORKERS)]
        refused = []
        for _ in range(ROUNDS):
            for i, headers in enumerate(workers):
                resp = api.client.post(f"{API}/runs/{name}/leases", headers=headers)
                if resp.status_code != 200:  # the attacker, throttled (429) or banned (403)
                    assert i == 0 and attack is not None, resp.text
                    refused.append(resp.status_code)
                    continue
                lease = protocol.Lease.model_validate(resp.json())
                body = train_delta(api, lease, headers, trainers[i])
                if i == 0 and attack:
                    body = poison(body, attack, schema_of(lease))
                resp = api.upload(lease.lease_id, body, headers)
                if resp.status_code != 202:
                    assert i == 0 and attack is not None, resp.text
                    refused.append(resp.status_code)
            api.drain()
        loss = api.client.post(f"{API}/runs/{name}/evaluate", headers=admin).json()["loss"]
        status = api.status(name)
        listed = api.client.get(f"{API}/runs/{name}/workers", headers=admin).json()
        for t in trainers:
            t.close()
    return loss, status, listed, refused


@pytest.mark.parametrize("attack", ["flip", "scale100"])
def test_one_poisoned_worker_of_eight(open_api, tmp_path, run_config, train_delta, attack):
    if "clean" not in _CLEAN:
        _CLEAN["clean"] = train_run(open_api, tmp_path, run_config, train_delta, None)
    clean, clean_status, _, _ = _CLEAN["clean"]
    poisoned, status, listed, refused = train_run(open_api, tmp_path, run_config, train_delta, attack)
    start = status["eval_history"][0]["loss"]
    assert clean < start - 0.3, (start, clean)  # the run really trains
    assert clean_status["rejected_deltas"] == 0 and clean_status["workers_flagged"] == []
    assert poisoned <= clean * 1.02, (attack, clean, poisoned)
    # the attacker is flagged, with the reason, in status and in the operator's worker list
    (flagged,) = status["workers_flagged"]
    assert flagged["name"] == "w0" and flagged["standing"] in ("throttled", "banned")
    reason = "consensus" if attack == "flip" else ("median" if "median" in flagged["standing_reason"] else "AdamW")
    assert reason in flagged["standing_reason"]
    by_name = {w["name"]: w for w in listed}
    assert by_name["w0"]["deltas_rejected"] >= 2
    assert all(by_name[f"w{i}"]["standing"] == "ok" and by_name[f"w{i}"]["deltas_rejected"] == 0
               for i in range(1, WORKERS))
    assert refused and set(refused) <= {403, 429}  # throttled, then banned: it stops getting work


def test_a_merger_falling_behind_bans_nobody(api, run_config, make_delta):
    """Deltas refused at merge because the queue made them too stale are the coordinator's lateness:
    the worker stays in good standing and keeps getting leases."""
    api.create_run(run_config(outer={"group": 1, "max_staleness": 0}, shard_tokens=2048))
    first, late = api.register(), api.register()
    lease = api.lease(first)
    api.accept(lease.lease_id, make_delta(lease), first)
    for i in range(5):  # all acknowledged against version 0, behind `first`'s delta in the queue
        lease = api.lease(late)
        api.accept(lease.lease_id, make_delta(lease, seed=i + 1), late)
    assert api.drain() == 6
    status = api.status()
    assert status["rejected_deltas"] == 5, status
    (info,) = [w for w in api.client.get("/api/v1/runs/t/workers").json() if w["deltas_rejected"] == 5]
    assert info["standing"] == "ok", info
    assert api.lease(late).base_version == 6  # not throttled (429) nor banned (403)
