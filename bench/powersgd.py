"""PowerSGD (Vogels, Karimireddy, Jaggi 2019, arXiv 1905.13727): rank-r gradient compression with
error feedback for data-parallel training, the low-rank baseline of `bench wallclock`.

Each step, for every weight matrix M_i (worker i's gradient plus its residual, (n, m)):
    P = mean_i(M_i Q)                  # all-reduce of an (n, r) matrix; Q (m, r) is last step's
    P = orthonormalise(P)              # the same on every worker
    Q = mean_i(M_i^T P)                # all-reduce of an (m, r) matrix
    every worker applies P Q^T, and keeps M_i - P Q^T as its residual (error feedback).
One power iteration per step, warm-started from the last step's Q (the paper's Algorithm 1).
Vectors (biases, norms) and matrices too small to gain are all-reduced uncompressed, as the paper does.
Both all-reduces are linear, so they run as ring all-reduces of fp32 values.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch


def orthonormalise(p: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns whose span holds p's (n, r) columns (reduced QR)."""
    return torch.linalg.qr(p, mode="reduced")[0]


class PowerSGD:
    """The compressor of N workers sharing one model. `step(grads)` takes each worker's gradients and
    returns the mean gradient every worker applies; `bytes_per_step` is what one worker puts into the
    all-reduces of one step (fp32), `allreduces` how many run one after another."""

    allreduces = 2

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], *, rank: int, workers: int, seed: int = 0) -> None:
        if rank < 1 or workers < 1:
            raise ValueError(f"rank and workers must be at least 1, got {rank}, {workers}")
        self.rank, self.workers = rank, workers
        gen = torch.Generator().manual_seed(seed)
        # compress a matrix only where rank r is smaller than it: (n + m) r < n m
        self.low_rank = {n: s for n, s in shapes.items() if len(s) == 2 and (s[0] + s[1]) * min(rank, *s) < s[0] * s[1]}
        self.q = {n: torch.randn(s[1], min(rank, *s), generator=gen) for n, s in self.low_rank.items()}
        self.residual: list[dict[str, torch.Tensor]] = [{} for _ in range(workers)]
        self.bytes_per_step = 4 * sum((s[0] + s[1]) * min(rank, *s) for s in self.low_rank.values()) + 4 * sum(
            _numel(s) for n, s in shapes.items() if n not in self.low_rank)

    def step(self, grads: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        if len(grads) != self.workers:
            raise ValueError(f"one gradient dict per worker: {self.workers}, got {len(grads)}")
        out: dict[str, torch.Tensor] = {}
        for name in grads[0]:
            if name not in self.low_rank:
                out[name] = torch.stack([g[name] for g in grads]).mean(0)
                continue
            m = [g[name] + self.residual[i].get(name, 0.0) for i, g in enumerate(grads)]  # (n, m) each
            p = orthonormalise(torch.stack([mi @ self.q[name] for mi in m]).mean(0))  # (n, r)
            q = torch.stack([mi.T @ p for mi in m]).mean(0)  # (m, r)
            approx = p @ q.T  # (n, m): what every worker applies
            for i, mi in enumerate(m):
                self.residual[i][name] = mi - approx
            self.q[name] = q
            out[name] = approx
        return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


__all__ = ["PowerSGD", "orthonormalise"]
