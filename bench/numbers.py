"""How the benchmarks round what they report: `sig` keeps significant digits, `pct` a percentile of
a sample, rounded alike (None for an empty one)."""

from __future__ import annotations

import numpy as np


def sig(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else float(f"{x:.{digits}g}")


def pct(xs: list[float], q: float) -> float | None:
    return sig(float(np.percentile(xs, q))) if xs else None
