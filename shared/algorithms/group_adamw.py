"""AdamW normalised for the group's combined batch: the inner optimiser for long runs of many workers.

A worker's AdamW divides each step by the second moment of its own small batch's gradient. Where the
batch's noise dominates that second moment, one AdamW step on N workers' combined batch (ddp) is up
to sqrt(N) larger than each worker's, and averaging the N workers' steps does not give that back:
eight workers averaged after every single step capture a third of what ddp's 8x batch gains over one
worker (docs/BENCHMARKS.md, long probe). With the second moment of the combined batch instead, the
averaged steps are ddp's steps (the update is linear in the first moments).

No worker sees the combined batch, but each can estimate its second moment from its own consecutive
gradients g_t, g_{t-1}, two independent batches at nearly the same weights:

    signal = EMA(g_t * g_{t-1})            E = g^2, the squared mean gradient
    noise  = EMA((g_t - g_{t-1})^2) / 2    E = sigma^2 / B, one batch's variance
    v      = max(signal, 0) + noise / N    E = the second moment of N batches' mean gradient

both EMAs at `estimate_beta` (0.99) and bias-corrected as AdamW's. The first step (no pair yet) takes
plain AdamW's v = g^2. 0.99 and not AdamW's beta2 (0.95): max(signal, 0) of a short, noisy signal EMA
biases v upward, and over the long profile's 100 rounds 0.95 kept 25% of ddp's gain against 0.99's
34% (docs/BENCHMARKS.md); in its first 25 rounds 0.95 was the better, 22% against 18%.

For N = 1 `make_optimizer` returns torch's own AdamW. N should not exceed the workers whose deltas
are averaged into each outer step (OuterConfig.group; RunConfig refuses more): a larger N steps
further than ddp would. Memory: four tensors a parameter (the first moment, the two EMAs, the
last gradient), where AdamW keeps two. Weight decay is AdamW's (decoupled); `make_optimizer`
(inner.py) builds it from InnerConfig.second_moment_workers.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

ESTIMATE_BETA = 0.99  # the signal and noise EMAs (module docstring)


class GroupAdamW(torch.optim.Optimizer):
    """AdamW whose second moment is estimated for `workers` workers' combined batch (module docstring).
    Per parameter it keeps `step` (int), `exp_avg` (AdamW's first moment), `signal`, `noise` and
    `prev_grad`; betas[1] (AdamW's beta2) is not used."""

    def __init__(self, params: Iterable, *, lr: float, workers: int, betas: tuple[float, float] = (0.9, 0.95),
                 estimate_beta: float = ESTIMATE_BETA, weight_decay: float = 0.0, eps: float = 1e-8) -> None:
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        if not all(0.0 <= b < 1.0 for b in (*betas, estimate_beta)):
            raise ValueError(f"betas and estimate_beta must lie in [0, 1), got {betas} and {estimate_beta}")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "estimate_beta": estimate_beta,
                                  "weight_decay": weight_decay, "eps": eps, "workers": workers})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._step_param(p, group)
        return loss

    def _step_param(self, p: torch.Tensor, group: dict) -> None:
        g = p.grad
        if g.is_sparse:
            raise RuntimeError("GroupAdamW does not take sparse gradients")
        beta1 = group["betas"][0]
        beta = group["estimate_beta"]
        state = self.state[p]
        if not state:
            state["step"] = 0
            for key in ("exp_avg", "signal", "noise"):
                state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["prev_grad"] = g.detach().clone(memory_format=torch.preserve_format)
        state["step"] += 1
        t = state["step"]
        m, signal, noise, prev = state["exp_avg"], state["signal"], state["noise"], state["prev_grad"]
        m.mul_(beta1).add_(g, alpha=1 - beta1)
        if t == 1:
            v = g * g  # no pair of gradients yet: AdamW's own first step
        else:
            signal.mul_(beta).addcmul_(g, prev, value=1 - beta)
            diff = g - prev
            noise.mul_(beta).addcmul_(diff, diff, value=(1 - beta) / 2)
            correction = 1 - beta ** (t - 1)
            v = signal.clamp(min=0).add_(noise, alpha=1 / group["workers"]).div_(correction)
        prev.copy_(g)
        lr = group["lr"]
        if group["weight_decay"]:
            p.mul_(1 - lr * group["weight_decay"])
        p.addcdiv_(m, v.sqrt_().add_(group["eps"]), value=-lr / (1 - beta1 ** t))
