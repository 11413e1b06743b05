"""A worker's local round: H AdamW steps from the snapshot, then the pseudo-gradient."""

from __future__ import annotations

import math
from collections.abc import Mapping

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


def run_steps(model: torch.nn.Module, opt: torch.optim.Optimizer, tokens: torch.Tensor, cfg: InnerConfig, *,
              lr: float, steps: int, generator: torch.Generator, step_offset: int = 0,
              on_step=None) -> list[float]:
    """`steps` AdamW steps on random windows of `tokens`; returns the training losses.

    step_offset counts this worker's earlier steps, so warm-up happens once per worker, not per round.
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
        _, loss = model(x.to(device), y.to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        losses.append(loss.item())
        if on_step is not None:
            on_step(i + 1, losses[-1])
    return losses


def pseudo_gradient(base: Mapping[str, torch.Tensor], local: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """base - local: the direction the outer step moves against (DiLoCo's outer gradient)."""
    return {n: base[n] - local[n].detach().to("cpu", torch.float32) for n in base}
