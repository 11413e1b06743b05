"""The merge rule: how the coordinator folds one worker's delta into the global model.

Outer SGD with delayed Nesterov momentum, applied one delta at a time (asynchronously):

    each arriving delta g, weighted w = (1 + r)^-staleness_exponent where r is how many
    rounds it lags (r = max(0, s - (G - 1)) / G for s versions behind, G = group):
        theta -= lr / G * w g          (its share of the plain outer step, at once)
        acc   += w g
    after every G deltas (one momentum step per group, as in delayed Nesterov):
        m      = mu m + acc / G
        theta -= lr * mu * m           (Nesterov look-ahead; heavy-ball uses the old m)
        acc    = 0

When G deltas all start from the same version this is exactly DiLoCo's synchronous outer
step (Nesterov SGD on the averaged pseudo-gradient); no delta ever waits for another.

lr is the current group's (group_lr): with cfg.warmup = N > 0 the k-th group (k = 0, 1, ...,
counted by `groups`, the momentum steps done) runs at lr * min(1, (k + 1) / N) -- its deltas'
shares, its momentum step and its look-ahead alike; with N = 0 every group runs at cfg.lr.

What the coordinator publishes (hands out as a lease's base, snapshots, evaluates) is, with
cfg.lookahead, not theta itself but the best guess of theta at the open group's end: the k
deltas of the group so far taken at their mean instead of at 1/G each,

    published = theta - lr (1/k - 1/G) acc          (0 < k < G; theta itself at k = 0)

so a worker restarting after the first delta of a group starts from that delta's full step, as
a synchronous DiLoCo worker would start from the group's average, instead of from 1/G of it.
At every group's end the two are the same model; the merge arithmetic itself is unchanged.

The coordinator runs this rule on one flat vector with the momentum step made lazy
(flat_outer.py); the simulator and the tests run it here, tensor by tensor.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np
import torch

from shared.codec import Delta
from shared.config import OuterConfig


def staleness_weight(staleness: int, cfg: OuterConfig) -> float:
    """Weight of a delta `staleness` versions behind: 1 within one round of the group, then decays."""
    if staleness < 0:
        raise ValueError(f"staleness must be >= 0, got {staleness}")
    rounds = max(0, staleness - (cfg.group - 1)) / cfg.group
    return float((1.0 + rounds) ** -cfg.staleness_exponent)


@dataclasses.dataclass
class OuterState:
    """Everything the merge rule keeps between deltas (checkpointed with the weights)."""

    params: dict[str, torch.Tensor]  # the global model, fp32
    momentum: dict[str, torch.Tensor]
    accum: dict[str, torch.Tensor]
    in_group: int = 0  # deltas folded into accum since the last momentum step
    groups: int = 0  # momentum steps done: the open group's index, which sets its lr (group_lr)

    @classmethod
    def fresh(cls, params: Mapping[str, torch.Tensor]) -> OuterState:
        p = {n: t.detach().to(torch.float32, copy=True) for n, t in params.items()}
        return cls(params=p, momentum={n: torch.zeros_like(t) for n, t in p.items()},
                   accum={n: torch.zeros_like(t) for n, t in p.items()})

    def tensors(self) -> dict[str, torch.Tensor]:
        """Flat name -> tensor map for checkpointing (the counters travel separately)."""
        out = {f"params/{n}": t for n, t in self.params.items()}
        out.update({f"momentum/{n}": t for n, t in self.momentum.items()})
        out.update({f"accum/{n}": t for n, t in self.accum.items()})
        return out

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor], *, in_group: int, groups: int) -> OuterState:
        parts: dict[str, dict[str, torch.Tensor]] = {"params": {}, "momentum": {}, "accum": {}}
        for key, t in tensors.items():
            kind, _, name = key.partition("/")
            parts[kind][name] = t.to(torch.float32)
        return cls(params=parts["params"], momentum=parts["momentum"], accum=parts["accum"], in_group=in_group,
                   groups=groups)


def group_lr(groups: int, cfg: OuterConfig) -> float:
    """The outer lr of the group after `groups` momentum steps: cfg.lr * min(1, (groups + 1) / warmup)."""
    if groups < 0:
        raise ValueError(f"groups (momentum steps done) must be >= 0, got {groups}")
    if groups + 1 >= cfg.warmup:  # no warm-up (0), or past it: cfg.lr itself, bit for bit
        return cfg.lr
    return cfg.lr * (groups + 1) / cfg.warmup


def lookahead_gain(in_group: int, cfg: OuterConfig, *, groups: int) -> float:
    """c in published = theta - c acc: lr (1/k - 1/G) with k deltas in the open group, else 0
    (lr: the open group's, group_lr)."""
    if not cfg.lookahead or in_group <= 0 or in_group >= cfg.group:
        return 0.0
    return group_lr(groups, cfg) * (1.0 / in_group - 1.0 / cfg.group)


def published(state: OuterState, cfg: OuterConfig) -> dict[str, torch.Tensor]:
    """The model the coordinator hands out and evaluates (a copy): see the module docstring."""
    c = lookahead_gain(state.in_group, cfg, groups=state.groups)
    return {n: t - c * state.accum[n] if c else t.clone() for n, t in state.params.items()}


def apply_delta(state: OuterState, delta: Delta, *, weight: float, cfg: OuterConfig) -> None:
    """Fold one decoded delta into `state` in place (see the module docstring)."""
    share = group_lr(state.groups, cfg) / cfg.group
    for e in delta.entries:
        vals = torch.from_numpy(np.asarray(e.values, dtype=np.float32)) * weight
        theta = state.params[e.name].view(-1)
        acc = state.accum[e.name].view(-1)
        if e.indices is None:
            theta.sub_(vals, alpha=share)
            acc.add_(vals)
        else:
            idx = torch.from_numpy(e.indices)
            theta.index_add_(0, idx, vals, alpha=-share)
            acc.index_add_(0, idx, vals)
    state.in_group += 1
    if state.in_group >= cfg.group:
        momentum_step(state, cfg)


def momentum_step(state: OuterState, cfg: OuterConfig) -> None:
    """The group's end on `state` in place: the outer step at the group's lr, then acc = 0 and a new group."""
    outer_step(state.params, state.momentum, state.accum, cfg, lr=group_lr(state.groups, cfg))
    for acc in state.accum.values():
        acc.zero_()
    state.in_group = 0
    state.groups += 1


def outer_step(params: Mapping[str, torch.Tensor], momentum: Mapping[str, torch.Tensor],
               accum: Mapping[str, torch.Tensor], cfg: OuterConfig, *, lr: float) -> None:
    """m = mu m + acc / G, theta -= lr mu m (heavy-ball: with the old m), tensor by tensor, in place;
    lr: the group's (group_lr).

    The rule's one dense form: OuterState's momentum_step and FlatOuter's plain form run it; the
    lazy FlatOuter computes the same in scaled variables (tests pin it within a stated tolerance)."""
    mu = cfg.momentum
    for name, theta in params.items():
        m, acc = momentum[name], accum[name]
        if cfg.nesterov:
            m.mul_(mu).add_(acc, alpha=1.0 / cfg.group)
            theta.sub_(m, alpha=lr * mu)
        else:
            theta.sub_(m, alpha=lr * mu)
            m.mul_(mu).add_(acc, alpha=1.0 / cfg.group)
