"""worker.trainer with the sparta algorithms: exchanges through an injected callable, answered on a
background thread and applied between steps; replicas kept (sparta) or reset (sparta+diloco)."""

from __future__ import annotations

import threading
import time
from datetime import datetime, timezone

import pytest
import torch

from shared import codec, protocol
from shared.algorithms.compress import k_for, tensor_seed
from shared.algorithms.sparta import exchange_seed, mix_into_centre
from shared.config import CompressionConfig, InnerConfig, SpartaConfig
from shared.model import ModelConfig, build_model, get_params, param_schema
from worker.trainer import LocalTrainer

MODEL = ModelConfig(n_layer=1, d_model=32, n_head=2, context=32)
SCHEMA = param_schema(build_model(MODEL))


def make_lease(algorithm: str, *, lease_id: int = 1, seed: int = 5, steps: int = 4, every: int = 2, lr: float = 3e-3,
               p: float = 0.2, base_version: int = 0, model: ModelConfig = MODEL) -> protocol.Lease:
    return protocol.Lease(
        lease_id=lease_id, run="t", shard_id=0, shard_sha256="0" * 64, base_version=base_version, seed=seed, lr=lr,
        inner=InnerConfig(steps=steps, batch_size=2, warmup_steps=0),
        compression=CompressionConfig(index="topk", fraction=0.1, values="int8"), model=model.to_dict(),
        deadline=datetime(2030, 1, 1, tzinfo=timezone.utc), algorithm=algorithm,
        sparta=SpartaConfig(p=p, every=every, alpha=0.5, values="fp32"))



@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    text = b"the quick brown fox jumps over the lazy dog, again and again. " * 40
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).clone()


def base_params(seed: int = 0) -> dict[str, torch.Tensor]:
    return get_params(build_model(MODEL, seed=seed))


class Centre:
    """The coordinator's side of an exchange, in memory, with its checks."""

    def __init__(self, lease: protocol.Lease, params: dict[str, torch.Tensor]) -> None:
        self.lease, self.params, self.steps = lease, {n: t.clone() for n, t in params.items()}, []
        self.lock = threading.Lock()

    def __call__(self, step: int, body: bytes) -> bytes:
        sent = codec.decode(body, schema=SCHEMA)
        seed = exchange_seed(self.lease.seed, step)
        for e in sent.entries:
            assert e.seed == tensor_seed(seed, e.name) and e.k == k_for(e.numel, self.lease.sparta.p)
        with self.lock:
            self.steps.append(step)
            return codec.encode(mix_into_centre(self.params, sent, alpha=0.5, values="fp32"))


def test_sparta_exchanges_every_few_steps_and_ends_with_an_empty_delta(tokens):
    lease = make_lease("sparta", steps=6, every=2, base_version=3)
    centre = Centre(lease, base_params(1))  # far from the worker's start
    tr = LocalTrainer(torch.device("cpu"))
    assert tr.needs_snapshot(lease)
    result = tr.train_round(lease, base_params(0), tokens, exchange=centre)
    assert sorted(centre.steps) == [2, 4, 6]
    assert (result.exchanges, result.exchanges_failed, result.exchanges_skipped) == (3, 0, 0)
    assert result.exchange_bytes_up > 0 and result.exchange_bytes_down > 0
    delta = codec.decode(result.body, schema=SCHEMA)
    assert delta.base_version == 3 and delta.entries == () and result.values_sent == 0
    assert tr.residual == {}
    # the corrections were applied: the worker moved toward the centre, beyond what training alone does
    alone = LocalTrainer(torch.device("cpu"))
    alone.train_round(lease, base_params(0), tokens)  # no exchange callable: trains without exchanges
    with_ex, without = get_params(tr.model), get_params(alone.model)
    dist = lambda a: sum(float((a[n] - centre.params[n]).norm()) for n in a)  # noqa: E731
    assert dist(with_ex) < dist(without)


def test_sparta_keeps_its_replica_between_leases(tokens):
    tr = LocalTrainer(torch.device("cpu"))
    first = make_lease("sparta", lease_id=1)
    tr.train_round(first, base_params(0), tokens, exchange=Centre(first, base_params(0)))
    mine = get_params(tr.model)
    second = make_lease("sparta", lease_id=2, seed=6, base_version=1, lr=0.0)  # lr 0: only the start shows
    assert not tr.needs_snapshot(second)
    tr.train_round(second, None, tokens)
    assert all(torch.equal(mine[n], t) for n, t in get_params(tr.model).items())
    # even when a snapshot is passed, the replica is not reset
    tr.train_round(make_lease("sparta", lease_id=3, seed=7, lr=0.0), base_params(9), tokens)
    assert all(torch.equal(mine[n], t) for n, t in get_params(tr.model).items())
    # a new model shape starts over from the snapshot
    wider = ModelConfig(n_layer=1, d_model=48, n_head=2, context=32)
    assert tr.needs_snapshot(make_lease("sparta", model=wider))


@pytest.mark.parametrize("algorithm", ["sparta+diloco", "diloco"])
def test_other_algorithms_reset_to_the_snapshot(tokens, algorithm):
    tr = LocalTrainer(torch.device("cpu"))
    first = make_lease(algorithm)
    tr.train_round(first, base_params(0), tokens, exchange=Centre(first, base_params(1)))
    second = make_lease(algorithm, lease_id=2, lr=0.0)
    assert tr.needs_snapshot(second)
    with pytest.raises(ValueError, match="snapshot"):
        tr.train_round(second, None, tokens)
    base = base_params(4)
    tr.train_round(second, base, tokens)
    assert all(torch.equal(base[n], t) for n, t in get_params(tr.model).items())


def test_sparta_diloco_sends_the_pseudo_gradient_after_its_exchanges(tokens):
    lease = make_lease("sparta+diloco", steps=4, every=1)
    centre = Centre(lease, base_params(1))
    tr = LocalTrainer(torch.device("cpu"))
    result = tr.train_round(lease, base_params(0), tokens, exchange=centre)
    assert sorted(centre.steps) == [1, 2, 3, 4] and result.exchanges == 4
    delta = codec.decode(result.body, schema=SCHEMA)
    assert {e.name for e in delta.entries} == set(SCHEMA)
    assert all(e.index_kind == codec.IndexKind.PACKED for e in delta.entries)
    assert result.values_sent > 0


def test_a_failed_exchange_is_skipped_not_fatal(tokens):
    lease = make_lease("sparta", steps=6, every=1)
    centre = Centre(lease, base_params(1))

    def flaky(step: int, body: bytes) -> bytes:
        if step in (2, 5):
            raise ConnectionError("network down")
        if step == 3:
            return b"garbage"
        return centre(step, body)

    result = LocalTrainer(torch.device("cpu")).train_round(lease, base_params(0), tokens, exchange=flaky)
    assert (result.exchanges, result.exchanges_failed) == (3, 3)
    assert sorted(centre.steps) == [1, 4, 6]


class Refused(Exception):
    def __init__(self, status: int) -> None:
        super().__init__(f"{status}: lease gone")
        self.status = status


def test_a_gone_lease_stops_the_exchanges_of_the_round(tokens):
    lease = make_lease("sparta", steps=6, every=1)
    calls = []

    def gone(step: int, body: bytes) -> bytes:
        calls.append(step)
        raise Refused(410)

    result = LocalTrainer(torch.device("cpu"), max_exchanges_in_flight=1).train_round(
        lease, base_params(0), tokens, exchange=gone)
    assert len(result.losses) == 6
    assert calls and len(calls) < 6 and result.exchanges == 0


def test_training_never_waits_for_an_answer(tokens):
    """The first answer is held back until the last step has run; it is still applied at round end."""
    lease = make_lease("sparta", steps=5, every=1)
    centre = Centre(lease, base_params(1))
    last_step = threading.Event()

    def slow(step: int, body: bytes) -> bytes:
        if step == 1:
            assert last_step.wait(20), "training waited for the exchange"
        return centre(step, body)

    def on_step(step: int, loss: float) -> None:
        if step == 5:
            last_step.set()

    result = LocalTrainer(torch.device("cpu"), max_exchanges_in_flight=2).train_round(
        lease, base_params(0), tokens, exchange=slow, on_step=on_step)
    # the one thread was busy with step 1 throughout; two in flight at most, the rest skipped
    assert result.exchanges + result.exchanges_skipped == 5 and result.exchanges_failed == 0
    assert result.exchanges >= 2 and result.exchanges_skipped >= 1


def test_round_end_waits_a_bounded_time(tokens):
    lease = make_lease("sparta", steps=2, every=1)
    release = threading.Event()

    def stuck(step: int, body: bytes) -> bytes:
        release.wait(10)
        raise ConnectionError("too late")

    tr = LocalTrainer(torch.device("cpu"), exchange_wait_s=0.2)
    t0 = time.monotonic()
    result = tr.train_round(lease, base_params(0), tokens, exchange=stuck)
    assert time.monotonic() - t0 < 5
    assert result.exchanges == 0 and result.exchanges_failed == 2
    release.set()
    tr.close()


def test_an_unknown_algorithm_is_refused(tokens):
    with pytest.raises(ValueError, match="upgrade"):
        LocalTrainer(torch.device("cpu")).train_round(make_lease("gossip"), base_params(0), tokens)
