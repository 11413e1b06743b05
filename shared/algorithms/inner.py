"""A worker's local round: H AdamW steps from the snapshot, then the pseudo-gradient."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Protocol

import torch

from shared.config import InnerConfig
from shared.data import sample_batch


def scheduled_lr(cfg: InnerConfig, *, tokens_done: int, schedule_tokens: int) -> float:
    """Cosine decay of the peak lr over the run's token budget, down to min_lr_ratio * lr."""
    progress = min(1.0, max(0.0, tokens_done / schedule_tokens))
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + 0.5 * (cfg.lr - floor) * (1.0 + math.cos(math.pi * progress))


def make_optimizer(model: torch.nn.Module, cfg: InnerConfig) -> torch.optim.AdamW:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))


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
              on_step=None, sync: GradSync | None = None) -> list[float]:
    """`steps` AdamW steps on random windows of `tokens`; returns the training losses.

    step_offset counts this worker's earlier steps, so warm-up happens once per worker, not per round.
    sync: train data-parallel with other processes (None: this process alone); the batch drawn is
    the same, so the steps equal this process training the whole batch alone, up to float rounding.
    """
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
        _, loss = model(x.to(device), y.to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
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


def pseudo_gradient(base: Mapping[str, torch.Tensor], local: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """base - local: the direction the outer step moves against (DiLoCo's outer gradient)."""
    return {n: base[n] - local[n].detach().to("cpu", torch.float32) for n in base}
