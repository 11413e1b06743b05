"""Incremental model downloads: the change between two versions, int8-quantised; or, with the run's
update_feedback, the change from the worker's own copy.

A worker that holds version a of the model and is leased version b downloads
    update(a -> b) = quantise_int8(params_b - params_a)      (one dense delta envelope)
instead of the whole snapshot of b, about 4x smaller before zstd and smaller still after it.
Applying it gives params_b up to int8 rounding (at most max|change| / 254 per block of 256).

The rounding does not leak into what the worker sends back: its pseudo-gradient is measured
from the base it actually trained from (base - local), so only the point where it computes
gradients moves, by a hair. Rounding does add up over a chain of updates, so a worker takes a
full snapshot again after MAX_HOPS updates in a row (worker/downloads.py).

With update_feedback the update is taken from the copy the worker holds instead of from version a:
    update(copy -> b) = quantise(params_b - copy),    copy' = copy + update
so each update also carries the rounding of the one before (error feedback): the copy stays within
one update's rounding of the model however many updates it takes, and needs no snapshot again. That
is what makes int2 and int1 updates usable (int1 rounds a change by 0.6 of its size: without the
feedback that adds up over the hops; bench/sim.py, down="feedback"). The coordinator keeps the
copies it made, named by copy_digest (coordinator/services/downloads.py); both sides compute copy'
with the same float32 additions (apply_update on the decoded update), so the names agree.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch

from shared import codec
from shared.algorithms.compress import VALUE_KINDS

# Updates applied in a row before a worker re-syncs from a full snapshot. The full snapshot is the
# fp32 model, several times an int4 update, so this sets a good share of a worker's download. Chosen
# by measurement (2026-12-02, bench/sim.py on the convergence quick profile's model, 8 workers, the
# run defaults: int4 deltas up and updates down; paired seeds, final eval loss, 8 -> 32 or more):
#   H = 5, 32 rounds a worker (31 hops, no re-sync at 32):  2.5673 -> 2.5685, 2.5358 -> 2.5363;
#                                                            down 2.85 -> 1.67 MB, 2.83 -> 1.64 MB
#   H = 2, 80 rounds a worker:  32: 2.5343 -> 2.5335, down 7.38 -> 5.01 MB;
#                               64: 2.6484 -> 2.6508 (never re-syncing: 2.6513), down 7.41 -> 4.65 MB
# i.e. up to 79 hops cost at most 0.11% loss; 32 keeps within what was measured with margin.
MAX_HOPS = 32


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


def copy_digest(params: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 (hex) of a model copy: its tensors in name order, each as little-endian float32 bytes."""
    h = hashlib.sha256()
    for name in sorted(params):
        h.update(params[name].detach().to("cpu", torch.float32).contiguous().numpy().astype("<f4", copy=False).data)
    return h.hexdigest()


def feedback_update(copy: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor], *, from_version: int,
                    values: str, schema: Mapping[str, tuple[int, ...]]) -> tuple[bytes, dict[str, torch.Tensor]]:
    """(the encoded update new - copy, the copy it makes): the copy moved by the update as the worker
    will move it, from the same encoded bytes."""
    blob = codec.encode(model_update(copy, new, from_version=from_version, values=values))
    moved = {n: t.detach().to(torch.float32, copy=True) for n, t in copy.items()}
    apply_update(moved, codec.decode(blob, schema=schema))
    return blob, moved


def apply_update(params: Mapping[str, torch.Tensor], update: codec.Delta) -> None:
    """params += update, in place (params must be the version the update starts from)."""
    with torch.no_grad():
        for e in update.entries:
            flat = params[e.name].view(-1)
            flat.add_(torch.from_numpy(e.values).to(flat.device, flat.dtype))
