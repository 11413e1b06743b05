"""An exchange's limits come from its own lease's reach and the coordinator's reference round; beyond
them it is clipped, far beyond them refused, a refusal counts only against an outlier, and the descent
guard scales a step that would raise the loss."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from shared import codec
from shared.algorithms import sparta
from shared.algorithms.exchange_screen import (NEW_TOKEN_SHARE, counts_against, descent_gradient, exchange_limits,
                                               guard_scale, judge_exchange, remember, trust)
from shared.algorithms.robust import Norms, Rejection
from shared.config import RobustConfig, SpartaConfig

CFG = RobustConfig()
SPARTA = SpartaConfig(p=0.1, every=2)


def limits(*, step=4, earlier=0, reference=2.0, k=100, n=1000):
    return exchange_limits(step=step, earlier_steps=earlier, lr=1e-3, sparta=SPARTA, cfg=CFG, reference_norm=reference,
                           round_steps=8, n_params=n, k=k)


def test_the_reach_is_the_lease_s_steps_plus_what_a_veteran_carries():
    fresh = limits(step=4, earlier=0)
    assert fresh.span == 4  # a new token's replica is this lease's base
    assert fresh.radius == pytest.approx(3.0 * 1e-3 * 4)
    assert fresh.norm == pytest.approx(1.5 * 2.0 / 8 * math.sqrt(0.1) * 4)
    assert limits(step=4, earlier=8).span == 12  # one round behind it
    # capped: an element is pulled back every every/p steps, and drifts about as a random walk in between
    assert limits(step=4, earlier=10_000).span == pytest.approx(4 + 3 * math.sqrt(2 / 0.1))
    assert limits(reference=None).norm is None  # no reference round: the per-value radius only
    # nothing about the run's totals or the centre's state: the same lease step, the same limits
    assert limits(step=4, earlier=0) == fresh


def test_within_limits_as_sent_beyond_them_clipped_far_beyond_refused():
    lim = limits(step=4, reference=0.2)  # radius 0.012, norm bound 0.0474 on 100 values
    rng = np.random.default_rng(0)
    honest = [rng.uniform(-0.003, 0.003, 100)]
    v = judge_exchange(honest, lim, cfg=CFG)
    assert v.action == "accept" and v.clipped is None and v.ratio < 1
    edge = [np.full(100, 0.011)]  # every value under the radius, the norm 2.3x its bound
    v = judge_exchange(edge, lim, cfg=CFG)
    assert v.action == "clip" and v.merged
    assert math.sqrt(sum(float(np.sum(d * d)) for d in v.clipped)) == pytest.approx(lim.norm)
    spike = [np.concatenate([np.full(99, 0.001), [0.05]])]  # one value 4x the radius
    v = judge_exchange(spike, lim, cfg=CFG)
    assert v.action == "clip" and float(np.max(np.abs(v.clipped[0]))) == pytest.approx(lim.radius)
    far = [np.full(100, 95.8)]  # the attack: values of the run's old per-element limit
    v = judge_exchange(far, lim, cfg=CFG)
    assert v.action == "reject" and v.rejection is Rejection.BOUND and "local AdamW steps" in v.reason
    v = judge_exchange([np.array([0.0, math.nan])], lim, cfg=CFG)
    assert v.action == "reject" and v.rejection is Rejection.NONFINITE


def test_screening_off_accepts_anything_finite():
    off = CFG.model_copy(update={"enabled": False})
    assert judge_exchange([np.full(10, 1e6)], limits(), cfg=off).action == "accept"
    assert not judge_exchange([np.full(10, math.inf)], limits(), cfg=off).merged


def test_a_refusal_counts_only_against_an_outlier_among_its_peers():
    peers_fine = Norms({"1": [0.3, 0.4], "2": [0.5], "3": [0.2]})
    assert counts_against(peers_fine, "9", cfg=CFG)
    assert counts_against(Norms(), "9", cfg=CFG)  # nobody to compare with: the bound alone speaks
    polluted = Norms({"1": [4.0], "2": [7.0], "3": [0.4], "9": [0.1]})  # most peers beyond their limits too
    assert not counts_against(polluted, "3", cfg=CFG)
    assert not counts_against(polluted, "9", cfg=CFG)  # its own record is left out of its peers' median


def test_remember_keeps_folded_ratios_per_worker():
    h = Norms()
    remember(h, "1", judge_exchange([np.full(10, 1e-4)], limits(), cfg=CFG), cfg=CFG)
    remember(h, "1", judge_exchange([np.array([math.nan])], limits(), cfg=CFG), cfg=CFG)  # not a ratio
    assert list(h.by_worker) == ["1"] and len(h.by_worker["1"]) == 1


def entry(values, indices):
    return codec.Entry("w", 8, codec.IndexKind.SEEDED, codec.ValueKind.FP32, np.asarray(values, np.float32),
                       np.asarray(indices, np.int64), 7)


def mix(sent, clipped, scale):
    centre = torch.zeros(8)

    def add(e, d):
        centre.index_add_(0, torch.from_numpy(e.indices), d)

    corr = sparta.mix_clipped(lambda e: centre[torch.from_numpy(e.indices)], add, sent, clipped=clipped,
                              alpha=0.5, scale=scale, values="fp32")
    return centre, corr


def test_the_centre_moves_by_what_was_let_through_the_worker_by_its_whole_correction():
    sent = codec.Delta(0, (entry([1.0, -2.0], [1, 4]),))
    centre, corr = mix(sent, None, 1.0)  # accepted at full weight: sparta's mix exactly
    want = {n: torch.zeros(8) for n in ["w"]}
    want_corr = sparta.mix_into_centre(want, sent, alpha=0.5, values="fp32")
    assert torch.equal(centre, want["w"]) and np.array_equal(corr.entries[0].values, want_corr.entries[0].values)
    centre, corr = mix(sent, None, 0.25)  # the descent guard's scale: the centre's step only
    assert centre[1].item() == pytest.approx(0.125) and corr.entries[0].values[0] == pytest.approx(0.5)
    centre, corr = mix(sent, (np.array([0.1, -0.1]),), 1.0)  # clipped: the centre moves half the clipped distance
    assert centre[1].item() == pytest.approx(0.05) and centre[4].item() == pytest.approx(-0.05)
    assert list(corr.entries[0].values) == [0.5, -1.0]  # the worker is still pulled halfway
    centre, _ = mix(sent, (), 1.0)
    assert torch.count_nonzero(centre) == 0


def test_the_descent_guard_scales_only_a_step_that_raises_the_loss():
    assert guard_scale(-5.0, 2.0) == 1.0  # down the loss: as it is
    assert guard_scale(0.001, 2.0) == 1.0  # within the budget (0.2% of 2.0 = 0.004)
    assert guard_scale(0.04, 2.0) == pytest.approx(0.1)  # ten times the budget: a tenth of the step
    assert guard_scale(math.nan, 2.0) == 1.0 and guard_scale(1.0, 0.0) == 1.0


def test_the_descent_gradient_is_the_loss_s_own():
    from shared.model import ModelConfig, build_model

    model = build_model(ModelConfig(n_layer=1, d_model=16, n_head=2, context=8, vocab_size=256), seed=0)
    tokens = torch.randint(0, 256, (200,), generator=torch.Generator().manual_seed(0))
    loss, grad = descent_gradient(model, tokens, context=8)
    assert grad.numel() == sum(p.numel() for p in model.parameters()) and torch.isfinite(grad).all()
    with torch.no_grad():  # a small step down the gradient lowers the loss, one up it raises it
        offset = 0
        for p in model.parameters():
            p -= 1e-2 * grad[offset:offset + p.numel()].reshape(p.shape)
            offset += p.numel()
    lower, _ = descent_gradient(model, tokens, context=8)
    assert lower < loss
    assert all(p.grad is None for p in model.parameters())  # the model is left as it was, gradients and all


def test_a_token_keeps_half_its_step_until_it_delivered_a_round():
    assert trust(0) == NEW_TOKEN_SHARE == 0.5  # a token that only exchanges, never delivers
    assert trust(1) == trust(50) == 1.0
