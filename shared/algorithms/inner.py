"""A worker's local round: H AdamW steps from the snapshot, then the pseudo-gradient."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from typing import Protocol

import torch

from shared.algorithms.group_adamw import GroupAdamW
from shared.config import InnerConfig
from shared.data import sample_batch


def scheduled_lr(cfg: InnerConfig, *, tokens_done: int, schedule_tokens: int) -> float:
    """Cosine decay of the peak lr over the run's token budget, down to min_lr_ratio * lr."""
    progress = min(1.0, max(0.0, tokens_done / schedule_tokens))
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + 0.5 * (cfg.lr - floor) * (1.0 + math.cos(math.pi * progress))


def make_optimizer(model: torch.nn.Module, cfg: InnerConfig) -> torch.optim.Optimizer:
    """AdamW (weight decay on matrices only), or with cfg.second_moment_workers > 1 the AdamW normalised
    for that many workers' combined batch (group_adamw.GroupAdamW)."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if cfg.second_moment_workers > 1:
        return GroupAdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), workers=cfg.second_moment_workers)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))


class GradSync(Protocol):
    """Data parallelism across processes for run_steps (worker/distributed.py implements it over
    torch.distributed): every process draws the step's whole batch from the same generator and
    trains its own rows of it; the gradients are averaged before clipping and the AdamW step."""

    def rows(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This process's rows of the step's whole batch."""

    def all_reduce(self, model: torch.nn.Module, loss: torch.Tensor) -> float:
        """After backward: every process's gradients become the whole batch's (the mean over all
        rows); returns the whole batch's loss."""

    def step_done(self, ok: bool) -> None:
        """After on_step: the lead process tells the others whether the round goes on (ok False:
        its on_step raised); a follower raises when it does not."""


def run_steps(model: torch.nn.Module, opt: torch.optim.Optimizer, tokens: torch.Tensor, cfg: InnerConfig, *,
              lr: float, steps: int, generator: torch.Generator, step_offset: int = 0,
              on_step=None, sync: GradSync | None = None, micro_batch: int | None = None,
              autocast: torch.dtype | None = None) -> list[float]:
    """`steps` AdamW steps on random windows of `tokens`; returns the training losses.

    step_offset counts this worker's earlier steps, so warm-up happens once per worker, not per round.
    sync: train data-parallel with other processes (None: this process alone); the batch drawn is
    the same, so the steps equal this process training the whole batch alone, up to float rounding.
    micro_batch: rows per forward/backward pass (None: cfg.micro_batch_size, and without that the
    whole batch at once); the step is the same, up to float rounding (forward_backward).
    autocast: run forward passes under torch.autocast in this dtype (bf16); weights, gradients and
    AdamW's state stay fp32. None: no autocast.
    """
    micro_batch = micro_batch if micro_batch is not None else cfg.micro_batch_size
    context = model.cfg.context
    device = next(model.parameters()).device
    model.train()
    losses = []
    for i in range(steps):
        ramp = min(1.0, (step_offset + i + 1) / cfg.warmup_steps) if cfg.warmup_steps else 1.0
        for group in opt.param_groups:
            group["lr"] = lr * ramp
        x, y = sample_batch(tokens, batch_size=cfg.batch_size, context=context, generator=generator)
        if sync is not None:
            x, y = sync.rows(x, y)
        opt.zero_grad(set_to_none=True)
        loss = forward_backward(model, x, y, device=device, micro_batch=micro_batch, autocast=autocast)
        value = loss.item() if sync is None else sync.all_reduce(model, loss)
        if cfg.grad_clip:  # after the all-reduce: the whole batch's gradient is clipped, on every process alike
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        losses.append(value)
        if sync is None:
            if on_step is not None:
                on_step(i + 1, value)
            continue
        try:
            if on_step is not None:
                on_step(i + 1, value)
        except BaseException:
            sync.step_done(False)
            raise
        sync.step_done(True)
    return losses


def autocast_context(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """torch.autocast on `device` in `dtype`, or nothing when dtype is None."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def forward_backward(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, *, device: torch.device,
                     micro_batch: int | None = None, autocast: torch.dtype | None = None) -> torch.Tensor:
    """Forward and backward of the batch (x, y); returns its mean loss, detached. The gradients are
    added to the parameters' .grad.

    With micro_batch below the batch's rows, the rows go through in slices of micro_batch, each
    slice's mean loss scaled by its share of the rows before its backward: every row has the same
    number of targets, so the gradients summed are the whole batch's mean-loss gradient, only the
    order of the additions differs. Only one slice's activations are alive at a time."""
    n = x.size(0)
    if micro_batch is None or micro_batch >= n:  # the whole batch at once
        with autocast_context(device, autocast):
            _, loss = model(x.to(device), y.to(device))
        loss.backward()
        return loss.detach()
    total = torch.zeros((), device=device)
    for start in range(0, n, micro_batch):
        xs, ys = x[start:start + micro_batch], y[start:start + micro_batch]
        with autocast_context(device, autocast):
            _, loss = model(xs.to(device), ys.to(device))
        scaled = loss.float() * (xs.size(0) / n)
        scaled.backward()
        total += scaled.detach()
    return total


def pseudo_gradient(base: Mapping[str, torch.Tensor], local: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """base - local: the direction the outer step moves against (DiLoCo's outer gradient)."""
    return {n: base[n] - local[n].detach().to("cpu", torch.float32) for n in base}
