"""Turn a dense pseudo-gradient into a sparse, quantised Delta, with error feedback.

With error feedback the worker adds last round's residual, decayed, before selecting, and keeps
whatever did not travel (unselected elements and quantisation error) for the next round, so
   sent + new_residual == pseudo_gradient + decay * old_residual   (up to float rounding)
with decay = CompressionConfig.feedback_decay: 1 keeps everything; below 1 (SparseLoCo) the
residual is a decaying sum of past pseudo-gradients, standing in for the outer momentum.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from shared.codec import Delta, Entry, IndexKind, ValueKind, seeded_indices
from shared.codec import encoded_bound
from shared.codec.values import VALUE_CODECS
from shared.config import CompressionConfig

VALUE_KINDS = {"fp32": ValueKind.FP32, "fp16": ValueKind.FP16, "int8": ValueKind.INT8, "int4": ValueKind.INT4,
               "int2": ValueKind.INT2, "int1": ValueKind.INT1}
VALUE_BITS = {ValueKind.FP32: 32, ValueKind.FP16: 16, ValueKind.INT8: 8, ValueKind.INT4: 4, ValueKind.INT2: 2,
              ValueKind.INT1: 1}
assert set(VALUE_BITS) == set(ValueKind), "every ValueKind needs its width"


def tensor_seed(round_seed: int, name: str) -> int:
    """A per-tensor 64-bit seed, so tensors of equal size do not share an index set."""
    digest = hashlib.blake2b(f"{round_seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def k_for(numel: int, fraction: float) -> int:
    """ceil(numel * fraction), within 1..numel. The tiny relative shave keeps float noise from
    rounding an exact product up (100 * 0.07 is 7.000000000000001 in binary floating point)."""
    return max(1, min(numel, math.ceil(numel * fraction * (1 - 1e-12))))


def compress(tensors: Mapping[str, torch.Tensor], cfg: CompressionConfig, *, base_version: int,
             round_seed: int) -> Delta:
    """Select and quantise; returns the Delta as it will travel (before encoding)."""
    value_kind = VALUE_KINDS[cfg.values]
    entries = []
    for name, t in tensors.items():
        flat = t.detach().reshape(-1).to(torch.float32).cpu().numpy()
        numel = flat.size
        if cfg.index == "dense":
            entries.append(Entry(name, numel, IndexKind.DENSE, value_kind, flat.copy()))
            continue
        k = k_for(numel, cfg.fraction)
        if cfg.index == "random":
            seed = tensor_seed(round_seed, name)
            idx = seeded_indices(seed, numel, k)
            entries.append(Entry(name, numel, IndexKind.SEEDED, value_kind, flat[idx], idx, seed))
        else:  # topk by magnitude; ties broken by torch's order, indices then sorted
            idx = torch.topk(torch.from_numpy(np.abs(flat)), k, sorted=False).indices.numpy()
            idx = np.sort(idx).astype(np.int64)
            entries.append(Entry(name, numel, IndexKind.PACKED, value_kind, flat[idx], idx))
    return Delta(base_version=base_version, entries=tuple(entries))


INDEX_KINDS = {"dense": IndexKind.DENSE, "random": IndexKind.SEEDED, "topk": IndexKind.PACKED}


def shape_mismatch(entries: Sequence[tuple[str, IndexKind, ValueKind, int, int, int | None]],
                   schema: Mapping[str, tuple[int, ...]], cfg: CompressionConfig, *, round_seed: int) -> str | None:
    """Why a delta's entries are not what `compress` makes of a whole model under `cfg` (None when
    they are). `entries`: (name, index kind, value kind, numel, k, seed or None) of each, as
    codec.check_flat reports them. `compress` sends every tensor once; dense: all its values;
    topk: k_for(numel, fraction) packed indices of the sender's choice; random: the same k at the
    seeded indices of tensor_seed(round_seed, name), whose seed only the lease knows. Values are
    of cfg.values or a wider kind (fp32 > fp16 > int8 > int4 > int2): a wider one costs its sender
    bytes and changes nothing else; a narrower one would save them at the run's expense. Without
    this, one value of 1e-7 in a 71-byte delta was a round's work, and earned its credit."""
    names = [e[0] for e in entries]
    sent = set(names)
    missing = [n for n in schema if n not in sent]
    if missing:
        return (f"a round's delta carries every tensor of the model ({len(schema)}); this one has {len(names)}, "
                f"missing {missing[:3]}{' ...' if len(missing) > 3 else ''}")
    want_kind, want_bits = INDEX_KINDS[cfg.index], VALUE_BITS[VALUE_KINDS[cfg.values]]
    for name, index_kind, value_kind, numel, k, seed in entries:
        want_k = numel if cfg.index == "dense" else k_for(numel, cfg.fraction)
        if VALUE_BITS[ValueKind(value_kind)] < want_bits:
            return (f"{name}: {ValueKind(value_kind).name.lower()} values, narrower than the run's compression "
                    f"values {cfg.values!r}: send {cfg.values!r} or a wider kind")
        if index_kind != want_kind:
            return (f"{name}: {index_kind.name.lower()} indices, but the run's compression {cfg.index!r} sends "
                    f"{want_kind.name.lower()} ones")
        if k != want_k:
            return (f"{name}: {k} values, but the run's compression ({cfg.index}, fraction {cfg.fraction:g}) "
                    f"sends {want_k}")
        if index_kind == IndexKind.SEEDED and seed != tensor_seed(round_seed, name):
            return f"{name}: its indices are not the ones this lease's seed draws (random compression)"
    return None


def quantised(delta: Delta) -> Delta:
    """The same delta with its values passed through their value codec (what the receiver sees)."""
    out = []
    for e in delta.entries:
        codec = VALUE_CODECS[e.value_kind]
        values, _ = codec.decode(memoryview(codec.encode(e.values)), e.k)
        out.append(Entry(e.name, e.numel, e.index_kind, e.value_kind, values, e.indices, e.seed))
    return Delta(base_version=delta.base_version, entries=tuple(out))


def compress_with_feedback(pseudo_grad: Mapping[str, torch.Tensor], residual: Mapping[str, torch.Tensor] | None,
                           cfg: CompressionConfig, *, base_version: int, round_seed: int,
                           ) -> tuple[Delta, dict[str, torch.Tensor]]:
    """(delta to send, residual to keep). Without error feedback the residual is empty."""
    if cfg.error_feedback and residual:
        target = {n: pseudo_grad[n] + cfg.feedback_decay * residual[n] for n in pseudo_grad}  # 1.0 * r is r, exactly
    else:
        target = dict(pseudo_grad)
    delta = quantised(compress(target, cfg, base_version=base_version, round_seed=round_seed))
    if not cfg.error_feedback:
        return delta, {}
    sent = delta_to_tensors(delta, {n: tuple(t.shape) for n, t in target.items()})
    return delta, {n: target[n] - sent[n] for n in target}


def delta_to_tensors(delta: Delta, schema: Mapping[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    return {n: torch.from_numpy(a) for n, a in delta.to_dense(schema).items()}


def round_bound(schema: Mapping[str, tuple[int, ...]], cfg: CompressionConfig) -> int:
    """The most bytes a round's delta under `cfg` can take on the wire, for a model of this schema."""
    index_kind = INDEX_KINDS[cfg.index]
    entries = [(name, index_kind, VALUE_KINDS[cfg.values], math.prod(shape),
                math.prod(shape) if index_kind is IndexKind.DENSE else k_for(math.prod(shape), cfg.fraction))
               for name, shape in schema.items()]
    return encoded_bound(entries)
