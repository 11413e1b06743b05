"""Sparse elastic averaging (SPARTA with a central replica): every few local steps a worker
swaps a random fraction p of its parameters with the global model, and neither waits.

For the indices idx of one exchange (drawn from a seed both sides know, so they never travel):
    d        = alpha * (w[idx] - c[idx])     the worker's values w against the centre c
    c[idx]  += d                             the coordinator pulls the centre toward the worker
    w[idx]  -= d                             the worker, whenever the answer arrives, is pulled back
With alpha = 0.5 both end at the pair's average, which is SPARTA's pairwise averaging with the
centre as every worker's partner. The worker sends w[idx] (k values + a seed); the answer is d.
Because the worker subtracts d instead of overwriting, local steps taken while the request was
in flight are kept: training never blocks on the network.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

from shared import codec
from shared.algorithms.compress import VALUE_KINDS, k_for, tensor_seed


def exchange_seed(lease_seed: int, step: int) -> int:
    """The seed of the exchange after local step `step` of a lease (63-bit)."""
    return tensor_seed(lease_seed, f"sparta/{step}") >> 1


def exchange_bound(schema: Mapping[str, tuple[int, ...]], *, p: float, values: str) -> int:
    """The most bytes one exchange's body (select's, or the coordinator's answer) can take on the wire."""
    return codec.encoded_bound([(name, codec.IndexKind.SEEDED, VALUE_KINDS[values], math.prod(shape),
                                 k_for(math.prod(shape), p)) for name, shape in schema.items()])


def select(params: Mapping[str, torch.Tensor], *, p: float, seed: int, values: str,
           base_version: int = 0) -> codec.Delta:
    """The worker's side: its current values at the exchange's seeded indices."""
    entries = []
    for name, t in params.items():
        flat = t.detach().reshape(-1)
        numel = flat.numel()
        s = tensor_seed(seed, name)
        idx = codec.seeded_indices(s, numel, k_for(numel, p))
        # Gather on the tensor's own device: only the k values travel to the CPU, never the tensor.
        picked = flat[torch.from_numpy(idx).to(flat.device)].to("cpu", torch.float32)
        entries.append(codec.Entry(name, numel, codec.IndexKind.SEEDED, VALUE_KINDS[values],
                                   picked.numpy(), idx, s))
    return codec.Delta(base_version=base_version, entries=tuple(entries))


def mix_into_centre(centre: Mapping[str, torch.Tensor], sent: codec.Delta, *, alpha: float,
                    values: str) -> codec.Delta:
    """The coordinator's side: pull the centre toward the sent values (in place); returns the
    correction d for the worker, on the same seeded indices."""

    def at(e: codec.Entry) -> torch.Tensor:
        return centre[e.name].view(-1)[torch.from_numpy(e.indices)]

    def add(e: codec.Entry, d: torch.Tensor) -> None:
        centre[e.name].view(-1).index_add_(0, torch.from_numpy(e.indices), d)

    return mix(at, add, sent, alpha=alpha, values=values)


def mix(at: Callable[[codec.Entry], torch.Tensor], add: Callable[[codec.Entry, torch.Tensor], None],
        sent: codec.Delta, *, alpha: float, values: str) -> codec.Delta:
    """mix_into_centre over any storage of the centre: at(entry) reads its values at the entry's
    indices, add(entry, d) adds d there (the coordinator keeps its centre as one flat vector)."""
    out = []
    with torch.no_grad():
        for e in sent.entries:
            d = alpha * (torch.from_numpy(np.asarray(e.values, dtype=np.float32)) - at(e))
            add(e, d)
            out.append(codec.Entry(e.name, e.numel, codec.IndexKind.SEEDED, VALUE_KINDS[values],
                                   d.numpy(), e.indices, e.seed))
    return codec.Delta(base_version=sent.base_version, entries=tuple(out))


def apply_correction(params: Mapping[str, torch.Tensor], correction: codec.Delta) -> None:
    """The worker's side, when the answer arrives: w[idx] -= d (in place, on any device)."""
    with torch.no_grad():
        for e in correction.entries:
            w = params[e.name]
            flat = w.view(-1)
            idx = torch.from_numpy(e.indices).to(w.device)
            flat.index_add_(0, idx, torch.from_numpy(np.asarray(e.values, dtype=np.float32)).to(w.device),
                            alpha=-1.0)


def mix_clipped(at: Callable[[codec.Entry], torch.Tensor], add: Callable[[codec.Entry, torch.Tensor], None],
                sent: codec.Delta, *, clipped: Sequence[np.ndarray] | None, alpha: float, scale: float,
                values: str) -> codec.Delta:
    """mix with the centre's step bounded (shared/algorithms/exchange_screen.py): the worker's correction
    is alpha * (w - c) as in mix; the centre moves by `scale` times it (clipped None: the distance as
    sent; at scale 1 that is mix exactly), or by alpha * scale * clipped (per entry, the distance the
    screen let through), or not at all (clipped empty)."""
    out = []
    with torch.no_grad():
        for i, e in enumerate(sent.entries):
            d = alpha * (torch.from_numpy(np.asarray(e.values, dtype=np.float32)) - at(e))
            if clipped is None:
                add(e, d if scale == 1.0 else d * scale)
            elif clipped:
                add(e, torch.from_numpy(np.asarray(alpha * scale * clipped[i], dtype=np.float32)))
            out.append(codec.Entry(e.name, e.numel, codec.IndexKind.SEEDED, VALUE_KINDS[values],
                                   d.numpy(), e.indices, e.seed))
    return codec.Delta(base_version=sent.base_version, entries=tuple(out))
