"""Data-parallel training with compressed gradients for `bench wallclock`: N workers, one model, each
step every worker's gradient of its own rows compressed with error feedback, the decompressed mean
applied by one AdamW (what every worker would apply alike).

The step draws the combined batch from one generator and splits it in N rows of workers, so with no
compression this is bench/sim.py's ddp, up to float rounding. Compressors:
- int8: shared/algorithms/compress.py's dense int8 with error feedback (the delta codec's per-block
  scales), its encoded size counted by shared/codec; on a ring each hop's partial sum is re-rounded
  to int8, which this leaves out (it rounds once, per worker, as a parameter server would);
- powersgd: bench/powersgd.py, rank r, two fp32 all-reduces a step.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch

from bench.powersgd import PowerSGD
from bench.sim import Result, Setup
from shared import codec
from shared.algorithms.compress import compress_with_feedback, delta_to_tensors
from shared.algorithms.inner import forward_backward, make_optimizer, scheduled_lr
from shared.config import CompressionConfig
from shared.data import sample_batch
from shared.model import build_model, evaluate_loss, get_params, set_params

INT8 = CompressionConfig(index="dense", fraction=1.0, values="int8", error_feedback=True)


@dataclasses.dataclass(frozen=True)
class CompressedDdp:
    """What a compressed ddp run adds to its Result: the bytes one worker puts into the all-reduces
    of one step, how many all-reduces run in a row, and the compressor's own seconds per worker step
    (median over the steps, all workers' work divided by N)."""

    result: Result
    payload_bytes_per_step: int
    allreduces: int
    compress_s_per_step: float


class _Int8:
    allreduces = 1

    def __init__(self, shapes: dict[str, tuple[int, ...]], workers: int) -> None:
        self.shapes, self.residual = shapes, [{} for _ in range(workers)]
        self.bytes_per_step = 0

    def step(self, grads: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        sent = []
        for i, g in enumerate(grads):
            delta, self.residual[i] = compress_with_feedback(g, self.residual[i], INT8, base_version=0, round_seed=0)
            if i == 0:  # worker 0's envelope stands for every worker's (zstd in it makes them differ a little)
                self.bytes_per_step = len(codec.encode(delta))
            sent.append(delta_to_tensors(delta, self.shapes))
        return {n: torch.stack([s[n] for s in sent]).mean(0) for n in grads[0]}


def run_compressed_ddp(setup: Setup, name: str, *, compressor: str, rank: int = 4) -> CompressedDdp:
    """ddp over setup.workers workers whose gradients go through `compressor` (int8 | powersgd)."""
    t0 = time.perf_counter()
    model = build_model(setup.model, seed=setup.seed)
    inner = setup.inner
    opt = make_optimizer(model, inner)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    if compressor == "int8":
        comp: _Int8 | PowerSGD = _Int8(shapes, setup.workers)
    elif compressor == "powersgd":
        comp = PowerSGD(shapes, rank=rank, workers=setup.workers, seed=setup.seed)
    else:
        raise ValueError(f"unknown compressor {compressor!r}: int8 or powersgd")
    gen = torch.Generator().manual_seed(setup.seed)
    evaluate = build_model(setup.model)
    steps = setup.steps_per_worker
    every = max(1, steps // setup.eval_points)
    tokens_per_step = setup.workers * setup.tokens_per_step
    curve = [(0, _eval(evaluate, get_params(model), setup))]
    compress_s: list[float] = []
    model.train()
    for step in range(steps):
        # the lr of the steps up to the next evaluation is the schedule's at their first, as sim.run_ddp sets it
        chunk_start = step - step % every
        lr = scheduled_lr(inner, tokens_done=chunk_start * tokens_per_step,
                          schedule_tokens=setup.total_steps * setup.tokens_per_step)
        ramp = min(1.0, (step + 1) / inner.warmup_steps) if inner.warmup_steps else 1.0
        for group in opt.param_groups:
            group["lr"] = lr * ramp
        x, y = sample_batch(setup.train, batch_size=inner.batch_size * setup.workers, context=setup.model.context,
                            generator=gen)
        grads = []
        for rows in range(0, x.size(0), inner.batch_size):
            opt.zero_grad(set_to_none=True)
            forward_backward(model, x[rows:rows + inner.batch_size], y[rows:rows + inner.batch_size],
                             device=torch.device("cpu"))
            grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        c0 = time.perf_counter()
        mean = comp.step(grads)
        compress_s.append((time.perf_counter() - c0) / setup.workers)
        for n, p in model.named_parameters():
            p.grad = mean[n]
        if inner.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), inner.grad_clip)
        opt.step()
        if (step + 1) % every == 0 or step + 1 == steps:
            curve.append(((step + 1) * tokens_per_step, _eval(evaluate, get_params(model), setup)))
    payload = comp.bytes_per_step
    ring = 2 * (setup.workers - 1) / setup.workers * payload * steps
    result = Result(name, curve, curve[-1][1], ring, ring, time.perf_counter() - t0)
    return CompressedDdp(result, payload, comp.allreduces, statistics.median(compress_s))


def _eval(model: torch.nn.Module, params: dict[str, torch.Tensor], setup: Setup) -> float:
    set_params(model, params)
    return evaluate_loss(model, setup.eval, context=setup.model.context)


__all__ = ["CompressedDdp", "INT8", "run_compressed_ddp"]
