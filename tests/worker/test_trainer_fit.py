"""worker.fit and the trainer with it: micro-batches picked from memory, bf16 autocast, activation
checkpointing. None of them changes what travels: the delta stays fp32 in the run's format."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from shared import codec
from shared.config import CompressionConfig, InnerConfig
from shared.data import sample_batch
from shared.model import ModelConfig, build_model, param_schema
from tests.worker.test_trainer import MODEL, base_params, make_lease
from worker import fit, memory
from worker.fit import FitOptions, autocast_dtype, checkpoint_blocks, pick_micro_batch
from worker.trainer import LocalTrainer

CPU = torch.device("cpu")
FP32 = CompressionConfig(index="dense", values="fp32", error_feedback=False)  # the pseudo-gradient as it is
SCHEMA = param_schema(build_model(MODEL))


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    text = b"the quick brown fox jumps over the lazy dog, again and again. " * 80
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).clone()


def dense(body: bytes) -> dict[str, torch.Tensor]:
    return {n: torch.from_numpy(a) for n, a in codec.decode(body, schema=SCHEMA).to_dense(SCHEMA).items()}


# -- precision -------------------------------------------------------------------------------------

def test_auto_precision_is_fp32_on_cpu_and_bf16_where_the_accelerator_has_it(monkeypatch):
    assert autocast_dtype("auto", CPU) is None and autocast_dtype("fp32", CPU) is None
    assert autocast_dtype("bf16", CPU) is torch.bfloat16
    monkeypatch.setattr(fit, "bf16_supported", lambda device: True)
    assert autocast_dtype("auto", torch.device("cuda")) is torch.bfloat16
    assert autocast_dtype("auto", torch.device("mps")) is torch.bfloat16
    assert autocast_dtype("fp32", torch.device("cuda")) is None
    monkeypatch.setattr(fit, "bf16_supported", lambda device: False)  # e.g. a pre-Ampere GPU
    assert autocast_dtype("auto", torch.device("cuda")) is None
    with pytest.raises(RuntimeError, match="--precision bf16.*cannot compute bf16.*auto or fp32"):
        autocast_dtype("bf16", torch.device("cuda"))


def test_the_default_trainer_on_cpu_is_the_fp32_round_bit_for_bit(tokens):
    lease = make_lease(seed=5)
    plain = LocalTrainer(CPU).train_round(lease, base_params(), tokens)
    auto = LocalTrainer(CPU, fit=FitOptions(precision="auto", micro_batch=None)).train_round(lease, base_params(), tokens)
    fp32 = LocalTrainer(CPU, fit=FitOptions(precision="fp32")).train_round(lease, base_params(), tokens)
    assert plain.body == auto.body == fp32.body and plain.losses == auto.losses


def test_a_bf16_round_on_cpu_sends_a_finite_fp32_delta_in_the_same_format(tokens):
    lease = make_lease(seed=5, steps=6)
    fp32 = LocalTrainer(CPU).train_round(lease, base_params(), tokens)
    tr = LocalTrainer(CPU, fit=FitOptions(precision="bf16"))
    bf16 = tr.train_round(lease, base_params(), tokens)
    assert all(p.dtype == torch.float32 for p in tr.model.parameters())  # fp32 master weights
    assert all(t.dtype == torch.float32 for s in tr.opt.state.values() for t in s.values() if t.dim() > 0)
    got, want = codec.decode(bf16.body, schema=SCHEMA), codec.decode(fp32.body, schema=SCHEMA)
    assert [(e.name, e.index_kind, e.value_kind) for e in got.entries] == [
        (e.name, e.index_kind, e.value_kind) for e in want.entries]
    sent = dense(bf16.body)
    assert all(t.dtype == torch.float32 and torch.isfinite(t).all() for t in sent.values())
    assert all(math.isfinite(v) for v in bf16.losses)
    assert bf16.losses != fp32.losses  # autocast really ran: bf16 rounding shows in the losses
    assert bf16.losses[0] == pytest.approx(fp32.losses[0], rel=0.02)
    # the delta points where the fp32 one does
    a = torch.cat([t.flatten() for t in sent.values()])
    b = torch.cat([t.flatten() for t in dense(fp32.body).values()])
    assert torch.nn.functional.cosine_similarity(a, b, dim=0) > 0.8


# -- activation checkpointing ----------------------------------------------------------------------

def _grads(model, x, y) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    _, loss = model(x, y)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_activation_checkpointing_keeps_names_results_and_gradients(tokens):
    cfg = ModelConfig(n_layer=3, d_model=32, n_head=2, context=32)
    plain, ckpt = build_model(cfg, seed=1), build_model(cfg, seed=1)
    assert checkpoint_blocks(ckpt) == 3 and checkpoint_blocks(ckpt) == 3  # twice: no double wrapping
    assert [n for n, _ in ckpt.named_parameters()] == [n for n, _ in plain.named_parameters()]
    x, y = sample_batch(tokens, batch_size=4, context=cfg.context, generator=torch.Generator().manual_seed(0))
    calls = []
    handle = ckpt.blocks[0].register_forward_pre_hook(lambda mod, args: calls.append(1))
    want, got = _grads(plain, x, y), _grads(ckpt, x, y)
    handle.remove()
    assert len(calls) == 1  # the hook sees the call; the recomputation inside checkpoint runs forward directly
    for n, g in want.items():
        torch.testing.assert_close(got[n], g, rtol=1e-5, atol=1e-7)
    ckpt.eval()
    with torch.no_grad():  # evaluation runs the plain forward
        torch.testing.assert_close(ckpt(x)[0], plain.eval()(x)[0])
    twin = copy.deepcopy(ckpt)  # a copy's blocks recompute themselves, not the original's
    assert twin.blocks[0].forward.__self__ is twin.blocks[0]


def test_activation_checkpointing_recomputes_in_backward(tokens):
    """It is on: each block's forward runs twice per step (forward, then again in backward)."""
    cfg = ModelConfig(n_layer=2, d_model=32, n_head=2, context=32)
    model = build_model(cfg, seed=0)
    checkpoint_blocks(model)
    runs = []
    model.blocks[1].attn.register_forward_hook(lambda *a: runs.append(1))
    x, y = sample_batch(tokens, batch_size=2, context=cfg.context, generator=torch.Generator())
    _grads(model, x, y)
    assert len(runs) == 2


def test_a_model_without_blocks_is_a_clear_error():
    with pytest.raises(ValueError, match="has none: train without --activation-checkpointing"):
        checkpoint_blocks(torch.nn.Linear(2, 2))


def test_a_checkpointed_trainer_sends_the_same_round(tokens):
    lease = make_lease(seed=9, compression=FP32)
    plain = LocalTrainer(CPU).train_round(lease, base_params(), tokens)
    tr = LocalTrainer(CPU, fit=FitOptions(activation_checkpointing=True))
    ckpt = tr.train_round(lease, base_params(), tokens)
    assert "forward" in tr.model.blocks[0].__dict__  # the trainer's model was wrapped
    assert ckpt.losses == pytest.approx(plain.losses, rel=1e-5)
    for n, t in dense(plain.body).items():
        torch.testing.assert_close(dense(ckpt.body)[n], t, rtol=1e-4, atol=1e-6)
    tr.restore_state(tr.export_state())  # a restored model is checkpointed too
    assert "forward" in tr.model.blocks[0].__dict__


# -- micro-batches ---------------------------------------------------------------------------------

def test_pick_micro_batch_takes_the_smallest_wish_and_balances_the_passes():
    inner = InnerConfig(batch_size=10)
    assert pick_micro_batch(MODEL, inner) is None  # the whole batch
    assert pick_micro_batch(MODEL, inner, cap=4) == 4  # 4 + 3 + 3: three passes, at most 4 rows
    assert pick_micro_batch(MODEL, inner, cap=6) == 5  # two passes of 5, not 6 + 4
    assert pick_micro_batch(MODEL, inner, cap=50) is None
    assert pick_micro_batch(MODEL, InnerConfig(batch_size=10, micro_batch_size=3), cap=5) == 3
    assert pick_micro_batch(MODEL, InnerConfig(batch_size=10, micro_batch_size=5)) == 5
    assert pick_micro_batch(MODEL, inner, max_params=10**9) is None  # fits at once


def test_pick_micro_batch_splits_what_the_memory_budget_cannot_hold_at_once():
    cfg = ModelConfig(vocab_size=256, n_layer=4, n_head=4, d_model=256, context=4096)
    inner = InnerConfig(batch_size=256)
    max_params = 5_000_000
    n, budget = fit.n_params(cfg), memory.budget_bytes(max_params)
    assert memory.round_bytes(n, cfg, batch_size=256) > budget  # the whole batch does not fit
    rows = pick_micro_batch(cfg, inner, max_params=max_params)
    assert rows is not None and 1 <= rows < 256
    assert memory.round_bytes(n, cfg, batch_size=rows) <= budget  # each pass fits
    passes = math.ceil(256 / rows)
    fewer = math.ceil(256 / (passes - 1)) if passes > 1 else 256
    assert memory.round_bytes(n, cfg, batch_size=fewer) > budget  # and no fewer passes would
    assert pick_micro_batch(cfg, inner, max_params=max_params, cap=2) == 2  # a smaller cap still wins


def test_the_trainer_trains_in_the_micro_batches_it_picks(tokens, monkeypatch):
    lease = make_lease(seed=3, compression=FP32)  # batch 4
    seen = []
    tr = LocalTrainer(CPU, fit=FitOptions(micro_batch=1))
    assert tr.micro_batch(lease) == 1
    tr._ensure_model(lease)
    tr.model.blocks[0].register_forward_pre_hook(lambda mod, args: seen.append(args[0].shape[0]))
    split = tr.train_round(lease, base_params(), tokens)
    assert seen == [1] * 4 * lease.inner.steps
    whole = LocalTrainer(CPU).train_round(lease, base_params(), tokens)
    assert split.losses == pytest.approx(whole.losses, rel=1e-5)
    for n, t in dense(whole.body).items():
        torch.testing.assert_close(dense(split.body)[n], t, rtol=1e-3, atol=1e-5)
