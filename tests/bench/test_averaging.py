"""The averaging benchmark: its AdamW is torch's, its oracle is exact where it claims to be."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from bench.averaging import (ALONE, BATCHES, FULL_SEEDS, H_SWEEP, MODES, FlatAdamW, Regime, Row, clip, run,
                             rows_for, train)
from shared.algorithms.inner import make_optimizer
from shared.config import InnerConfig
from shared.data import sample_batch
from shared.model import ModelConfig, build_model

TINY = ModelConfig(n_layer=1, n_head=2, d_model=16, context=16)


def _well_posed() -> torch.Tensor:
    """Every coordinate but the attention's key biases: softmax ignores a constant added to every key,
    so their gradient is zero up to float rounding, and AdamW normalises that rounding noise into
    steps of +-lr whose signs no two orders of summation share."""
    keep = []
    for name, p in build_model(TINY).named_parameters():
        mask = torch.ones(p.numel(), dtype=torch.bool)
        if name.endswith("attn.qkv.bias"):
            mask[TINY.d_model:2 * TINY.d_model] = False
        keep.append(mask)
    return torch.cat(keep)


def assert_same(actual: torch.Tensor, expected: torch.Tensor, **tol) -> None:
    keep = _well_posed()
    torch.testing.assert_close(actual[keep], expected[keep], **tol)


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    rng = np.random.default_rng(0)
    text = np.frombuffer(b"the quick brown fox jumps over the lazy dog. " * 200, dtype=np.uint8)
    return torch.from_numpy(np.concatenate([text, rng.integers(0, 256, 3000, dtype=np.uint8)]))


def test_flat_adamw_is_torch_adamw(tokens):
    cfg = InnerConfig(lr=1e-2, batch_size=4, grad_clip=1.0)
    ours = FlatAdamW(build_model(TINY, seed=3), cfg)
    model = build_model(TINY, seed=3)
    theirs = make_optimizer(model, cfg)
    gen = torch.Generator().manual_seed(5)
    for step in range(6):
        x, y = sample_batch(tokens, batch_size=4, context=TINY.context, generator=gen)
        lr = 1e-2 * (step + 1) / 6
        ours.moments(clip(ours.grad(x, y), cfg.grad_clip))
        ours.step(lr)
        _, loss = model(x, y)
        theirs.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        for group in theirs.param_groups:
            group["lr"] = lr
        theirs.step()
    expected = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
    assert_same(ours.flat, expected, rtol=1e-5, atol=1e-7)
    assert not torch.equal(ours.flat, torch.nn.utils.parameters_to_vector(build_model(TINY, seed=3).parameters()))


def _regime(**inner) -> Regime:
    return Regime("tiny", TINY, InnerConfig(lr=1e-2, warmup_steps=2, batch_size=4, **inner), workers=3, steps=6)


def test_shared_second_moment_at_h1_is_ddp_exactly_without_clipping(tokens):
    """The updates are linear in the first moments, so the only thing averaging loses at H = 1 is the
    normalisation: with ddp's second moment the average is ddp (up to float rounding)."""
    regime = _regime(grad_clip=0.0)
    ddp = train(Row(regime, "ddp"), tokens)
    shared = train(Row(regime, "shared v", 1), tokens)
    plain = train(Row(regime, "average", 1), tokens)
    assert_same(shared, ddp, rtol=1e-4, atol=1e-6)
    keep = _well_posed()
    assert (plain - ddp)[keep].abs().max() > 100 * (shared - ddp)[keep].abs().max()  # each worker's own v is not ddp's


def test_one_worker_averaging_is_plain_adamw(tokens):
    regime = dataclasses.replace(_regime(), workers=1)
    alone = train(Row(regime, "ddp"), tokens)
    for mode in MODES[1:]:
        assert_same(train(Row(regime, mode, 2), tokens), alone, rtol=1e-5, atol=1e-7)


def test_alone_is_worker_0_training_by_itself(tokens):
    """The lone worker draws worker 0's batches: a one-worker ddp of the same regime, and not what
    averaging (or another worker's stream) gives."""
    regime = _regime()
    alone = train(Row(regime, ALONE), tokens)
    assert torch.equal(alone, train(Row(dataclasses.replace(regime, workers=1), "ddp"), tokens))
    assert not torch.equal(alone, train(Row(regime, "average", 3), tokens))
    assert Row(regime, ALONE).name == "alone"


def test_the_gain_scales_the_average_up_where_workers_disagree(tokens):
    regime = _regime()
    start = torch.nn.utils.parameters_to_vector(build_model(TINY, seed=0).parameters()).detach()
    plain = train(Row(regime, "average", 3), tokens) - start
    gained = train(Row(regime, "gain", 3), tokens) - start
    assert float(gained.norm()) > float(plain.norm())
    assert float(gained.norm()) <= float(plain.norm()) * regime.workers ** 0.5 * 1.5  # clamped to sqrt(M)


def test_run_writes_every_row_against_its_own_ddp(tmp_path, tokens, monkeypatch):
    pytest.importorskip("matplotlib")
    base = _regime()
    wider = dataclasses.replace(base, name="wider", inner=base.inner.model_copy(update={"batch_size": 8}))
    other = dataclasses.replace(base, seed=1)
    rows = [Row(base, "ddp"), Row(base, "average", 2), Row(base, "gain", 2), Row(base, "shared v", 3),
            Row(wider, "ddp"), Row(wider, "average", 2), Row(other, "ddp"), Row(other, "average", 2)]
    monkeypatch.setattr("bench.averaging.load_corpus", lambda max_bytes: _Corpus(tokens))
    results = run(out=tmp_path, rows=rows, threads=1, eval_tokens=2000)
    assert [r["row"] for r in results] == ["ddp", "average H=2", "gain H=2", "shared v H=3", "ddp", "average H=2",
                                           "ddp", "average H=2"]
    assert results[0]["loss_ratio_vs_ddp"] == 1.0 and results[4]["loss_ratio_vs_ddp"] == 1.0
    assert results[5]["loss_ratio_vs_ddp"] == round(results[5]["eval_loss"] / results[4]["eval_loss"], 4)
    assert results[7]["loss_ratio_vs_ddp"] == round(results[7]["eval_loss"] / results[6]["eval_loss"], 4)
    assert results[6]["eval_loss"] != results[0]["eval_loss"]  # another seed: another init and other batches
    assert json.loads((tmp_path / "results.json").read_text()) == results
    table = (tmp_path / "results.md").read_text()
    assert "| wider | average H=2 | 1 |" in table
    lo, hi = sorted([results[1]["loss_ratio_vs_ddp"], results[7]["loss_ratio_vs_ddp"]])
    assert f"| tiny | average H=2 | 2 | {(results[1]['eval_loss'] + results[7]['eval_loss']) / 2:.3f} | " in table
    assert f"{lo:.3f}-{hi:.3f}" in table
    assert (tmp_path / "ratio.png").stat().st_size > 1000


def test_the_batch_profile_plots_against_the_batch(tmp_path, tokens, monkeypatch):
    pytest.importorskip("matplotlib")
    base = _regime()
    wider = dataclasses.replace(base, name="wider", inner=base.inner.model_copy(update={"batch_size": 8}))
    rows = [Row(base, "ddp"), Row(base, ALONE), Row(base, "average", 6), Row(wider, "ddp"), Row(wider, ALONE),
            Row(wider, "average", 6)]
    monkeypatch.setattr("bench.averaging.load_corpus", lambda max_bytes: _Corpus(tokens))
    results = run(profile="batch", out=tmp_path, rows=rows, threads=1, eval_tokens=2000)
    assert [r["batch_per_worker"] for r in results] == [4, 4, 4, 8, 8, 8]
    assert results[4]["loss_ratio_vs_ddp"] == round(results[4]["eval_loss"] / results[3]["eval_loss"], 4)
    assert "| wider | alone | 1 |" in (tmp_path / "results.md").read_text()
    assert (tmp_path / "ratio.png").stat().st_size > 1000


class _Corpus:
    def __init__(self, tokens: torch.Tensor) -> None:
        self.train = tokens.numpy()
        self.eval = tokens.numpy()[:2000]


def test_profiles():
    quick, full = rows_for("quick"), rows_for("full")
    sweep = 1 + 3 * len(H_SWEEP)
    assert quick[0].mode == "ddp" and len(quick) == sweep
    assert full[:sweep] == quick and len(full) == len(FULL_SEEDS) * sweep + 6
    assert {r.regime.seed for r in full} == set(FULL_SEEDS)
    batch = rows_for("batch")
    assert [r.regime.inner.batch_size for r in batch] == [b for b in BATCHES for _ in range(4)]
    assert [r.name for r in batch[:4]] == ["ddp", "alone", "average H=40", f"average H={batch[0].regime.steps}"]
    assert {r.regime.steps for r in batch} == {quick[0].regime.steps} and {r.regime.seed for r in batch} == {0}
    with pytest.raises(ValueError, match="unknown profile"):
        rows_for("huge")


def test_the_command_refuses_bad_options_and_writes_nothing(tmp_path, capsys):
    from bench.__main__ import main

    for args in (["--profile", "huge"], ["--workers", "1"], ["--threads", "0"]):
        assert main(["averaging", "--out", str(tmp_path / "out"), *args]) == 2
        assert "idletrain:" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
