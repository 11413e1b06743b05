"""worker.trainer: device choice, one local round, error feedback across rounds."""

from __future__ import annotations

import dataclasses
from datetime import datetime, timezone

import pytest
import torch

from shared import codec, protocol
from shared.config import CompressionConfig, InnerConfig
from shared.model import ModelConfig, build_model, get_params, param_schema
from worker.trainer import LocalTrainer, pick_device

MODEL = ModelConfig(n_layer=1, d_model=32, n_head=2, context=32)


@pytest.fixture
def no_accelerators(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    if getattr(torch.backends, "mps", None) is not None:
        monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)


def test_auto_is_cpu_without_accelerators(no_accelerators):
    assert pick_device("auto") == torch.device("cpu")
    assert pick_device() == torch.device("cpu")
    assert pick_device("cpu") == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_auto_is_cpu_on_this_machine():
    assert pick_device("auto").type in ("cpu", "mps")


def test_auto_prefers_cuda_when_present(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert pick_device("auto") == torch.device("cuda")


@pytest.mark.parametrize("device, words", [("cuda", ["--device cuda", "no CUDA", "cpu"]),
                                           ("mps", ["--device mps", "MPS", "cpu"])])
def test_an_unavailable_device_is_a_clear_error(no_accelerators, device, words):
    with pytest.raises(RuntimeError) as info:
        pick_device(device)
    for word in words:
        assert word in str(info.value)


def make_lease(*, base_version: int = 5, seed: int = 123, lease_id: int = 1, model: ModelConfig = MODEL,
               compression: CompressionConfig | None = None, steps: int = 4) -> protocol.Lease:
    return protocol.Lease(
        lease_id=lease_id, run="t", shard_id=0, shard_sha256="0" * 64, base_version=base_version, seed=seed,
        lr=3e-3, inner=InnerConfig(steps=steps, batch_size=4, warmup_steps=0),
        compression=compression or CompressionConfig(index="topk", fraction=0.1, values="int8"),
        model=model.to_dict(), deadline=datetime(2030, 1, 1, tzinfo=timezone.utc))


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    text = b"the quick brown fox jumps over the lazy dog, again and again. " * 80
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).clone()


def base_params(seed: int = 0, model: ModelConfig = MODEL) -> dict[str, torch.Tensor]:
    return get_params(build_model(model, seed=seed))


SCHEMA = param_schema(build_model(MODEL))


def sent_of(body: bytes) -> dict[str, torch.Tensor]:
    return {n: torch.from_numpy(a) for n, a in codec.decode(body, schema=SCHEMA).to_dense(SCHEMA).items()}


def test_a_round_produces_a_delta_the_coordinator_can_decode(tokens):
    tr = LocalTrainer(torch.device("cpu"))
    lease = make_lease(base_version=5)
    base = base_params()
    steps = []
    result = tr.train_round(lease, base, tokens, on_step=lambda i, loss: steps.append((i, loss)))
    delta = codec.decode(result.body, schema=SCHEMA)
    assert delta.base_version == 5
    assert {e.name for e in delta.entries} == set(SCHEMA)
    assert all(e.index_kind == codec.IndexKind.PACKED and e.value_kind == codec.ValueKind.INT8
               for e in delta.entries)
    assert result.values_sent == sum(e.k for e in delta.entries)
    assert result.values_sent < 0.15 * sum(t.numel() for t in base.values())  # about 10% travels
    assert len(result.losses) == 4 and all(torch.isfinite(torch.tensor(result.losses)))
    assert [i for i, _ in steps] == [1, 2, 3, 4]
    assert result.tokens == 4 * 4 * MODEL.context
    assert result.seconds > 0
    # the round trained: the pseudo-gradient is base - local, and the sent part is not zero
    assert any(e.values.any() for e in delta.entries)
    local = get_params(tr.model)
    assert any(not torch.equal(base[n], local[n]) for n in base)
    # the base it was given is not modified
    assert all(torch.equal(base[n], t) for n, t in base_params().items())


def test_a_round_is_reproducible_from_its_seed(tokens):
    lease = make_lease(seed=77)
    a = LocalTrainer(torch.device("cpu")).train_round(lease, base_params(), tokens)
    b = LocalTrainer(torch.device("cpu")).train_round(lease, base_params(), tokens)
    assert a.body == b.body and a.losses == b.losses
    c = LocalTrainer(torch.device("cpu")).train_round(make_lease(seed=78), base_params(), tokens)
    assert c.losses != a.losses


def test_error_feedback_residual_carries_between_rounds(tokens):
    tr = LocalTrainer(torch.device("cpu"))
    base1 = base_params()
    r1 = tr.train_round(make_lease(base_version=0, seed=1), base1, tokens)
    local1 = get_params(tr.model)
    sent1 = sent_of(r1.body)
    res1 = {n: t.clone() for n, t in tr.residual.items()}
    assert set(res1) == set(SCHEMA)
    for n in SCHEMA:  # what did not travel stays behind
        assert torch.allclose(res1[n], base1[n] - local1[n] - sent1[n], atol=1e-7), n
    assert sum(t.abs().sum() for t in res1.values()) > 0

    base2 = {n: t - 0.5 * sent1[n] for n, t in base1.items()}  # as if the coordinator merged it
    r2 = tr.train_round(make_lease(base_version=1, seed=2), base2, tokens)
    local2 = get_params(tr.model)
    sent2 = sent_of(r2.body)
    assert codec.decode(r2.body, schema=SCHEMA).base_version == 1
    for n in SCHEMA:  # sent + new residual == this round's pseudo-gradient + last round's residual
        pg2 = base2[n] - local2[n]
        assert torch.allclose(tr.residual[n] + sent2[n], pg2 + res1[n], atol=1e-6), n
    # and not merely this round's pseudo-gradient: the old residual was really added
    gap = max((tr.residual[n] + sent2[n] - (base2[n] - local2[n])).abs().max() for n in SCHEMA)
    assert gap > 1e-4
    assert tr.steps_done == 8  # warm-up and AdamW state continue across rounds


def test_without_error_feedback_nothing_is_kept(tokens):
    tr = LocalTrainer(torch.device("cpu"))
    no_ef = CompressionConfig(index="topk", fraction=0.1, values="int8", error_feedback=False)
    tr.train_round(make_lease(compression=no_ef), base_params(), tokens)
    assert tr.residual == {}
    tr.undeliverable()  # nothing to fold back; must not fail
    assert tr.residual == {}


def test_undeliverable_folds_the_last_delta_back(tokens):
    tr = LocalTrainer(torch.device("cpu"))
    result = tr.train_round(make_lease(seed=3), base_params(), tokens)
    before = {n: t.clone() for n, t in tr.residual.items()}
    sent = sent_of(result.body)
    tr.undeliverable()
    for n in SCHEMA:
        assert torch.allclose(tr.residual[n], before[n] + sent[n], atol=1e-7), n
    # the residual now holds the whole pseudo-gradient: base - local
    local = get_params(tr.model)
    base = base_params()
    for n in SCHEMA:
        assert torch.allclose(tr.residual[n], base[n] - local[n], atol=1e-6), n
    folded = {n: t.clone() for n, t in tr.residual.items()}
    tr.undeliverable()  # once only: a second call must not add it again
    assert all(torch.equal(folded[n], tr.residual[n]) for n in SCHEMA)


def test_a_new_model_shape_starts_fresh(tokens):
    tr = LocalTrainer(torch.device("cpu"))
    tr.train_round(make_lease(), base_params(), tokens)
    assert tr.residual and tr.steps_done == 4
    wider = dataclasses.replace(MODEL, d_model=48)
    result = tr.train_round(make_lease(model=wider), base_params(model=wider), tokens)
    schema = param_schema(build_model(wider))
    assert codec.decode(result.body, schema=schema).base_version == 5
    assert tr.steps_done == 4  # the counter restarted with the new model
    assert {tuple(t.shape) for t in tr.residual.values()} == set(schema.values())



def test_a_round_ahead_of_its_base_starts_from_base_minus_own_deltas(tokens):
    """`ahead` (the worker's own deltas the base does not hold yet): the round starts from base -
    ahead and its pseudo-gradient is taken against that start, exactly as if the coordinator had
    handed out base - ahead; the base itself is left alone."""
    base = base_params()
    first = LocalTrainer(torch.device("cpu")).train_round(make_lease(seed=4), base, tokens)
    ahead = sent_of(first.body)
    assert sum(t.abs().sum() for t in ahead.values()) > 0
    lease = make_lease(seed=5, lease_id=2)
    got = LocalTrainer(torch.device("cpu")).train_round(lease, base, tokens, ahead=ahead)
    want = LocalTrainer(torch.device("cpu")).train_round(lease, {n: t - ahead[n] for n, t in base.items()}, tokens)
    assert got.body == want.body and got.losses == want.losses
    plain = LocalTrainer(torch.device("cpu")).train_round(lease, base, tokens)
    assert plain.body != got.body
    assert all(torch.equal(base[n], t) for n, t in base_params().items())
    # sparta rounds have no pseudo-gradient to correct: `ahead` changes nothing there
    sparta = make_lease(seed=5, lease_id=3).model_copy(update={"algorithm": "sparta"})
    a = LocalTrainer(torch.device("cpu")).train_round(sparta, base, tokens, ahead=ahead)
    b = LocalTrainer(torch.device("cpu")).train_round(sparta, base, tokens)
    assert a.losses == b.losses
