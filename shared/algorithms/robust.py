"""Robust merging: screen each delta before the merge rule folds it in.

Volunteers' deltas are untrusted. Before a delta reaches `outer.apply_delta` the coordinator
compares it with what honest rounds have looked like recently:

    norm     = ||delta values||
    median   = the median norm of the last `window` merged deltas
    cosine   = cos(delta, m) on the delta's support, m = the outer momentum (the recent
               consensus direction; zero until the first momentum step)

    norm > bound_factor * H * lr * sqrt(n)  -> rejected: more than H AdamW steps of peak lr can
                                              move n parameters (Adam moves each by about lr per
                                              step at most), whatever the history says
    norm > reject_factor * median          -> rejected ("too large")
    cosine < min_cosine                    -> rejected ("points against the consensus")
    norm > clip_factor * median            -> merged, scaled down to clip_factor * median
    otherwise                              -> merged as sent

Until `min_history` norms are known only the bound applies, so even the first delta of a run
cannot blow the model up. The history is part of the run's checkpointed state, so a replay after a
restart takes exactly the same decisions.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from shared.codec import Delta, FlatDelta
from shared.config import RobustConfig


@dataclasses.dataclass(frozen=True)
class Verdict:
    action: str  # accept | clip | reject
    scale: float  # multiply the delta's values by this before merging (1 unless clipped)
    norm: float
    cosine: float | None  # None while there is no consensus direction yet
    reason: str | None

    @property
    def merged(self) -> bool:
        return self.action != "reject"


def delta_stats(delta: Delta, reference: Mapping[str, torch.Tensor] | None) -> tuple[float, float | None]:
    """(norm of the delta's values, cosine with `reference` on the delta's support or None)."""
    sq = dot = ref_sq = 0.0
    for e in delta.entries:
        v = np.asarray(e.values, dtype=np.float64)
        sq += float(v @ v)
        if reference is not None:
            r = reference[e.name].reshape(-1).numpy()
            if e.indices is not None:  # only the delta's support: O(k), never the whole tensor
                r = r[e.indices]
            r = r.astype(np.float64)
            dot += float(v @ r)
            ref_sq += float(r @ r)
    norm = math.sqrt(sq)
    if reference is None or ref_sq == 0.0 or norm == 0.0:
        return norm, None
    return norm, dot / (norm * math.sqrt(ref_sq))


def flat_delta_stats(delta: FlatDelta, reference: torch.Tensor | None) -> tuple[float, float | None]:
    """delta_stats for a FlatDelta against a flat reference vector, in one gather for all tensors.

    Any positive multiple of the reference gives the same cosine, so the coordinator passes its
    momentum's unscaled form (FlatOuter.m, m = s M). Sums are numpy's pairwise float64 sums (no
    BLAS: the same bits whatever the machine's thread count)."""
    v = np.asarray(delta.values, dtype=np.float64)
    sq = float(np.add.reduce(v * v))
    dot = ref_sq = 0.0
    if reference is not None and v.size:
        r = torch.index_select(reference, 0, torch.from_numpy(delta.indices)).numpy().astype(np.float64)
        dot, ref_sq = float(np.add.reduce(v * r)), float(np.add.reduce(r * r))
    for off, dv in delta.dense:
        d = np.asarray(dv, dtype=np.float64)
        sq += float(np.add.reduce(d * d))
        if reference is not None:
            r = reference[off:off + d.size].numpy().astype(np.float64)
            dot += float(np.add.reduce(d * r))
            ref_sq += float(np.add.reduce(r * r))
    norm = math.sqrt(sq)
    if reference is None or ref_sq == 0.0 or norm == 0.0:
        return norm, None
    return norm, dot / (norm * math.sqrt(ref_sq))


def adam_bound(*, steps: int, lr: float, n_params: int) -> float:
    """The norm H AdamW steps of lr move n parameters by when every element moves lr per step."""
    return steps * lr * math.sqrt(n_params)


def screen(delta: Delta, *, history: Sequence[float], reference: Mapping[str, torch.Tensor] | None,
           cfg: RobustConfig, bound: float | None = None) -> Verdict:
    """Decide what to do with one delta (pure: the caller records the outcome and the history).

    bound: adam_bound() of the run's round (None: no absolute bound)."""
    norm, cosine = delta_stats(delta, reference)
    return decide(norm, cosine, history=history, cfg=cfg, bound=bound)


def decide(norm: float, cosine: float | None, *, history: Sequence[float], cfg: RobustConfig,
           bound: float | None = None) -> Verdict:
    """screen's decision from a delta's (norm, cosine): see delta_stats / flat_delta_stats."""
    if not math.isfinite(norm):
        return Verdict("reject", 0.0, norm, cosine, "its norm is not finite")
    if cfg.enabled and bound is not None and cfg.bound_factor > 0 and norm > cfg.bound_factor * bound:
        return Verdict("reject", 0.0, norm, cosine,
                       f"norm {norm:.4g} is {norm / bound:.1f}x what a round of AdamW steps can move "
                       f"(limit {cfg.bound_factor:g}x)")
    if not cfg.enabled or len(history) < cfg.min_history or norm == 0.0:
        return Verdict("accept", 1.0, norm, cosine, None)
    median = float(np.median(np.asarray(history[-cfg.window:], dtype=np.float64)))
    if median > 0 and norm > cfg.reject_factor * median:
        return Verdict("reject", 0.0, norm, cosine,
                       f"norm {norm:.4g} is {norm / median:.1f}x the recent median {median:.4g} "
                       f"(limit {cfg.reject_factor:g}x)")
    if cosine is not None and cosine < cfg.min_cosine:
        return Verdict("reject", 0.0, norm, cosine,
                       f"points against the recent consensus (cosine {cosine:.3f} < {cfg.min_cosine:g})")
    if median > 0 and norm > cfg.clip_factor * median:
        scale = cfg.clip_factor * median / norm
        return Verdict("clip", scale, norm, cosine,
                       f"clipped: norm {norm:.4g} is {norm / median:.1f}x the recent median, scaled by {scale:.3f}")
    return Verdict("accept", 1.0, norm, cosine, None)


def remember(history: list[float], verdict: Verdict, cfg: RobustConfig) -> None:
    """Add a merged delta's norm to the history (rejected ones never shape what counts as normal)."""
    if verdict.merged and verdict.norm > 0:
        history.append(verdict.norm)
        del history[:-cfg.window]
