"""Sparta rounds are spot-checked too: the worker commits to its round's start state, its replica's
weights included (sparta's rounds start from the worker's own replica), and a sampled lease's check
replays the round from it and compares what its exchanges carried (shared/algorithms/spotcheck.py
replay_exchanges, compare_committed). Real worker rounds, with their exchanges, reach the in-process
coordinator over its HTTP interface."""

from __future__ import annotations

import pytest
import torch

from coordinator.models import Exchange, SpotCheck, Worker as WorkerRow
from shared.algorithms import start_state
from shared.algorithms.spotcheck import parse_applied
from tests.coordinator.test_spotcheck import run_worker
from worker.trainer import LocalTrainer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SPARTA = {"p": 0.05, "every": 2, "alpha": 0.5, "values": "fp16"}


@pytest.fixture
def settings(settings):
    return settings.model_copy(update={"spot_check_rate": 1.0, "allowed_hosts": ["coordinator.test"]})


class OtherShardTrainer(LocalTrainer):
    """Trains its rounds, and exchanges, honestly, but on other tokens than its lease's shard (one
    training passed off for another lease's)."""

    def train_round(self, lease, base, tokens, **kw):
        return super().train_round(lease, base, tokens.roll(997), **kw)


class IdleTrainer(LocalTrainer):
    """Trains nothing: its steps only tick (exchanges go out with its weights as they stand)."""

    def run_local_steps(self, lease, tokens, *, steps, generator, step_offset, on_step):
        for i in range(steps):
            on_step(i + 1, 3.0)
        return [3.0] * steps


def run(api, run_config, tmp_path, algorithm: str) -> dict[str, dict]:
    api.create_run(run_config(algorithm=algorithm, sparta=SPARTA, inner={"steps": 6, "batch_size": 4}))
    run_worker(api, tmp_path, "honest", 3)
    run_worker(api, tmp_path, "shifted", 2, OtherShardTrainer(torch.device("cpu")))
    run_worker(api, tmp_path, "idle", 1, IdleTrainer(torch.device("cpu")))
    with api.db() as s:
        assert s.query(SpotCheck).filter_by(verdict="pending").count() == 6  # committed, sampled, waiting
        assert all(c.state_sha256 and c.state_received_at for c in s.query(SpotCheck))
        # each says where its corrections went, and the coordinator kept the answers it replays
        applied = [parse_applied(c.exchanges_applied, steps=6) for c in s.query(SpotCheck)]
        assert sum(len(a) for _, a in applied) >= 6 and all(r == 0 for r, _ in applied)
        assert s.query(Exchange).filter(Exchange.answer.is_not(None)).count() == s.query(Exchange).count()
        assert s.query(Exchange).count() >= 6 * 3 - 2
    assert api.coordinator.spotchecks.run_pending() == 6
    with api.db() as s:
        names = {w.id: w.name for w in s.query(WorkerRow)}
        checks: dict[str, list] = {}
        for c in s.query(SpotCheck).order_by(SpotCheck.lease_id):
            checks.setdefault(names[c.worker_id], []).append((c.verdict, c.cosine, c.reason))
        assert s.query(Exchange).filter(Exchange.body == b"").count() == 0  # nothing pruned yet
        assert s.query(Exchange).filter(Exchange.answer.is_not(None)).count() == 0  # judged: the answers go
    return checks


@pytest.mark.parametrize("algorithm", ["sparta", "sparta+diloco"])
def test_sparta_rounds_are_checked_by_their_exchanges(api, run_config, tmp_path, algorithm):
    checks = run(api, run_config, tmp_path, algorithm)
    assert [v for v, _, _ in checks["honest"]] == ["passed"] * 3, checks["honest"]
    assert all(cos > 0.99 for _, cos, _ in checks["honest"]), checks["honest"]
    assert [v for v, _, _ in checks["shifted"]] == ["failed"] * 2, checks["shifted"]
    assert [v for v, _, _ in checks["idle"]] == ["failed"], checks["idle"]
    workers = {w["name"]: w for w in api.operator("get", "/api/v1/runs/t/workers").json()}
    assert workers["honest"]["standing"] == "ok"
    assert workers["shifted"]["standing"] == "banned" and workers["idle"]["standing"] != "ok"


def test_a_sparta_start_state_carries_the_replica_and_is_held_to_it():
    schema = {"w": (3, 2), "b": (2,)}
    params = {"w": torch.randn(3, 2), "b": torch.randn(2)}
    blob = start_state.encode(None, {}, steps_done=0, params=params)
    limit = start_state.max_bytes(schema, replica=True)
    state = start_state.decode(blob, schema=schema, limit=limit)
    assert all(torch.equal(state.params[n], params[n]) for n in schema)
    assert start_state.incomplete(state, schema=schema, group=False, replica=True) is None
    assert "carries weights" in start_state.incomplete(state, schema=schema, group=False)
    partial = start_state.decode(start_state.encode(None, {}, steps_done=0, params={"w": params["w"]}),
                                 schema=schema, limit=limit)
    assert "['b']" in start_state.incomplete(partial, schema=schema, group=False, replica=True)
    bare = start_state.decode(start_state.encode(None, {}, steps_done=0), schema=schema, limit=limit)
    assert "replica" in start_state.incomplete(bare, schema=schema, group=False, replica=True)
    with pytest.raises(ValueError, match="shape"):
        start_state.decode(start_state.encode(None, {}, steps_done=0, params={"w": torch.zeros(2, 3)}),
                           schema=schema, limit=limit)


def test_a_pending_checks_exchanges_outlive_pruning_until_judged(api, run_config, tmp_path, monkeypatch):
    from coordinator import checkpoints

    api.create_run(run_config(algorithm="sparta", sparta=SPARTA, inner={"steps": 6, "batch_size": 4}))
    run_worker(api, tmp_path, "honest", 2)
    coord, rt = api.coordinator, api.runtime()
    monkeypatch.setattr(checkpoints, "KEPT", 1)
    with rt.lock:
        checkpoints.write(rt)
    coord.recovery.prune_history(rt)
    assert coord.storage.pruned_through(rt.run_id) == rt.version > 0
    with api.db() as s:
        assert s.query(Exchange).filter(Exchange.body == b"").count() == 0  # every lease is checked: kept
    assert coord.spotchecks.run_pending() == 2
    with api.db() as s:
        assert {c.verdict for c in s.query(SpotCheck)} == {"passed"}
        assert s.query(Exchange).filter(Exchange.body != b"").count() == 0  # judged: pruned as the rest
