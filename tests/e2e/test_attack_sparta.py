"""Poisoned sparta exchanges over real HTTP: one `idletrain coordinator serve`, three honest `idletrain
worker run` processes per run, and an attacker of its own making beside them (too few workers for any
median to speak, as in the attack that took a real run's eval loss from 3.07 to 58.0):

  beyond   its exchanges at 2.5x the old run-wide per-element allowance (2 x the run's steps x lr, refused
           past 3x), and a fresh token for each of a stream of exchanges at one offset of 2.5x it (the
           issue's 60 one-value exchanges at an offset of 13 were that, later in a longer run)
  edge     its exchanges at 0.95x what a new token's lease can move (random signs): within the limits,
           so folded, clipped by nothing, and bounded by them and the descent guard

The attacker gives its leases back instead of delivering them, so versions count the honest rounds
only: each attacked run is compared at equal versions with the clean run of the same honest workers.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from shared import codec, protocol
from shared.algorithms.sparta import exchange_seed
from shared.algorithms.sparta import select as sparta_select
from shared.model import build_model, param_schema
from shared.snapshot import decode_snapshot
from tests import procs

HONEST, ROUNDS = 3, 4
STEPS, EVERY, LR = 10, 2, 3e-3
SPARTA = {"p": 0.1, "every": EVERY, "alpha": 0.5, "values": "fp16"}
MODEL = {"n_layer": 1, "d_model": 32, "n_head": 2, "context": 32}


@pytest.fixture(scope="module")
def coordinator(tmp_path_factory, corpus_dir) -> Iterator[tuple[procs.Idletrain, str, httpx.Client]]:
    with procs.Idletrain.serving(tmp_path_factory.mktemp("attack-sparta"), corpus_dir) as served:
        yield served


class Attacker(threading.Thread):
    """Leases, exchanges poisoned values at every exchange step, gives the lease back; again, until stopped."""

    def __init__(self, url: str, run: str, attack: str) -> None:
        super().__init__(daemon=True)
        self.url, self.run_name, self.attack = url, run, attack
        self.stop = threading.Event()
        self.codes: dict[str, list[int]] = {"exchange": [], "fresh": [], "lease": [], "register": []}
        self.error: BaseException | None = None
        self.rng = np.random.default_rng(0)

    def run(self) -> None:
        try:
            with httpx.Client(base_url=self.url, timeout=60) as client:
                headers = None
                while headers is None and not self.stop.wait(0.5):
                    headers = self._register(client, "mallory")
                while not self.stop.is_set():
                    self._round(client, headers)
                    if self.attack == "beyond":
                        self._fresh(client)
                    self.stop.wait(0.2)
        except BaseException as exc:  # the test says what stopped it
            self.error = exc

    def _register(self, client: httpx.Client, name: str | None) -> dict | None:
        resp = client.post(f"/api/v1/runs/{self.run_name}/workers", json={"name": name} if name else {})
        self.codes["register"].append(resp.status_code)
        if resp.status_code != 201:
            return None
        return {"Authorization": f"Bearer {resp.json()['token']}"}

    def _lease(self, client: httpx.Client, headers: dict) -> protocol.Lease | None:
        resp = client.post(f"/api/v1/runs/{self.run_name}/leases", headers=headers)
        self.codes["lease"].append(resp.status_code)
        return protocol.Lease.model_validate(resp.json()) if resp.status_code == 200 else None

    def _values(self, client: httpx.Client, lease: protocol.Lease, step: int, headers: dict) -> codec.Delta:
        """This step's exchange of the lease's base as it was downloaded (no training at all)."""
        blob = client.get(f"/api/v1/runs/{self.run_name}/snapshots/{lease.base_version}", headers=headers).content
        base, _ = decode_snapshot(blob, schema=param_schema(build_model(lease.model)))
        return sparta_select(base, p=SPARTA["p"], seed=exchange_seed(lease.seed, step), values=SPARTA["values"],
                             base_version=lease.base_version)

    def _post(self, client: httpx.Client, lease: protocol.Lease, step: int, sent: codec.Delta, shift, headers: dict,
              kind: str) -> None:
        body = codec.encode(codec.Delta(sent.base_version, tuple(
            codec.Entry(e.name, e.numel, e.index_kind, e.value_kind, shift(np.asarray(e.values, np.float64)).astype(
                np.float32), e.indices, e.seed) for e in sent.entries)))
        resp = client.post(f"/api/v1/leases/{lease.lease_id}/exchange", params={"step": step}, content=body,
                           headers={**headers, "Content-Type": "application/octet-stream"})
        self.codes[kind].append(resp.status_code)

    def _round(self, client: httpx.Client, headers: dict) -> None:
        lease = self._lease(client, headers)
        if lease is None:
            return
        for step in range(EVERY, STEPS + 1, EVERY):
            allowed = self._allowed(client)  # it grew with the run; the attack sat at 2.5x it
            sent = self._values(client, lease, step, headers)
            if self.attack == "beyond":
                def shift(v):
                    return v + 2.5 * allowed * self.rng.choice([-1.0, 1.0], size=v.size)
            else:  # a new token's reach: 3 x lr x its lease steps, at 0.95x
                def shift(v, step=step):
                    return v + 0.95 * 3 * LR * step * self.rng.choice([-1.0, 1.0], size=v.size)
            self._post(client, lease, step, sent, shift, headers, "exchange")
        client.delete(f"/api/v1/leases/{lease.lease_id}", headers=headers)

    def _fresh(self, client: httpx.Client) -> None:
        """A new token's one exchange, every value offset by 2.5x the old allowance, and its lease given back."""
        headers = self._register(client, None)
        if headers is None:  # the address's registrations are rate-limited
            return
        lease = self._lease(client, headers)
        if lease is None:
            return
        offset = 2.5 * self._allowed(client)
        self._post(client, lease, EVERY, self._values(client, lease, EVERY, headers), lambda v: v + offset, headers,
                   "fresh")
        client.delete(f"/api/v1/leases/{lease.lease_id}", headers=headers)

    def _allowed(self, client: httpx.Client) -> float:
        """The old run-wide allowance: 2 x (the run's steps so far + those of the live leases) x lr, refused
        only past 3x it."""
        status = client.get(f"/api/v1/runs/{self.run_name}/status").json()
        return 2 * (status["worker_steps"] + STEPS * max(1, status["workers_active"])) * LR


def train(lb: procs.Idletrain, url: str, admin: httpx.Client, corpus_dir: Path, run: str,
          attack: str | None) -> tuple[float, dict, list[dict], Attacker | None]:
    created = admin.post("/api/v1/runs", json={
        "name": run, "algorithm": "sparta", "corpus": str(corpus_dir), "shard_tokens": 4096, "eval_tokens": 4096,
        "eval_every": 1000, "epochs": 0, "model": MODEL, "sparta": SPARTA,
        "inner": {"steps": STEPS, "batch_size": 8, "lr": LR, "warmup_steps": 3}})
    assert created.status_code == 201, created.text
    attacker = Attacker(url, run, attack) if attack else None
    if attacker:
        attacker.start()
    try:
        lb.train(url, run, workers=HONEST, rounds=ROUNDS, prefix=f"{run}-", timeout_s=300)
    finally:
        if attacker:
            attacker.stop.set()
            attacker.join(60)
    loss, status = lb.settle(admin, run, HONEST * ROUNDS)
    listed = admin.get(f"/api/v1/runs/{run}/workers").json()
    return loss, status, listed, attacker


@pytest.mark.slow
@pytest.mark.parametrize("attack", ["beyond", "edge"])
def test_a_sparta_attacker_beside_three_honest_workers(coordinator, corpus_dir, attack, _clean={}):
    lb, url, admin = coordinator
    if "run" not in _clean:
        _clean["run"] = train(lb, url, admin, corpus_dir, "clean", None)
    clean, clean_status, _, _ = _clean["run"]
    loss, status, listed, attacker = train(lb, url, admin, corpus_dir, attack, attack)
    start = status["eval_history"][0]["loss"]
    assert clean < start - 0.3, (start, clean)
    assert status["version"] == clean_status["version"] == HONEST * ROUNDS  # equal versions
    codes = {kind: sorted(set(c)) for kind, c in attacker.codes.items()}
    print(f"sparta over HTTP, {attack}: clean {clean:.4f}, attacked {loss:.4f} ({loss / clean - 1:+.2%}); "
          f"attacker's exchanges {len(attacker.codes['exchange'])} {codes['exchange']}, "
          f"fresh tokens' {len(attacker.codes['fresh'])} {codes['fresh']}, leases {codes['lease']}")
    assert loss <= clean * 1.02, (attack, clean, loss)
    by_name = {w["name"]: w for w in listed}
    assert all(by_name[f"w{i}"]["standing"] == "ok" for i in range(HONEST)), listed  # no honest worker flagged
    assert attacker.error is None, repr(attacker.error)
    assert attacker.codes["exchange"], attacker.codes  # it did attack
    if attack == "beyond":
        # early on 2.5x the old allowance is within 10x the lease's reach: answered, its step of the model
        # clipped to that reach; past it refused, and the attacker stopped (throttled, then banned)
        assert 422 in attacker.codes["exchange"]
        assert by_name["mallory"]["standing"] in ("throttled", "banned")
        # a fresh token's reach is its one lease's steps: every one of theirs is far past it
        assert attacker.codes["fresh"] and set(attacker.codes["fresh"]) == {422}, codes
    else:  # within its reach: answered, and harmless
        assert set(attacker.codes["exchange"]) == {200}
