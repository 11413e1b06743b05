"""Robust merging: screen each delta (and each sparse exchange) before it reaches the model.

Volunteers' deltas are untrusted. Before a delta reaches `outer.apply_delta` the coordinator
compares it with what an honest round can look like and with what honest rounds have looked like:

    norm     = ||delta values||,  peak = max |value|
    median   = the median over recent workers of each worker's median norm (Norms: each worker
               counts once, so no single token sets what counts as normal)
    cosine   = cos(delta, m) on the delta's support, m = the outer momentum (the recent
               consensus direction); until the momentum has one, the coordinator's own reference
               round's pseudo-gradient
    agreement = the cosine on the overlap O (where m is nonzero) less AGREEMENT_Z times its spread
               for the delta's values with random signs: (v.m - Z sqrt(sum v_i^2 m_i^2)) / (|v_O| |m|)
    disagrees = cosine < min_agreement and agreement < min_agreement (or None)

  from the first delta on:
    peak > element_factor * H * lr (/ fraction)  -> rejected: Adam moves an element ~lr per step; sparse
                                                    compression keeps unsent values ~1/fraction rounds
    norm > bound_factor * H * lr * sqrt(n)       -> rejected (the same, for every element at once)
    norm > reference_factor * reference * scale  -> rejected: the coordinator's own round of AdamW steps
                                                    on the run's data, scaled up to H steps (reference_scale)
    norm == 0, or < min_norm_ratio / 10 * reference -> rejected ("idle"): no round's work, and no credit;
                                                    also with screening off (enabled = false)
    cosine < min_cosine                          -> rejected ("points against the consensus")
  while fewer than min_workers distinct workers (or min_history norms) are known:
    norm > EARLY_SHARE * reference and disagrees -> rejected: large and not along the consensus
                                                    (the reference stands in for the median)
  once min_workers distinct workers (and min_history norms) are known:
    norm < min_norm_ratio * median               -> rejected ("too small")
    norm > reject_factor * median                -> rejected ("too large")
    norm > median and disagrees                  -> rejected: large and not along the consensus
    norm > clip_factor * median                  -> merged, scaled down to clip_factor * median
    otherwise                                    -> merged as sent

What the cosine and the agreement measure, and why: robust_stats.py.

A worker's merge weight also ramps up with its record (ramp_weight): a new token's first deltas count
1/ramp, 2/ramp, ... of a full one. Sparse exchanges (sparta) are bounded by what their own lease can
have moved, then clipped and blended (exchange_screen.py). All of it (Norms, the ramp's counts, the
reference) is part of the run's checkpointed state, so a replay after a restart takes exactly the same
decisions.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from shared.algorithms.robust_stats import delta_direction, max_abs  # what a delta measures
from shared.codec import Delta
from shared.config import RobustConfig

PER_WORKER = 8  # norms of a worker's recent deltas (or exchanges) kept: its own median
# Before a median of workers exists, a delta above this share of the reference round's norm must agree
# with the consensus (the reference round's direction until the momentum has one)
EARLY_SHARE = 0.5
DISAGREES = "does not agree with the consensus"  # a direction refusal's reason begins so (coordinator/trust.py)


class Rejection(str, enum.Enum):
    """Why a delta was rejected, as a bounded label (the coordinator's metrics); `reason` says the rest.
    stale and unreadable are the coordinator's own (coordinator/runtime.py), the others the screen's."""

    STALE = "stale"
    UNREADABLE = "unreadable"
    NONFINITE = "nonfinite"
    BOUND = "bound"  # beyond what a round of AdamW steps (or the reference round) can move
    IDLE = "idle"  # moves the model by nothing, or next to nothing: no round's work, and no credit
    SMALL = "small"  # far below the recent median
    NORM = "norm"  # far above the recent median
    DIRECTION = "direction"  # against, or not along, the consensus
    OTHER = "other"


@dataclasses.dataclass(frozen=True)
class Verdict:
    action: str  # accept | clip | reject
    scale: float  # multiply the delta's values by this before merging (1 unless clipped)
    norm: float
    cosine: float | None  # None while there is no consensus direction yet
    reason: str | None
    rejection: Rejection | None = None  # set when rejected

    @property
    def merged(self) -> bool:
        return self.action != "reject"


def adam_bound(*, steps: int, lr: float, n_params: int) -> float:
    """The norm H AdamW steps of lr move n parameters by when every element moves lr per step."""
    return steps * lr * math.sqrt(n_params)


def reference_scale(*, fraction: float, feedback_decay: float = 1.0, random: bool = False) -> float:
    """The rounds' norm an honest delta carries at most where error feedback keeps what it leaves out (1:
    dense). A value kept p rounds carries c(p) = 1 + d + ... + d^(p-1) (d: feedback_decay); top-k sends
    each every ~1/fraction rounds (all pointing one way; equal magnitudes the worst): sqrt(fraction)
    c(1/fraction), 3.16 at 10%, 7.07 at 2%, 2.61 at 2% and d = 0.95; a random subset keeps one a geometric
    p: sqrt(fraction E[c(p)^2]). Measured in process (2 and 4 workers, 40-120 deltas, this bound off),
    honest deltas reached x the reference: top-k 10% int8 1.64 (a worker's 9th round; 4 workers 1.40), 2%
    int8 1.97 (38th), SparseLoCo (2% int2, d 0.95) 1.29 (49th); dense int4 0.86."""
    c2 = (_carried_squared_random if random else _carried_squared_topk)(fraction, feedback_decay)
    return max(1.0, math.sqrt(fraction * c2))


def _carried_squared_topk(f: float, d: float) -> float:
    """c(p)^2 at p = 1/f: top-k sends a value about every 1/f rounds."""
    c = 1.0 / f if d >= 1.0 else (1.0 - d ** (1.0 / f)) / (1.0 - d)
    return c * c


def _carried_squared_random(f: float, d: float) -> float:
    """E[c(p)^2] for p ~ Geometric(f): a random subset sends each value with probability f a round."""
    if d >= 1.0:
        return (2.0 - f) / f ** 2

    def moment(x: float) -> float:  # E[x^p]
        return f * x / (1.0 - (1.0 - f) * x)

    return (1.0 - 2.0 * moment(d) + moment(d * d)) / (1.0 - d) ** 2


def element_bound(*, steps: int, lr: float, fraction: float = 1.0) -> float:
    """How far one round of `steps` AdamW steps at `lr` moves one element, about: Adam's step is
    ~lr per element. A sparse round (a `fraction` of the elements sent, the rest kept by error
    feedback) may carry an element's last ~1/fraction rounds at once."""
    return steps * lr / fraction


class Norms:
    """Recent norms per worker, each worker's newest last, the most recently seen worker last; at
    most `window` workers and PER_WORKER norms each. The median counts each worker once (the
    median of the workers' own medians), so one token cannot set what counts as normal.

    Keys are strings (they travel as JSON in the checkpoint): a worker's id, or a pseudo-worker
    per delta where the worker is not known (each such norm then counts as its own worker)."""

    def __init__(self, by_worker: Mapping[str, Sequence[float]] | None = None) -> None:
        self.by_worker: dict[str, list[float]] = {k: list(v) for k, v in (by_worker or {}).items()}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Norms) and self.by_worker == other.by_worker

    def __repr__(self) -> str:
        return f"Norms({self.by_worker!r})"

    def copy(self) -> Norms:
        return Norms(self.by_worker)

    def __len__(self) -> int:
        return sum(len(v) for v in self.by_worker.values())

    def add(self, worker: str, norm: float, cfg: RobustConfig) -> None:
        norms = self.by_worker.pop(worker, [])
        norms.append(norm)
        self.by_worker[worker] = norms[-PER_WORKER:]
        while len(self.by_worker) > cfg.window:
            del self.by_worker[next(iter(self.by_worker))]

    def median(self) -> tuple[float, int]:
        """(the median over workers of each worker's median norm, how many workers); (0, 0) if none."""
        if not self.by_worker:
            return 0.0, 0
        own = [float(np.median(np.asarray(v, dtype=np.float64))) for v in self.by_worker.values()]
        return float(np.median(np.asarray(own, dtype=np.float64))), len(own)

    def to_json(self) -> list:
        return [[k, v] for k, v in self.by_worker.items()]  # a list: the order is the recency

    @classmethod
    def from_json(cls, raw: list) -> Norms:
        return cls({str(k): [float(x) for x in v] for k, v in raw})


def _as_norms(history: Sequence[float] | Norms, cfg: RobustConfig) -> Norms:
    """A plain list of norms (no workers known): each norm its own worker, the last `window` of them."""
    if isinstance(history, Norms):
        return history
    return Norms({f"#{i}": [float(x)] for i, x in enumerate(list(history)[-cfg.window:])})


def ramp_weight(merged: int, cfg: RobustConfig) -> float:
    """The share of a full merge weight a worker's next delta gets, after `merged` merged deltas."""
    if not cfg.enabled:
        return 1.0
    return min(1.0, (merged + 1) / cfg.ramp)


def screen(delta: Delta, *, history: Sequence[float] | Norms, reference: Mapping[str, torch.Tensor] | None,
           cfg: RobustConfig, bound: float | None = None, elements: float | None = None,
           reference_norm: float | None = None, reference_scale: float = 1.0) -> Verdict:
    """Decide what to do with one delta (pure: the caller records the outcome and the history).

    bound: adam_bound() of the run's round (None: none); elements: element_bound() of it (None: none);
    reference_norm: the coordinator's own reference round's norm; reference_scale: reference_scale()."""
    norm, cosine, agreement = delta_direction(delta, reference)
    return decide(norm, cosine, history=history, cfg=cfg, bound=bound, peak=max_abs(delta), elements=elements,
                  reference_norm=reference_norm, agreement=agreement, reference_scale=reference_scale)


def decide(norm: float, cosine: float | None, *, history: Sequence[float] | Norms, cfg: RobustConfig,
           bound: float | None = None, peak: float | None = None, elements: float | None = None,
           reference_norm: float | None = None, agreement: float | None = None,
           reference_scale: float = 1.0) -> Verdict:
    """screen's decision from a delta's (norm, cosine, agreement) and its largest |value| `peak`: see
    delta_direction / flat_delta_direction / max_abs. `history`: Norms, or a plain list of norms (each
    counted as its own worker)."""
    def reject(why: Rejection, reason: str) -> Verdict:
        return Verdict("reject", 0.0, norm, cosine, reason, why)

    def disagrees(above: str) -> Verdict | None:
        """Refused when neither its cosine nor its agreement reaches min_agreement (None: it agrees)."""
        if cosine is None or cosine >= cfg.min_agreement or (agreement is not None and agreement >= cfg.min_agreement):
            return None
        where = "" if agreement is None else f", {agreement:.3f} where the consensus is nonzero"
        return reject(Rejection.DIRECTION, f"{DISAGREES}: norm {norm:.4g} is {above} with "
                                           f"cosine {cosine:.3f}{where} (at least {cfg.min_agreement:g} needed)")

    if not math.isfinite(norm) or (peak is not None and not math.isfinite(peak)):
        return reject(Rejection.NONFINITE, "its norm is not finite")
    # with screening off too: a delta that moves nothing is no round's work, and must not earn its credit
    if norm == 0.0:
        return reject(Rejection.IDLE, "too small: all its values are zero; it moves nothing, which is no round's work")
    if reference_norm and norm < cfg.min_norm_ratio / 10 * reference_norm:
        return reject(Rejection.IDLE,
                      f"too small: norm {norm:.4g} is {norm / reference_norm:.2g}x the coordinator's own reference "
                      f"round; it moves next to nothing, which is no round's work (limit {cfg.min_norm_ratio / 10:g}x)")
    if not cfg.enabled:
        return Verdict("accept", 1.0, norm, cosine, None)
    if elements is not None and peak is not None and cfg.element_factor > 0 and peak > cfg.element_factor * elements:
        return reject(Rejection.BOUND,
                      f"a value of {peak:.4g} is {peak / elements:.1f}x what a round of AdamW steps moves one "
                      f"element by (limit {cfg.element_factor:g}x)")
    if bound is not None and cfg.bound_factor > 0 and norm > cfg.bound_factor * bound:
        return reject(Rejection.BOUND,
                      f"norm {norm:.4g} is {norm / bound:.1f}x what a round of AdamW steps can move "
                      f"(limit {cfg.bound_factor:g}x)")
    if reference_norm and cfg.reference_factor > 0 and norm > cfg.reference_factor * reference_scale * reference_norm:
        carried = "" if reference_scale == 1.0 else f" x {reference_scale:.3g} rounds a sparse delta can carry"
        return reject(Rejection.BOUND,
                      f"norm {norm:.4g} is {norm / reference_norm:.1f}x the coordinator's own reference round "
                      f"of AdamW steps (limit {cfg.reference_factor:g}x{carried})")
    if cosine is not None and cosine < cfg.min_cosine:
        return reject(Rejection.DIRECTION,
                      f"points against the recent consensus (cosine {cosine:.3f} < {cfg.min_cosine:g})")
    norms = _as_norms(history, cfg)
    median, n_workers = norms.median()
    if len(norms) < cfg.min_history or n_workers < cfg.min_workers or median <= 0:
        # No median yet: half the reference round (unscaled) stands in for it (honest dense rounds measured
        # up to 0.92x the reference), and a delta above it must agree with the consensus, as later the median.
        if reference_norm and norm > EARLY_SHARE * reference_norm and (refused := disagrees(
                f"{norm / reference_norm:.2f}x the coordinator's own reference round (above {EARLY_SHARE:g}x "
                f"while fewer than {cfg.min_workers} workers' norms are known)")):
            return refused
        return Verdict("accept", 1.0, norm, cosine, None)
    if norm < cfg.min_norm_ratio * median:
        return reject(Rejection.SMALL,
                      f"too small: norm {norm:.4g} is {norm / median:.2g}x the recent median {median:.4g} of "
                      f"{n_workers} workers, which is no round's work (limit {cfg.min_norm_ratio:g}x)")
    if norm > cfg.reject_factor * median:
        return reject(Rejection.NORM,
                      f"norm {norm:.4g} is {norm / median:.1f}x the recent median {median:.4g} of {n_workers} "
                      f"workers (limit {cfg.reject_factor:g}x)")
    if norm > median and (refused := disagrees(f"{norm / median:.1f}x the workers' median")):
        return refused
    if norm > cfg.clip_factor * median:
        scale = cfg.clip_factor * median / norm
        return Verdict("clip", scale, norm, cosine,
                       f"clipped: norm {norm:.4g} is {norm / median:.1f}x the recent median, scaled by {scale:.3f}")
    return Verdict("accept", 1.0, norm, cosine, None)


def remember(history: list[float] | Norms, verdict: Verdict, cfg: RobustConfig, *, worker: str | None = None) -> None:
    """Add a merged delta's norm to the history (rejected ones never shape what counts as normal).
    Norms need the worker's key (`worker`)."""
    if not (verdict.merged and verdict.norm > 0):
        return
    if isinstance(history, Norms):
        if worker is None:
            raise ValueError("remember() into Norms needs the worker")
        history.add(worker, verdict.norm, cfg)
        return
    history.append(verdict.norm)
    del history[:-cfg.window]
