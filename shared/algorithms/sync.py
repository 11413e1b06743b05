"""Incremental model downloads: the change between two versions, int8-quantised.

A worker that holds version a of the model and is leased version b downloads
    update(a -> b) = quantise_int8(params_b - params_a)      (one dense delta envelope)
instead of the whole snapshot of b, about 4x smaller before zstd and smaller still after it.
Applying it gives params_b up to int8 rounding (at most max|change| / 254 per block of 256).

The rounding does not leak into what the worker sends back: its pseudo-gradient is measured
from the base it actually trained from (base - local), so only the point where it computes
gradients moves, by a hair. Rounding does add up over a chain of updates, so a worker takes a
full snapshot again after MAX_HOPS updates in a row (worker/loop.py).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from shared import codec
from shared.algorithms.compress import VALUE_KINDS

MAX_HOPS = 8  # updates applied in a row before a worker re-syncs from a full snapshot


def model_update(old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor], *, from_version: int,
                 values: str = "int8") -> codec.Delta:
    """new - old for every tensor, as a dense delta (base_version = the version it applies to)."""
    if set(old) != set(new):
        raise ValueError("the two versions hold different tensors")
    entries = []
    for name in sorted(new):
        diff = (new[name].detach().to(torch.float32) - old[name].detach().to(torch.float32)).reshape(-1)
        entries.append(codec.Entry(name, diff.numel(), codec.IndexKind.DENSE, VALUE_KINDS[values],
                                   diff.numpy().copy()))
    return codec.Delta(base_version=from_version, entries=tuple(entries))


def apply_update(params: Mapping[str, torch.Tensor], update: codec.Delta) -> None:
    """params += update, in place (params must be the version the update starts from)."""
    with torch.no_grad():
        for e in update.entries:
            flat = params[e.name].view(-1)
            flat.add_(torch.from_numpy(e.values).to(flat.device, flat.dtype))
