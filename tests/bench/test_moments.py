"""DES-LOC's state averaging and dynamic local steps in the simulator (bench/moments.py, bench/sim.py)."""

from __future__ import annotations

import dataclasses

import torch

from bench.moments import MomentSchedule, MomentSync, decode_state, encode_state
from bench.sim import Method, local_steps, run_method
from shared.algorithms.inner import make_optimizer, run_steps
from shared.config import OuterConfig
from shared.model import build_model
from tests.bench.conftest import TINY, tiny_setup


@dataclasses.dataclass
class _Worker:
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    rounds: int = 0
    bytes_up: int = 0
    bytes_down: int = 0


def _trained(seed: int, steps: int = 3) -> _Worker:
    setup = tiny_setup(steps)
    model = build_model(TINY, seed=0)
    opt = make_optimizer(model, setup.inner)
    run_steps(model, opt, setup.train, setup.inner, lr=1e-2, steps=steps, generator=torch.Generator().manual_seed(seed))
    return _Worker(model, opt)


def _state(w: _Worker, state: str) -> dict[str, torch.Tensor]:
    return {n: w.opt.state[p][state].clone() for n, p in w.model.named_parameters()}


def test_the_second_moment_survives_its_trip_within_its_quantisation():
    w = _trained(1)
    names = {p: n for n, p in w.model.named_parameters()}
    schema = {n: tuple(p.shape) for n, p in w.model.named_parameters()}
    v = _state(w, "exp_avg_sq")
    back = decode_state(encode_state(w.opt, names, "exp_avg_sq", 1e-8), schema, "exp_avg_sq", 1e-8)
    for n, t in v.items():
        big = t > 1e-12  # below eps^2 the value is AdamW's eps's anyway
        assert (back[n] >= 0).all()
        ratio = back[n][big] / t[big]
        assert ratio.min() > 0.8 and ratio.max() < 1.25, n  # log-domain int8: within the docstring's bound


def test_workers_adopt_the_mean_of_the_latest_reports_when_due():
    a, b = _trained(1), _trained(2)
    va, vb = _state(a, "exp_avg_sq"), _state(b, "exp_avg_sq")
    ma = _state(a, "exp_avg")
    sync = MomentSync(MomentSchedule(first=0, second=2))
    a.rounds = b.rounds = 1
    sync.round_done(0, a)
    assert a.bytes_up == a.bytes_down == 0  # not due after one round of a period of two: nothing changes
    assert all(torch.equal(_state(a, "exp_avg_sq")[n], va[n]) for n in va)
    a.rounds = b.rounds = 2
    sync.round_done(0, a)  # alone so far: its own state comes back (quantised)
    sync.round_done(1, b)  # b adopts the mean of a's and its own
    assert a.bytes_up > 0 and a.bytes_down > 0 and b.bytes_up > 0
    for n in va:
        mean = (va[n] + vb[n]) / 2
        big = mean > 1e-10
        ratio = _state(b, "exp_avg_sq")[n][big] / mean[big]
        assert ratio.min() > 0.75 and ratio.max() < 1.3, n
    assert all(torch.equal(_state(a, "exp_avg")[n], ma[n]) for n in ma)  # the first moment stays local


def test_dynamic_local_steps_follow_speed():
    m = Method("d", "diloco", H=40, dynamic_h=True)
    assert local_steps(m, (1.0, 2.0, 3.0)) == (20, 40, 60)
    assert local_steps(dataclasses.replace(m, dynamic_h=False), (1.0, 2.0, 3.0)) == (40, 40, 40)
    assert local_steps(dataclasses.replace(m, H=1), (0.1, 1.0, 1.9)) == (1, 1, 2)  # at least one step


def test_dynamic_h_trains_the_same_tokens_in_rounds_of_equal_time():
    setup = tiny_setup(12)
    fixed = run_method(setup, Method("d", "diloco", H=4, outer=OuterConfig(group=3), speed_spread=4.0))
    dyn = run_method(setup, Method("d", "diloco", H=4, outer=OuterConfig(group=3), speed_spread=4.0, dynamic_h=True))
    assert dyn.curve[-1][0] >= fixed.curve[-1][0] == setup.total_steps * setup.tokens_per_step
    assert dyn.max_staleness < fixed.max_staleness  # equal round times: deltas arrive in step


def test_desloc_rows_count_the_states_bytes():
    setup = tiny_setup(12)
    plain = run_method(setup, Method("d", "diloco", H=2, outer=OuterConfig(group=3)))
    des = run_method(setup, Method("d", "diloco", H=2, outer=OuterConfig(group=3),
                                   moments=MomentSchedule(first=3, second=6)))
    assert des.bytes_up_per_worker > plain.bytes_up_per_worker
    assert des.bytes_down_per_worker > plain.bytes_down_per_worker
    assert des.eval_loss != plain.eval_loss and des.curve[-1][0] == plain.curve[-1][0]
