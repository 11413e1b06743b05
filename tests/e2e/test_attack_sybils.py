"""Sybils on diloco over real HTTP: one `idletrain coordinator serve`, four honest `idletrain worker run`
processes (on the coordinator's own machine, 127.0.0.1), and four tokens of one attacker from one other
address (127.0.0.9) that train honest rounds and send, instead, their delta at 1.4x its norm for the
first half of the run, then at cosine -0.09 to it at its norm (the issue's attack: 12 of 16 merged,
none throttled, +2.2% eval loss). The tokens speak as one voice (coordinator/voices.py): the run ends
within 2% of the four honest workers' run without them, and no honest worker is flagged."""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
import zstandard

from shared import codec, protocol
from shared.model import build_model, param_schema
from shared.snapshot import decode_snapshot
from tests import procs
from worker.trainer import LocalTrainer

HONEST, SYBILS, ROUNDS = 4, 4, 4
STEPS = 6
MODEL = {"n_layer": 1, "d_model": 32, "n_head": 2, "context": 32}


@pytest.fixture(scope="module")
def coordinator(tmp_path_factory, corpus_dir) -> Iterator[tuple[procs.Idletrain, str, httpx.Client]]:
    with procs.Idletrain.serving(tmp_path_factory.mktemp("attack-sybils"), corpus_dir) as served:
        yield served


def poisoned(body: bytes, schema: dict, *, aligned: bool, rng) -> bytes:
    """The Sybil's own honest delta at 1.4x its norm, or at cosine -0.09 to it at its norm."""
    sent = codec.decode(body, schema=schema)
    v = np.concatenate([np.asarray(e.values, np.float64) for e in sent.entries])
    norm = float(np.linalg.norm(v))
    if aligned:
        out = 1.4 * v
    else:
        noise = rng.standard_normal(v.size)
        noise -= (noise @ v) / (norm * norm) * v
        out = norm * (-0.09 * v / norm + math.sqrt(1 - 0.09 ** 2) * noise / np.linalg.norm(noise))
    entries, at = [], 0
    for e in sent.entries:
        entries.append(codec.Entry(e.name, e.numel, e.index_kind, codec.ValueKind.FP32,
                                   out[at:at + e.k].astype(np.float32), e.indices, e.seed))
        at += e.k
    return codec.encode(codec.Delta(sent.base_version, tuple(entries)))


class Sybils(threading.Thread):
    """SYBILS tokens from one address, each in turn: lease, train honestly, send the poisoned delta."""

    def __init__(self, url: str, run: str) -> None:
        super().__init__(daemon=True)
        self.url, self.run_name = url, run
        self.stop = threading.Event()
        self.codes: list[int] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            transport = httpx.HTTPTransport(local_address="127.0.0.9")
            with httpx.Client(base_url=self.url, timeout=60, transport=transport) as client:
                self._attack(client)
        except BaseException as exc:  # the test says what stopped it
            self.error = exc

    def _attack(self, client: httpx.Client) -> None:
        tokens = []
        for i in range(SYBILS):
            resp = client.post(f"/api/v1/runs/{self.run_name}/workers", json={"name": f"s{i}"})
            assert resp.status_code == 201, resp.text
            tokens.append({"Authorization": f"Bearer {resp.json()['token']}"})
        trainers = [LocalTrainer(torch.device("cpu")) for _ in tokens]
        rng, turn = np.random.default_rng(0), 0
        while not self.stop.is_set():
            headers, trainer = tokens[turn % SYBILS], trainers[turn % SYBILS]
            turn += 1
            resp = client.post(f"/api/v1/runs/{self.run_name}/leases", headers=headers)
            if resp.status_code != 200:  # no work now, or throttled, or banned
                self.codes.append(resp.status_code)
                self.stop.wait(0.5)
                continue
            lease = protocol.Lease.model_validate(resp.json())
            schema = param_schema(build_model(lease.model))
            base, _ = decode_snapshot(client.get(f"/api/v1/runs/{self.run_name}/snapshots/{lease.base_version}",
                                                 headers=headers).content, schema=schema)
            raw = client.get(f"/api/v1/runs/{self.run_name}/shards/{lease.shard_id}", headers=headers).content
            shard = torch.from_numpy(np.frombuffer(zstandard.ZstdDecompressor().stream_reader(raw).read(),
                                                   dtype=np.uint8).copy())
            body = trainer.train_round(lease, base, shard).body
            version = client.get(f"/api/v1/runs/{self.run_name}/status").json()["version"]
            body = poisoned(body, schema, aligned=version < HONEST * ROUNDS // 2, rng=rng)
            resp = client.post(f"/api/v1/leases/{lease.lease_id}/delta", content=body,
                               headers={**headers, "Content-Type": "application/octet-stream"})
            self.codes.append(resp.status_code)


def train(lb: procs.Idletrain, url: str, admin: httpx.Client, corpus_dir: Path, run: str,
          attack: bool) -> tuple[float, dict, list[dict], Sybils | None]:
    created = admin.post("/api/v1/runs", json={
        "name": run, "corpus": str(corpus_dir), "shard_tokens": 4096, "eval_tokens": 4096, "eval_every": 1000,
        "epochs": 0, "model": MODEL, "outer": {"group": HONEST},
        "inner": {"steps": STEPS, "batch_size": 8, "lr": 3e-3, "warmup_steps": 2}})
    assert created.status_code == 201, created.text
    sybils = Sybils(url, run) if attack else None
    if sybils:
        sybils.start()
    try:
        lb.train(url, run, workers=HONEST, rounds=ROUNDS, prefix=f"{run}-", timeout_s=300)
    finally:
        if sybils:
            sybils.stop.set()
            sybils.join(120)
    merged = admin.get(f"/api/v1/runs/{run}/status").json()
    loss, status = lb.settle(admin, run, merged["version"] if attack else HONEST * ROUNDS)
    return loss, status, admin.get(f"/api/v1/runs/{run}/workers").json(), sybils


@pytest.mark.slow
def test_four_sybils_of_one_address_beside_four_honest_workers(coordinator, corpus_dir):
    lb, url, admin = coordinator
    clean, _, _, _ = train(lb, url, admin, corpus_dir, "clean", False)
    loss, status, listed, sybils = train(lb, url, admin, corpus_dir, "sybils", True)
    assert sybils.error is None, repr(sybils.error)
    by_name = {w["name"]: w for w in listed}
    standings = sorted((f"s{i}", by_name[f"s{i}"]["standing"]) for i in range(SYBILS))
    print(f"sybils over HTTP: clean {clean:.4f}, attacked {loss:.4f} ({loss / clean - 1:+.2%}); their uploads "
          f"{sorted(set(sybils.codes))} ({sybils.codes.count(202)} acknowledged), merged {status['merged_deltas']}, "
          f"rejected {status['rejected_deltas']}; {standings}")
    assert sybils.codes.count(202) >= SYBILS  # they did attack
    assert loss <= clean * 1.02, (clean, loss)
    assert all(by_name[f"w{i}"]["standing"] == "ok" for i in range(HONEST)), listed
    assert len({s for _, s in standings}) == 1, standings  # one address, one standing
