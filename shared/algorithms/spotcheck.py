"""The replay spot-check's math (pure): re-train a lease's round and compare it with what was sent.

The coordinator re-trains a sampled lease's round from the same base, shard, seed and lr with the
same code a worker runs (inner.run_steps) and a fresh optimiser as the run makes it (AdamW, or the
group-normalised one), and compares the decoded delta the worker sent with that replay's
pseudo-gradient:

    cosine      cos(sent, replay), on the dense decoded delta
    norm_ratio  ||sent|| / ||replay||

Two runs of replay_round on CPU give equal bits. A worker's round equals the replay where the
worker starts from what the replay starts from: its first round (a fresh AdamW, warm-up from step
0); there the delta sent differs from the replay by its compression alone. A later round of the
same worker starts from AdamW state its earlier rounds left (and from its base minus its own
deltas in flight), which the coordinator does not hold: close to the replay, not equal. So the
verdict has two sets of bounds, `exact` and `carried` (SpotCheckBounds), measured on CPU
(tests/shared/algorithms/test_spotcheck_math.py, and docs/reliability.md#replay-spot-checks):

    exact (a worker's first round): honest int4 0.9977-0.9990 (norm ratio 1.004-1.012), bf16
        autocast 0.9987 (its raw pseudo-gradient 0.9999); the delta of another shard from the same
        base 0.73-0.95, another seed on the same shard 0.81-0.95; half the delta passes the cosine
        but not the ratio
    carried (later rounds, AdamW state of earlier rounds): honest 0.80-0.99 (ratio 0.63-1.02);
        another shard's delta 0.62-0.99 overlaps: not caught there. Zeros (ratio 0), a random
        delta (~0), a sign-flipped one (-1) and one blown up 10x are caught in both.

Those bounds are for values that keep a direction (fp32 to int4: cosine >= 0.997 with what they
round). Coarser values keep less of it by themselves: int1 0.8 on normal values (0.93 measured on
the test model's first round), int2 0.94-0.99, and their norm as much (least-squares magnitudes).
So `compare` is given the replay rounded by the delta's own value codecs (`rounded_on_support`),
and scales the cosine bound and the norm-ratio bounds by what that rounding keeps of the replay:
an honest int1 first round is held to 0.98 of int1's own cosine, and another shard's delta,
rounded alike, still falls below it.

A sparta round sends nothing at its end: its progress went out in its exchanges. Its check
(`replay_exchanges`, `exchange_vectors`) replays the round from the worker's committed replica and
optimizer state, applying the coordinator's corrections after the steps the worker says it did, and
holds what the exchanges carried (less the start) to `compare_committed` against the replay's weights
at the same indices.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from shared.algorithms import sparta
from shared.algorithms.inner import make_optimizer, pseudo_gradient, run_steps
from shared.algorithms.start_state import StartState
from shared.codec import Delta, Entry
from shared.codec.values import VALUE_CODECS
from shared.config import InnerConfig, SpartaConfig
from shared.model import ModelConfig, build_model, get_params, set_params
from shared.optim_state import load_optimizer_state


@dataclasses.dataclass(frozen=True)
class SpotCheckBounds:
    """What a sent delta must be, against the replay, to pass."""

    min_cosine: float
    min_ratio: float
    max_ratio: float

    def __post_init__(self) -> None:
        if not (-1.0 <= self.min_cosine <= 1.0 and 0.0 <= self.min_ratio < self.max_ratio):
            raise ValueError(f"spot-check bounds out of order: {self}")


# A worker's first round is the replay but for compression (int4: cos >= 0.997) and bf16 (>= 0.9999):
# 0.98 passes those with room and fails another shard's delta (<= 0.95 measured) and a scaled one.
EXACT = SpotCheckBounds(min_cosine=0.98, min_ratio=0.8, max_ratio=1.25)
# Later rounds carry AdamW state the replay lacks: honest measured >= 0.80, ratio 0.63-1.02.
CARRIED = SpotCheckBounds(min_cosine=0.5, min_ratio=0.2, max_ratio=3.0)
# ... and at int1/int2 with error feedback, the residual earlier rounds' rounding left out, which grows
# to the size of a round: honest int1 rounds drift down to 0.55 over 30 rounds of the test model, and to
# 0.31-0.45 in the long-run regime of `bench field` (5 of 6 honest checks failed CARRIED there). This
# bound keeps what CARRIED catches for certain (zeros, a random delta ~0, a sign-flipped one, one blown
# up 10x) and no more.
CARRIED_COARSE = SpotCheckBounds(min_cosine=0.1, min_ratio=0.2, max_ratio=3.0)
COARSE_VALUES = ("int1", "int2")  # least-squares magnitudes: their error feedback carries most


@dataclasses.dataclass(frozen=True)
class Comparison:
    cosine: float
    norm_ratio: float  # ||sent|| / ||replay||; inf when the replay moved nothing and the sent delta did
    passed: bool
    reason: str | None  # why it failed


def replay_round(model_cfg: ModelConfig, inner: InnerConfig, base: Mapping[str, torch.Tensor], tokens: torch.Tensor,
                 *, lr: float, seed: int, step_offset: int = 0, start: StartState | None = None,
                 feedback_decay: float = 1.0) -> dict[str, torch.Tensor]:
    """The pseudo-gradient (base - local) of a round of inner.steps AdamW steps from `base` on
    `tokens`, batches drawn as a worker draws them (torch.Generator seeded by the lease's seed); on
    CPU in fp32, the same bits every time.

    start: the worker's committed start state (start_state.py): its AdamW state is loaded, its
    steps_done is the warm-up's offset (step_offset is then ignored), and its residual is added
    (times feedback_decay) as the worker adds it before compressing. None: a fresh AdamW."""
    model = build_model(model_cfg)
    set_params(model, {n: t.to(torch.float32) for n, t in base.items()})
    opt = make_optimizer(model, inner)
    if start is not None and not start.fresh:
        load_optimizer_state(model, opt, dataclasses.replace(
            start.optimizer, groups=[{} for _ in opt.param_groups]))
    if start is not None:
        step_offset = start.steps_done
    run_steps(model, opt, tokens, inner, lr=lr, steps=inner.steps, generator=torch.Generator().manual_seed(seed),
              step_offset=step_offset)
    pg = pseudo_gradient(base, get_params(model))
    if start is not None and start.residual:
        pg = {n: t + feedback_decay * start.residual[n] if n in start.residual else t for n, t in pg.items()}
    return pg


def replay_exchanges(model_cfg: ModelConfig, inner: InnerConfig, start_params: Mapping[str, torch.Tensor],
                     tokens: torch.Tensor, *, lr: float, batch_seed: int, lease_seed: int, steps: Sequence[int],
                     cfg: SpartaConfig, start: StartState,
                     corrections: Mapping[int, Sequence[Delta]] | None = None) -> dict[int, Delta]:
    """What a sparta round's exchanges would carry had it trained alone: from `start_params` and the
    committed optimizer state, the round's steps on `tokens` (batches drawn from batch_seed, as
    replay_round draws them), and after each step in `steps` the weights at that exchange's seeded
    indices (sparta.select, values unrounded), by step. CPU, fp32, the same bits every time.

    The worker's own round also applies the coordinator's corrections as they arrive (w -= d on the
    indices of its earlier exchanges); `corrections`, local step -> the corrections its worker applied
    after it (before selecting that step's exchange), applies them where the worker did."""
    model = build_model(model_cfg)
    set_params(model, {n: t.to(torch.float32) for n, t in start_params.items()})
    opt = make_optimizer(model, inner)
    if not start.fresh:
        load_optimizer_state(model, opt, dataclasses.replace(start.optimizer, groups=[{} for _ in opt.param_groups]))
    params = dict(model.named_parameters())
    want, out = set(steps), {}

    def on_step(step: int, loss: float) -> None:
        for d in (corrections or {}).get(step, ()):
            sparta.apply_correction(params, d)
        if step in want:
            out[step] = sparta.select(params, p=cfg.p, seed=sparta.exchange_seed(lease_seed, step), values="fp32")

    if want:
        run_steps(model, opt, tokens, inner, lr=lr, steps=max(want), generator=torch.Generator().manual_seed(batch_seed),
                  step_offset=start.steps_done, on_step=on_step)
    return out


MAX_APPLIED_CHARS = 1 << 16  # the header's text at most (some 6,000 exchanges a round)


def format_applied(resumed_at: int, applied: Mapping[int, int]) -> str:
    """protocol.H_EXCHANGES_APPLIED's text: the step the round resumed at (0: none), then each
    exchange's step and the local step after which its correction was applied."""
    return f"{int(resumed_at)};" + ",".join(f"{int(s)}:{int(t)}" for s, t in sorted(applied.items()))


def parse_applied(text: str, *, steps: int | None = None) -> tuple[int, dict[int, int]]:
    """format_applied's inverse, checked (ValueError says what is wrong): every number a step of the
    round (steps: its local steps; None: not checked here), each correction applied after its own
    exchange, at most at the round's end (steps + 1)."""
    if len(text) > MAX_APPLIED_CHARS:
        raise ValueError(f"{len(text)} characters, more than {MAX_APPLIED_CHARS}")
    head, sep, rest = text.partition(";")
    if not sep or not head.isdigit():
        raise ValueError("not '<resumed at>;<exchange step>:<after step>,...'")
    applied: dict[int, int] = {}
    for pair in filter(None, rest.split(",")):
        s, colon, t = pair.partition(":")
        if not colon or not s.isdigit() or not t.isdigit() or len(s) > 9 or len(t) > 9:
            raise ValueError(f"{pair[:40]!r} is not '<exchange step>:<after step>'")
        s_, t_ = int(s), int(t)
        if s_ in applied or not 1 <= s_ < t_ or (steps is not None and t_ > steps + 1):
            raise ValueError(f"{pair[:40]!r}: a correction is applied once, after its exchange, by the round's end")
        applied[s_] = t_
    resumed = int(head[:9])
    if steps is not None and resumed > steps:
        raise ValueError(f"resumed at step {resumed} of a {steps}-step round")
    return resumed, applied


def exchange_vectors(sent: Mapping[int, Delta], replay: Mapping[int, Delta], control: Mapping[int, Delta],
                     start: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """(sent, replay, the replay rounded by the exchanges' own value codecs, the control), each the
    exchanges' values less the start's at their indices, laid end to end (float64): what the round
    moved its weights by where it exchanged them, as compare_committed takes it. The exchanges'
    indices are the ones their seeds draw, on both sides (the coordinator refuses others)."""
    parts: list[list[torch.Tensor]] = [[], [], [], []]
    for step in sorted(sent):
        ours, theirs = ({e.name: e for e in d[step].entries} for d in (replay, control))
        for e in sent[step].entries:
            r, k = ours.get(e.name), theirs.get(e.name)
            if r is None or k is None or not (e.seed == r.seed == k.seed):
                raise ValueError(f"exchange after step {step}: its {e.name} is not at the replay's indices")
            at = start[e.name].reshape(-1)[torch.from_numpy(np.asarray(e.indices, dtype=np.int64))].to(torch.float64)
            raw = np.asarray(r.values, dtype=np.float32)
            for i, values in enumerate((e.values, raw, _rounded(raw, e.value_kind), k.values)):
                parts[i].append(torch.from_numpy(np.asarray(values, dtype=np.float64)) - at)
    return tuple(torch.cat(p) if p else torch.zeros(0, dtype=torch.float64) for p in parts)


def _at(entry: Entry, replay: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The replay's values at the elements a delta entry sends (flat)."""
    r = replay[entry.name].reshape(-1)
    return r if entry.indices is None else r[torch.from_numpy(np.asarray(entry.indices, dtype=np.int64))]


def on_support(delta: Delta, replay: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(the values the delta sent, the replay's values at the same elements), each one float64 vector:
    a sparse delta is compared where it sends, not against the zeros where it sends nothing."""
    sent, ref = [], []
    for e in delta.entries:
        sent.append(torch.from_numpy(np.asarray(e.values, dtype=np.float64)))
        ref.append(_at(e, replay).to(torch.float64))
    if not sent:
        return torch.zeros(0, dtype=torch.float64), torch.zeros(0, dtype=torch.float64)
    return torch.cat(sent), torch.cat(ref)


def _rounded(values: np.ndarray, value_kind) -> np.ndarray:
    """fp32 values as a value codec carries them (encoded, then decoded)."""
    codec = VALUE_CODECS[value_kind]
    return codec.decode(memoryview(codec.encode(values)), values.size)[0]


def rounded_on_support(delta: Delta, replay: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The replay's values at the delta's elements (on_support's order), each entry rounded by its own
    value codec: what the delta would carry had its round been the replay, with nothing carried."""
    out = [torch.from_numpy(_rounded(_at(e, replay).to(torch.float32).numpy(), e.value_kind)).to(torch.float64)
           for e in delta.entries]
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.float64)


def _scaled(bounds: SpotCheckBounds, replay: torch.Tensor, rounded: torch.Tensor) -> SpotCheckBounds:
    """`bounds` times what rounding keeps of the replay: its cosine with the replay, its norm ratio."""
    nr, nq = float(replay.norm()), float(rounded.norm())
    if nr == 0 or nq == 0:
        return bounds
    keeps, ratio = float(rounded @ replay) / (nr * nq), nq / nr
    return SpotCheckBounds(min_cosine=bounds.min_cosine * keeps if bounds.min_cosine > 0 else bounds.min_cosine,
                           min_ratio=bounds.min_ratio * ratio, max_ratio=bounds.max_ratio * ratio)


def compare(sent: torch.Tensor, replay: torch.Tensor, bounds: SpotCheckBounds, *,
            rounded: torch.Tensor | None = None) -> Comparison:
    """The verdict on a sent delta (dense, flat) against the replay of its round (flat, same order).
    `rounded`: the replay rounded by the delta's value codecs (rounded_on_support); the bounds are then
    scaled by what that rounding keeps of the replay (module docstring)."""
    sent, replay = sent.to(torch.float64), replay.to(torch.float64)
    if rounded is not None:
        bounds = _scaled(bounds, replay, rounded.to(torch.float64))
    ns, nr = float(sent.norm()), float(replay.norm())
    if not math.isfinite(ns):
        return Comparison(math.nan, math.nan, False, "the delta sent is not finite")
    cosine = float(sent @ replay) / (ns * nr) if ns > 0 and nr > 0 else 0.0
    ratio = ns / nr if nr > 0 else (math.inf if ns > 0 else 1.0)
    if nr == 0 and ns == 0:
        return Comparison(1.0, 1.0, True, None)  # a round that moves nothing (lr 0): nothing to tell apart
    if ns == 0:
        return Comparison(0.0, 0.0, False, "it moves nothing (all its values are zero) where the coordinator's "
                                           "replay of the round moves the model")
    if cosine < bounds.min_cosine:
        return Comparison(cosine, ratio, False, f"its direction is not the replay's: cosine {cosine:.3f} with the "
                                                f"coordinator's replay of the round (at least {bounds.min_cosine:.3g})")
    if not bounds.min_ratio <= ratio <= bounds.max_ratio:
        return Comparison(cosine, ratio, False, f"its size is not the replay's: norm {ratio:.3g}x the coordinator's "
                                                f"replay of the round (within {bounds.min_ratio:.3g}-"
                                                f"{bounds.max_ratio:.3g}x)")
    return Comparison(cosine, ratio, True, None)


# What the round's own data adds, beyond what its start state explains: honest rounds measured
# cosine 1.0000 (fp32) and 0.969-0.998 (bf16 autocast) with it, another worker's delta of the same base
# 0.12-0.55 (bench/spotcheck.py; docs/reliability.md#replay-spot-checks).
MIN_DATA_COSINE = 0.8
CONTROL_SEED = 0x5A5A5A5A  # the control replay's batches: the lease's seed xor this, on another shard


def compare_committed(sent: torch.Tensor, replay: torch.Tensor, rounded: torch.Tensor,
                      control: torch.Tensor) -> Comparison:
    """The verdict on a round replayed from the worker's committed start state: `compare` by the EXACT
    bounds, and then what the round's data added must be the replay's: the sent delta less a control
    replay (the same start state on another shard and seed) against the rounded replay less it, cosine
    at least MIN_DATA_COSINE. After a few rounds AdamW's carried momentum dominates a round: another
    worker's delta of the same base measured cosine up to 0.993 with the replay, within EXACT; the
    part the data adds is what tells them apart. All vectors flat, on the delta's support."""
    verdict = compare(sent, replay, EXACT, rounded=rounded)
    if not verdict.passed:
        return verdict
    own, expected = sent.to(torch.float64) - control.to(torch.float64), rounded.to(torch.float64) - control
    no, ne = float(own.norm()), float(expected.norm())
    data = float(own @ expected) / (no * ne) if no > 0 and ne > 0 else (1.0 if no == ne == 0 else 0.0)
    if data < MIN_DATA_COSINE:
        return Comparison(verdict.cosine, verdict.norm_ratio, False, (
            f"what its round's data added is not the replay's: cosine {data:.3f} beyond what its start state "
            f"explains (at least {MIN_DATA_COSINE:g})"))
    return verdict
