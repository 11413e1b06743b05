"""What the robust screen measures of a delta (shared/algorithms/robust.py decides on it).

Why the agreement: a random direction has cosine ~0 +- 1/sqrt(k) on k values, but so can an honest top-k
delta: with error feedback a worker sends mostly values its earlier rounds left out, so early in a run
its support barely meets the momentum's. Measured in process with the coordinator's merge (2 workers as
the loopback tests run them: 1 layer, d_model 32, H=10, top-k 10% int8, outer momentum 0.2 or Nesterov
0.9; 720 deltas of 72 runs, random timings): the third delta of the worker whose two made the first
momentum step met m on 16 of its 2209 values, cosine 0.999 there but 0.054 on its support, at 0.85x the
reference; its agreement is 0.25, and no delta of the first 8 scored below 0.23. With Z = 3 a random
direction's agreement reaches min_agreement with probability < 0.13% (one-sided): 0 of 14,400 random-sign
draws on honest deltas' supports and magnitudes passed, 1.7% by the cosine. 4 honest deltas (ninth of a
run, 3 versions stale, 1.04-1.27x the reference) point across m where they meet it (z = v.m / sqrt(sum
v_i^2 m_i^2) from -1.7 to 1.7): refused by either. Dense int4 deltas score z >= 76: it changes nothing. A
delta that copies m where it is nonzero and is random elsewhere passes it, as it passes a cosine of 0.05
and as one whose support misses m's always has: the norm bounds and the ramp bound it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import NamedTuple

import numpy as np
import torch

from shared.codec import Delta, FlatDelta

# A large delta whose cosine falls short must agree where the momentum speaks by this many standard
# deviations of a random direction's score there, beyond min_agreement (module docstring: measured)
AGREEMENT_Z = 3.0


class Direction(NamedTuple):  # a delta's norm, and where it points against the consensus (module docstring)
    norm: float
    cosine: float | None  # on the delta's support; None without a consensus there
    agreement: float | None  # where the consensus is nonzero, less AGREEMENT_Z random-direction sds


def _direction(pairs) -> Direction:
    """Direction from (values, consensus at them or None) float64 pairs. Sums are numpy's pairwise
    float64 sums (no BLAS: the same bits whatever the machine's thread count)."""
    sq = dot = ref_sq = ov_sq = var = 0.0
    compared = False
    for v, r in pairs:
        v2 = v * v
        sq += float(np.add.reduce(v2))
        if r is None:
            continue
        compared, vr = True, v * r
        dot += float(np.add.reduce(vr))
        ref_sq += float(np.add.reduce(r * r))
        ov_sq += float(np.add.reduce(v2, where=r != 0))
        var += float(np.add.reduce(vr * vr))
    norm = math.sqrt(sq)
    if not compared or ref_sq == 0.0 or norm == 0.0:
        return Direction(norm, None, None)
    agreement = (dot - AGREEMENT_Z * math.sqrt(var)) / math.sqrt(ov_sq * ref_sq) if ov_sq > 0 else None
    return Direction(norm, dot / (norm * math.sqrt(ref_sq)), agreement)


def delta_direction(delta: Delta, reference: Mapping[str, torch.Tensor] | None) -> Direction:
    """The delta's norm, cosine and agreement with `reference` on the delta's support (O(k): never
    the whole tensor for a sparse entry)."""
    def pairs():
        for e in delta.entries:
            v = np.asarray(e.values, dtype=np.float64)
            r = None if reference is None else reference[e.name].reshape(-1).numpy()
            yield v, None if r is None else (r if e.indices is None else r[e.indices]).astype(np.float64)
    return _direction(pairs())


def flat_delta_direction(delta: FlatDelta, reference: torch.Tensor | None) -> Direction:
    """delta_direction for a FlatDelta against a flat reference vector, in one gather for all tensors.

    Any positive multiple of the reference gives the same cosine and agreement, so the coordinator
    passes its momentum's unscaled form (FlatOuter.m, m = s M)."""
    def pairs():
        v = np.asarray(delta.values, dtype=np.float64)
        if v.size:
            yield v, None if reference is None else torch.index_select(
                reference, 0, torch.from_numpy(delta.indices)).numpy().astype(np.float64)
        for off, dv in delta.dense:
            d = np.asarray(dv, dtype=np.float64)
            yield d, None if reference is None else reference[off:off + d.size].numpy().astype(np.float64)
    return _direction(pairs())


def delta_stats(delta: Delta, reference: Mapping[str, torch.Tensor] | None) -> tuple[float, float | None]:
    """(norm of the delta's values, cosine with `reference` on the delta's support or None)."""
    return tuple(delta_direction(delta, reference)[:2])


def flat_delta_stats(delta: FlatDelta, reference: torch.Tensor | None) -> tuple[float, float | None]:
    """delta_stats for a FlatDelta (flat_delta_direction)."""
    return tuple(flat_delta_direction(delta, reference)[:2])


def max_abs(delta: Delta) -> float:
    """The largest |value| a delta sends (0 for an empty one; nan if any value is nan)."""
    peaks = [float(np.max(np.abs(np.asarray(e.values, dtype=np.float64)))) for e in delta.entries if len(e.values)]
    return max(peaks, default=0.0) if not any(math.isnan(p) for p in peaks) else math.nan


def flat_max_abs(delta: FlatDelta) -> float:
    """max_abs for a FlatDelta."""
    parts = [np.asarray(delta.values, dtype=np.float64)] + [np.asarray(d, dtype=np.float64) for _, d in delta.dense]
    peaks = [float(np.max(np.abs(p))) for p in parts if p.size]
    return max(peaks, default=0.0) if not any(math.isnan(p) for p in peaks) else math.nan
