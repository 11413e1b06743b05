"""Screening a sparse exchange (sparta) before it moves the global model: bound, clip, guard (pure).

An exchange sends the worker's replica values w at seeded indices; d = w - c is their distance from the
centre c there. How far an honest replica can be from the centre, per element, is what `span` local
steps of AdamW move an element (~lr a step), where

    span = step + min(LAG * sqrt(every / p), earlier)
      step     the lease's local steps so far: what this round moved since its base
      every/p  the local steps between two of one worker's exchanges of one element, on average (it was
               pulled halfway to the centre then); the drift since grows like a random walk's, and
               LAG * sqrt(every/p) covered every honest exchange measured (below)
      earlier  the worker's local steps in its merged rounds of the run before this one (0 for a new
               token, whose replica is this lease's base)

and the limits follow from the run's config and the coordinator's own reference round only (nothing a
worker sends, nothing the centre's current state holds, so an attacker cannot move them):

    radius     = element_factor * lr * span                        each value's distance
    norm_bound = reference_factor * (R / H) * sqrt(k / n) * span  the reference round's norm per step
                                                                  (R over H steps, n parameters), on k values

Then, for one exchange:

    a value that is not finite                           -> refused
    a value beyond reject_factor * radius, or the norm
    beyond reject_factor * norm_bound                    -> refused (a refusal counts against the worker
                                                            only when its peers' exchanges are within
                                                            their limits: `counts_against`)
    otherwise: d clipped to radius per value, then scaled to norm_bound; the centre moves by alpha times
               that, times `trust` (NEW_TOKEN_SHARE until the worker delivered a round), scaled down
               further by the descent guard where it would still raise the loss; the worker's correction
               is alpha * d as before (its own replica is pulled all the way).

The descent guard: the coordinator takes the gradient g of the published model's loss on its own
training tokens (the reference round's) once per version; a centre step s with g . s above GUARD_BUDGET
of that loss is scaled to it. Values at the edge of the limits can still be noise (second order), but
not a push up the loss.

So honest exchanges are never refused because the centre went wrong: they are judged against their own
lease's reach. Measured in process (tests/coordinator/test_poisoned.py's sparta run: 8 workers, p = 0.1,
every 2 steps, H = 6; and the same at p = 0.01 every step): honest exchanges reached 0.59x the limits in
a worker's first round and 0.85x in later ones (0.59x and 0.57x at p = 0.01), none was clipped or
scaled by the guard, and the eval loss was that of the unscreened mix (2.824 / 3.440 against 2.824 /
3.465; with the new-token share 2.827 / 3.461). One exchange of a worker with the widest reach, at 0.95x every limit up the eval loss's own
gradient, raised that loss by at most 0.20% at p = 0.1, 0.01 and 0.001 (without the guard 1.5%, 1.4%
and 4.5%); random signs at the limits by at most 0.38% (tests/coordinator/test_poisoned_sparta.py).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np
import torch

from shared.algorithms.robust import Norms, Rejection
from shared.config import RobustConfig, SpartaConfig


LAG = 3.0
NEW_TOKEN_SHARE = 0.5  # the share of its centre step a worker's exchange keeps before it delivered a round


def trust(rounds: int) -> float:
    """The share of its centre step an exchange keeps by its worker's record: NEW_TOKEN_SHARE until
    the worker delivered a round of the run, all of it after."""
    return 1.0 if rounds > 0 else NEW_TOKEN_SHARE


@dataclasses.dataclass(frozen=True)
class ExchangeLimits:
    span: float  # local steps of drift an honest replica's value can carry
    radius: float  # per value
    norm: float | None  # of the distance on the exchange's k values (None: no reference round yet)


def exchange_limits(*, step: int, earlier_steps: int, lr: float, sparta: SpartaConfig, cfg: RobustConfig,
                    reference_norm: float | None, round_steps: int, n_params: int, k: int) -> ExchangeLimits:
    """The limits of one exchange after local step `step` of a lease (module docstring)."""
    span = step + min(LAG * math.sqrt(sparta.every / sparta.p), max(0, earlier_steps))
    norm = None
    if reference_norm and cfg.reference_factor > 0 and n_params > 0:
        norm = cfg.reference_factor * reference_norm / round_steps * math.sqrt(k / n_params) * span
    return ExchangeLimits(span=span, radius=cfg.element_factor * lr * span, norm=norm)


@dataclasses.dataclass(frozen=True)
class ExchangeVerdict:
    action: str  # accept | clip | reject
    ratio: float  # the distance against its limits (1: at them): the larger of norm / norm_bound, peak / radius
    # per entry, the distance the centre moves toward: None as sent, () when refused (sparta.mix_clipped)
    clipped: tuple[np.ndarray, ...] | None
    reason: str | None
    rejection: Rejection | None = None

    @property
    def merged(self) -> bool:
        return self.action != "reject"


def judge_exchange(distances: Sequence[np.ndarray], limits: ExchangeLimits, *, cfg: RobustConfig) -> ExchangeVerdict:
    """The verdict on an exchange whose per-entry distances from the centre are `distances` (float64)."""
    def reject(why: Rejection, reason: str, ratio: float = math.inf) -> ExchangeVerdict:
        return ExchangeVerdict("reject", ratio, (), reason, why)

    sq = sum(float(np.add.reduce(d * d)) for d in distances)
    peak = max((float(np.max(np.abs(d))) for d in distances if d.size), default=0.0)
    norm = math.sqrt(sq)
    if not (math.isfinite(norm) and math.isfinite(peak)):
        return reject(Rejection.NONFINITE, "its distance from the global model is not finite")
    if not cfg.enabled:
        return ExchangeVerdict("accept", 0.0, None, None)
    by_value = peak / limits.radius if limits.radius > 0 and cfg.element_factor > 0 else 0.0
    by_norm = norm / limits.norm if limits.norm else 0.0
    ratio = max(by_value, by_norm)
    if by_value > cfg.reject_factor:
        return reject(Rejection.BOUND, f"a value is {peak:.4g} from the global model, {by_value:.1f}x what {limits.span:g} "
                                       f"local AdamW steps move one element (limit {cfg.reject_factor:g}x)", ratio)
    if by_norm > cfg.reject_factor:
        return reject(Rejection.BOUND, f"its distance from the global model, {norm:.4g}, is {by_norm:.1f}x what "
                                       f"{limits.span:g} local steps of the coordinator's own reference round move "
                                       f"(limit {cfg.reject_factor:g}x)", ratio)
    if ratio <= 1.0:
        return ExchangeVerdict("accept", ratio, None, None)
    clipped = [np.clip(d, -limits.radius, limits.radius) if by_value > 1.0 else d for d in distances]
    clipped_norm = math.sqrt(sum(float(np.add.reduce(d * d)) for d in clipped))
    if limits.norm and clipped_norm > limits.norm:
        clipped = [d * (limits.norm / clipped_norm) for d in clipped]
    return ExchangeVerdict("clip", ratio, tuple(clipped),
                           f"clipped: {ratio:.2f}x what {limits.span:g} local steps move")


def counts_against(history: Norms, worker: str, *, cfg: RobustConfig) -> bool:
    """Whether a refused exchange counts against its worker's standing: unless the other workers' recent
    exchanges (each worker's own median ratio, then their median) were beyond their limits too, in which
    case the global model, not this worker, is the outlier. With no peer known it counts."""
    others = Norms({w: v for w, v in history.by_worker.items() if w != worker})
    median, n = others.median()
    return n == 0 or median <= 1.0


def remember(history: Norms, worker: str, verdict: ExchangeVerdict, *, cfg: RobustConfig) -> None:
    """Keep a folded exchange's ratio for counts_against (the folded ones only: a replay after a restart
    sees those, and so keeps the same history)."""
    if math.isfinite(verdict.ratio):
        history.add(worker, verdict.ratio, cfg)


# -- the descent guard: an exchange may not raise the coordinator's own loss, to first order ------------

GUARD_BUDGET = 0.002  # of the loss: the most an exchange's centre step may add to it, by its gradient
GUARD_SEQUENCES = 16  # sequences of the coordinator's own training tokens the gradient is taken on


def descent_gradient(model: torch.nn.Module, tokens: torch.Tensor, *, context: int) -> tuple[float, torch.Tensor]:
    """(loss, its gradient as one flat fp32 vector in the parameters' order) of `model` on the first
    GUARD_SEQUENCES windows of `tokens`: the coordinator's own measure of what raises the loss."""
    n = min(GUARD_SEQUENCES, (tokens.numel() - 1) // context)
    if n < 1:
        raise ValueError(f"{tokens.numel()} tokens are shorter than one context window")
    window = tokens[: n * context + 1].long()
    x = window[:-1].reshape(n, context)  # (n, T)
    y = window[1:].reshape(n, context)
    model.zero_grad(set_to_none=True)
    was_training = model.training
    model.eval()
    _, loss = model(x, y)
    loss.backward()
    model.train(was_training)
    grad = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).float()
                      for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    return float(loss.detach()), grad


def guard_scale(predicted: float, loss: float, *, budget: float = GUARD_BUDGET) -> float:
    """The factor a centre step is scaled by so that its predicted loss increase (gradient . step)
    stays within `budget` of the loss; 1 for a step that does not raise it (or raises it less)."""
    allowed = budget * loss
    if not (predicted > allowed and math.isfinite(predicted)) or allowed <= 0:
        return 1.0
    return allowed / predicted
