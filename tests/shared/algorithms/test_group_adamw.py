"""AdamW normalised for the group's combined batch (shared/algorithms/group_adamw.py): its estimates,
its step, how it is made and saved, and that the replay spot-check tells it from plain AdamW."""

from __future__ import annotations

import math

import pytest
import torch

from shared.algorithms.group_adamw import GroupAdamW
from shared.algorithms.inner import make_optimizer, run_steps
from shared.algorithms.spotcheck import EXACT, compare, replay_round
from shared.config import InnerConfig
from shared.model import ModelConfig, build_model, get_params
from worker.state import load_optimizer_state, optimizer_state

TINY = ModelConfig(n_layer=1, d_model=32, n_head=2, context=16)


def stream(optimizer: torch.optim.Optimizer, p: torch.Tensor, *, mean: torch.Tensor, sigma: float, steps: int,
           seed: int = 0) -> list[torch.Tensor]:
    """Feed `steps` gradients mean + sigma * N(0, 1) (the parameter's own value plays no part); returns
    each step's update."""
    gen = torch.Generator().manual_seed(seed)
    updates = []
    for _ in range(steps):
        before = p.detach().clone()
        p.grad = mean + sigma * torch.randn(p.shape, generator=gen)
        optimizer.step()
        updates.append(p.detach() - before)
    return updates


def test_the_estimates_are_the_squared_mean_the_noise_and_the_combined_batchs_second_moment():
    n, steps, beta, workers = 20_000, 3_000, 0.99, 4
    p = torch.nn.Parameter(torch.zeros(n))
    mean = torch.full((n,), 0.5)
    mean[n // 2:] = -1.0  # two signal levels; noise sigma 2 everywhere
    opt = GroupAdamW([p], lr=1e-9, workers=workers, estimate_beta=beta)
    stream(opt, p, mean=mean, sigma=2.0, steps=steps)
    st = opt.state[p]
    correction = 1 - beta ** (steps - 1)
    signal, noise = st["signal"] / correction, st["noise"] / correction
    assert st["step"] == steps
    assert float(signal[: n // 2].mean()) == pytest.approx(0.25, rel=0.1)
    assert float(signal[n // 2:].mean()) == pytest.approx(1.0, rel=0.05)
    assert float(noise.mean()) == pytest.approx(4.0, rel=0.02)
    # the second moment of `workers` batches' mean gradient: mean^2 + sigma^2 / workers
    v = signal.clamp(min=0) + noise / workers
    assert float(v[n // 2:].mean()) == pytest.approx(1.0 + 1.0, rel=0.05)
    assert torch.equal(st["prev_grad"], p.grad)


def test_where_noise_dominates_its_step_is_sqrt_workers_times_adamws():
    """With long EMAs (0.999 both): with shorter ones the clamp max(signal, 0) of a noisy signal
    estimate adds to v, and the ratio is smaller (2.3 at 8 workers with both EMAs at 0.95)."""
    n = 4_000
    p1, p8 = torch.nn.Parameter(torch.zeros(n)), torch.nn.Parameter(torch.zeros(n))
    adamw = torch.optim.AdamW([p1], lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0)
    group = GroupAdamW([p8], lr=1e-3, workers=8, estimate_beta=0.999)
    zero = torch.zeros(n)
    rms = [math.sqrt(float(torch.stack(stream(o, p, mean=zero, sigma=1.0, steps=3000)[2000:]).pow(2).mean()))
           for o, p in ((adamw, p1), (group, p8))]
    assert rms[1] / rms[0] == pytest.approx(math.sqrt(8), rel=0.1)


def test_where_the_signal_dominates_it_steps_like_adamw():
    n = 1_000
    p1, p2 = torch.nn.Parameter(torch.zeros(n)), torch.nn.Parameter(torch.zeros(n))
    adamw = torch.optim.AdamW([p1], lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)
    group = GroupAdamW([p2], lr=1e-3, betas=(0.9, 0.95), workers=8)
    mean = torch.linspace(0.5, 2.0, n)
    a = stream(adamw, p1, mean=mean, sigma=0.01, steps=100)[-1]
    b = stream(group, p2, mean=mean, sigma=0.01, steps=100)[-1]
    assert torch.allclose(a, b, rtol=0.02)
    assert torch.allclose(b, torch.full((n,), -1e-3), rtol=0.02)  # a step of lr against the gradient


def test_the_first_step_and_weight_decay_are_adamws():
    torch.manual_seed(0)
    w = torch.randn(5, 7)
    g = torch.randn(5, 7)
    p1, p2 = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())
    adamw = torch.optim.AdamW([p1], lr=0.01, betas=(0.9, 0.95), weight_decay=0.1)
    group = GroupAdamW([p2], lr=0.01, betas=(0.9, 0.95), weight_decay=0.1, workers=4)
    for p, o in ((p1, adamw), (p2, group)):
        p.grad = g.clone()
        o.step()
    assert torch.allclose(p1, p2, atol=1e-7)


def test_bad_settings_and_sparse_gradients_are_refused():
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="workers must be at least 1"):
        GroupAdamW([p], lr=1e-3, workers=0)
    with pytest.raises(ValueError, match="betas"):
        GroupAdamW([p], lr=1e-3, workers=2, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="estimate_beta"):
        GroupAdamW([p], lr=1e-3, workers=2, estimate_beta=1.0)
    opt = GroupAdamW([p], lr=1e-3, workers=2)
    p.grad = torch.zeros(3).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()


def test_make_optimizer_picks_it_from_the_config_with_adamws_groups():
    model = build_model(TINY, seed=0)
    assert type(make_optimizer(model, InnerConfig())) is torch.optim.AdamW
    opt = make_optimizer(model, InnerConfig(second_moment_workers=8, weight_decay=0.05, beta2=0.97))
    assert isinstance(opt, GroupAdamW)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.05 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    assert decay["workers"] == 8 and decay["betas"] == (0.9, 0.97) and decay["estimate_beta"] == 0.99


def test_the_config_field_is_left_off_the_wire_at_its_default():
    assert "second_moment_workers" not in InnerConfig().model_dump()
    assert InnerConfig(second_moment_workers=8).model_dump()["second_moment_workers"] == 8
    with pytest.raises(ValueError):
        InnerConfig(second_moment_workers=0)


def test_its_state_survives_the_workers_save_and_load():
    tokens = torch.tensor(list(b"the quick brown fox jumps over the lazy dog. " * 40), dtype=torch.uint8)
    inner = InnerConfig(second_moment_workers=4, batch_size=4, lr=3e-3, warmup_steps=0)
    model = build_model(TINY, seed=0)
    opt = make_optimizer(model, inner)
    run_steps(model, opt, tokens, inner, lr=3e-3, steps=5, generator=torch.Generator().manual_seed(1))
    saved = optimizer_state(model, opt)
    assert {"exp_avg", "signal", "noise", "prev_grad"} <= set(next(iter(saved.tensors.values())))
    twin = build_model(TINY, seed=0)
    twin.load_state_dict(model.state_dict())
    twin_opt = make_optimizer(twin, inner)
    load_optimizer_state(twin, twin_opt, saved)
    for m, o in ((model, opt), (twin, twin_opt)):
        run_steps(m, o, tokens, inner, lr=3e-3, steps=3, generator=torch.Generator().manual_seed(2))
    for (name, a), b in zip(get_params(model).items(), get_params(twin).values()):
        assert torch.equal(a, b), name


def test_the_replay_spot_check_replays_the_runs_optimiser():
    """The coordinator's replay of a first round makes its optimiser from the lease's InnerConfig, so an
    honest worker's round with the group's normalisation passes the exact check; AdamW's round from the
    same start is a different delta (too close to be caught on a round this short: cos 0.989)."""
    tokens = torch.tensor(list(b"the quick brown fox jumps over the lazy dog. " * 200), dtype=torch.uint8)
    base = get_params(build_model(TINY, seed=0))
    group = InnerConfig(second_moment_workers=4, steps=10, batch_size=4, lr=3e-3, warmup_steps=3)
    plain = group.model_copy(update={"second_moment_workers": 1})

    def flat(delta):
        return torch.cat([t.flatten() for t in delta.values()])

    replay = flat(replay_round(TINY, group, base, tokens, lr=3e-3, seed=5))
    assert compare(flat(replay_round(TINY, group, base, tokens, lr=3e-3, seed=5)), replay, EXACT).passed
    other = compare(flat(replay_round(TINY, plain, base, tokens, lr=3e-3, seed=5)), replay, EXACT)
    assert other.cosine < 0.995 and abs(other.norm_ratio - 1) > 0.05, other


def test_a_run_normalised_for_more_workers_than_its_group_is_refused():
    from shared.config import RunConfig

    ok = RunConfig(name="r", inner={"second_moment_workers": 8}, outer={"group": 8})
    assert ok.inner.second_moment_workers == 8
    with pytest.raises(ValueError, match=r"second_moment_workers \(16\) exceeds outer.group \(8\)"):
        RunConfig(name="r", inner={"second_moment_workers": 16}, outer={"group": 8})
