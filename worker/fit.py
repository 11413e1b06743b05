"""How a round fits this machine: micro-batches, mixed precision and activation checkpointing.

These are the worker's choices (`worker run --micro-batch N --precision auto|fp32|bf16
--activation-checkpointing`); none changes what a round computes beyond float rounding, nor anything
that travels: weights, gradients, AdamW's state and the delta stay fp32.

- micro-batches: a step's batch goes through forward/backward in slices whose gradients add up to the
  whole batch's (shared/algorithms/inner.py's forward_backward); the worker picks the slice size from
  the run's `micro_batch_size`, its own cap and, when neither fits, its memory (worker/memory.py).
- precision: `auto` is bf16 autocast on CUDA and MPS where the device computes bf16, fp32 on CPU (the
  tested default, bit for bit what it was); `bf16` asks for autocast on any device, CPU included.
- activation checkpointing: each module of the model's `blocks` recomputes its activations in the
  backward pass instead of keeping them (torch.utils.checkpoint, non-reentrant).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import types
from typing import Literal

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from shared.config import InnerConfig
from shared.model import ModelConfig, meta_schema
from worker import memory

log = logging.getLogger(__name__)

Precision = Literal["auto", "fp32", "bf16"]


@dataclasses.dataclass(frozen=True)
class FitOptions:
    """The worker's settings for how a round fits (defaults: today's path, whole batches in fp32)."""

    precision: Precision = "auto"
    micro_batch: int | None = None  # the most rows per forward/backward pass (None: the run's choice)
    activation_checkpointing: bool = False
    max_params: int | None = None  # the worker's memory cap; micro-batches are picked to fit it (None: no check)


def bf16_supported(device: torch.device) -> bool:
    """Whether autocast in bf16 runs on `device` (CPU: always; CUDA: compute capability 8+ or
    emulation torch accepts; MPS: macOS 14+)."""
    if device.type == "cpu":
        return True
    try:
        if device.type == "cuda":
            return bool(torch.cuda.is_bf16_supported())
        if device.type == "mps":
            torch.ones(1, device=device, dtype=torch.bfloat16)  # raises where MPS has no bf16
            return True
    except (RuntimeError, TypeError, AssertionError):
        return False
    return False


def autocast_dtype(precision: Precision, device: torch.device) -> torch.dtype | None:
    """The autocast dtype for `precision` on `device`; None: plain fp32."""
    if precision == "fp32":
        return None
    if precision == "auto":
        return torch.bfloat16 if device.type in ("cuda", "mps") and bf16_supported(device) else None
    if precision == "bf16":
        if not bf16_supported(device):
            raise RuntimeError(f"--precision bf16 asked for, but this {device.type} device cannot compute bf16; "
                               "use --precision auto or fp32")
        return torch.bfloat16
    raise ValueError(f"precision must be auto, fp32 or bf16, not {precision!r}")


def _checkpointed_forward(self: nn.Module, *args, **kwargs):
    """A block's forward that keeps no activations for backward: they are recomputed then."""
    plain = type(self).forward
    if self.training and torch.is_grad_enabled():
        return checkpoint(plain, self, *args, use_reentrant=False, **kwargs)
    return plain(self, *args, **kwargs)


def checkpoint_blocks(model: nn.Module) -> int:
    """Turn on activation checkpointing for each module of `model.blocks` (an nn.ModuleList, as both
    the GPT and the Llama-style model have); returns how many blocks. The parameters, their names and
    the results are unchanged; doing it twice does nothing more."""
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList):
        raise ValueError(f"activation checkpointing wraps the model's `blocks` (an nn.ModuleList); "
                         f"{type(model).__name__} has none: train without --activation-checkpointing")
    for block in blocks:
        if not isinstance(block.__dict__.get("forward"), types.MethodType):
            block.forward = types.MethodType(_checkpointed_forward, block)  # survives copy.deepcopy
    return len(blocks)


def n_params(cfg: ModelConfig) -> int:
    """The model's parameter count, sized on the meta device (nothing allocated)."""
    return sum(math.prod(shape) for shape in meta_schema(cfg).values())


def pick_micro_batch(cfg: ModelConfig, inner: InnerConfig, *, cap: int | None = None,
                     max_params: int | None = None) -> int | None:
    """Rows per forward/backward pass for a step of `inner.batch_size` rows: the run's
    micro_batch_size and the worker's `cap`, whichever is smaller, and then as many rows as the
    worker's memory budget for `max_params` holds (worker/memory.py's estimate of a round). The
    passes are balanced (10 rows at most 4 per pass: 4, 3, 3 -> 4 rows; not 4, 4, 2). None: the
    whole batch at once."""
    batch = inner.batch_size
    rows = min([batch] + [x for x in (inner.micro_batch_size, cap) if x is not None])
    if max_params is not None and rows > 1:
        n, budget = n_params(cfg), memory.budget_bytes(max_params)

        def need(rows: int) -> int:
            return memory.round_bytes(n, cfg, batch_size=rows, group_adamw=inner.second_moment_workers > 1)

        if need(rows) > budget:
            lo, hi = 1, rows  # the largest row count that fits: round_bytes grows with the rows
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if need(mid) <= budget else (lo, mid - 1)
            rows = lo
    rows = math.ceil(batch / math.ceil(batch / rows))  # the same number of passes, evened out
    return None if rows >= batch else rows
