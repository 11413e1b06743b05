"""Credit on later leases: a worker's upload commits to the state its round started from, a sampled
lease's acknowledgement asks for it, and the check replays the round from it. Honest later rounds
pass by the exact bounds; the issue's attack (a first lease's delta re-encoded for each later lease)
fails on every later lease, where before it passed 5 of 5; a state that never comes fails after the
wait; the start-state route refuses what was not committed. Real worker rounds (worker.loop.Worker)
reach the in-process coordinator through its HTTP interface."""

from __future__ import annotations

import dataclasses
import hashlib

import pytest
import torch

from coordinator.models import SpotCheck
from coordinator.services.spotchecks import state_name
from shared import codec, protocol
from shared.algorithms.compress import compress_with_feedback
from shared.model import build_model, param_schema
from tests.conftest import API
from tests.coordinator.test_spotcheck import run_worker
from worker.trainer import LocalTrainer

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def settings(settings):
    return settings.model_copy(update={"spot_check_rate": 1.0, "allowed_hosts": ["coordinator.test"]})


class ReplayingTrainer(LocalTrainer):
    """Trains every round (so its state and commitments are honest), but sends its first round's delta,
    re-encoded for each later lease and scaled by 1 + 1e-3 x round so that the bytes differ."""

    first: dict[str, torch.Tensor] | None = None

    def train_round(self, lease, base, tokens, **kw):
        result = super().train_round(lease, base, tokens, **kw)
        schema = param_schema(build_model(lease.model))
        if self.first is None:
            sent = codec.decode(result.body, schema=schema).to_dense(schema)
            self.first = {n: torch.from_numpy(v).reshape(schema[n]) for n, v in sent.items()}
            self.rounds = 0
            return result
        self.rounds += 1
        scaled = {n: t * (1 + 1e-3 * self.rounds) for n, t in self.first.items()}
        delta, _ = compress_with_feedback(scaled, None, lease.compression, base_version=lease.base_version,
                                          round_seed=lease.seed)
        return dataclasses.replace(result, body=codec.encode(delta))


def _checks(api) -> dict[int, SpotCheck]:
    with api.db() as s:
        return {c.lease_id: c for c in s.query(SpotCheck).order_by(SpotCheck.lease_id)}


def test_honest_later_rounds_pass_from_their_committed_state(api, run_config, tmp_path):
    api.create_run(run_config())
    run_worker(api, tmp_path, "honest", 3)
    checks = _checks(api)
    assert len(checks) == 3 and all(c.state_sha256 and c.state_received_at for c in checks.values())
    assert api.coordinator.spotchecks.run_pending() == 3
    for c in _checks(api).values():
        assert c.verdict == "passed" and c.cosine > 0.99, (c.lease_id, c.cosine, c.reason)
        assert not api.coordinator.storage.exists(state_name(api.coordinator.storage, c.run_id, c.lease_id))
    assert not list((tmp_path / "honest").rglob("*.wanted"))  # every wanted state went


def test_a_first_delta_replayed_on_later_leases_fails_every_later_check(api, run_config, tmp_path):
    api.create_run(run_config())
    run_worker(api, tmp_path, "replayer", 4, ReplayingTrainer(torch.device("cpu")))
    assert api.coordinator.spotchecks.run_pending() == 4
    checks = list(_checks(api).values())
    assert checks[0].verdict == "passed"  # its first round is its own
    assert [c.verdict for c in checks[1:]] == ["failed"] * 3, [(c.cosine, c.reason) for c in checks]
    workers = {w["name"]: w for w in api.operator("get", f"{API}/runs/t/workers").json()}
    assert workers["replayer"]["standing"] == "banned"


def test_a_state_never_sent_fails_the_check_after_the_wait(api, run_config, tmp_path, monkeypatch):
    api.create_run(run_config())
    monkeypatch.setattr("worker.start_states.StartStates.send_wanted", lambda self, client: 0)
    run_worker(api, tmp_path, "silent", 2)
    assert api.coordinator.spotchecks.run_pending() == 0  # waiting for the states
    monkeypatch.setattr(api.coordinator.spotchecks, "state_wait_s", 1e-6)
    assert api.coordinator.spotchecks.run_pending() == 2
    for c in _checks(api).values():
        assert c.verdict == "failed" and "was not sent within" in c.reason


def test_the_start_state_route_takes_only_the_committed_bytes(api, run_config):
    api.create_run(run_config())
    headers = api.register(name="w")
    lease = api.lease(headers)
    schema = param_schema(build_model(lease.model))
    pg = {n: torch.randn(s) * 1e-3 for n, s in schema.items()}
    delta, _ = compress_with_feedback(pg, None, lease.compression, base_version=lease.base_version,
                                      round_seed=lease.seed)
    body = codec.encode(delta)
    state = b"not a state, but committed"
    sha = hashlib.sha256(state).hexdigest()
    bad = api.client.post(f"{API}/leases/{lease.lease_id}/delta", content=body, headers={
        **headers, "Content-Type": "application/octet-stream", protocol.H_START_STATE: "XYZ",
        protocol.H_START_STATE_BYTES: "12"})
    assert bad.status_code == 400 and protocol.H_START_STATE in bad.json()["detail"]
    resp = api.client.post(f"{API}/leases/{lease.lease_id}/delta", content=body, headers={
        **headers, "Content-Type": "application/octet-stream", protocol.H_START_STATE: sha,
        protocol.H_START_STATE_BYTES: str(len(state))})
    assert resp.status_code == 202 and resp.json()["start_state_wanted"] is True

    def put(blob: bytes, who: dict = headers, lease_id: int = lease.lease_id):
        return api.client.put(f"{API}/leases/{lease_id}/start-state", content=blob,
                              headers={**who, "Content-Type": "application/octet-stream"})

    malformed = api.client.put(f"{API}/leases/{lease.lease_id}/start-state", content=state, headers={
        **headers, "Content-Type": "application/octet-stream", protocol.H_EXCHANGES_APPLIED: "0;3:2"})
    assert malformed.status_code == 400 and protocol.H_EXCHANGES_APPLIED in malformed.json()["detail"]
    assert put(b"x" * (len(state) + 1)).status_code == 413
    assert put(b"y" * len(state)).status_code == 409
    assert put(state, api.register(name="other")).status_code == 403
    assert put(state, lease_id=lease.lease_id + 99).status_code == 404
    assert put(state).status_code == 204 and put(state).status_code == 204  # a retry answers alike
    again = api.upload(lease.lease_id, body, {**headers, protocol.H_START_STATE: sha,
                                              protocol.H_START_STATE_BYTES: str(len(state))})
    assert again.status_code == 202 and "start_state_wanted" not in again.json()  # came already
    assert api.drain() == 1 and api.coordinator.spotchecks.run_pending() == 1
    (check,) = _checks(api).values()
    assert check.verdict == "failed" and "start state is not one" in check.reason
    assert put(state).status_code == 404  # judged: no longer wanted
    # an upload that commits to nothing (an older worker) is never asked
    old = api.register(name="old")
    lease2 = api.lease(old)
    delta2, _ = compress_with_feedback(pg, None, lease2.compression, base_version=lease2.base_version,
                                       round_seed=lease2.seed)
    ack = api.accept(lease2.lease_id, codec.encode(delta2), old)
    assert not ack.start_state_wanted
    assert put(state, old, lease_id=lease2.lease_id).status_code == 404
