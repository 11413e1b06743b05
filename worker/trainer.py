"""One round of local training, with no network: snapshot in, encoded delta out.

The trainer keeps what DiLoCo keeps between rounds on a worker: the inner AdamW state and the
error-feedback residual (what earlier rounds computed but did not send).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping

import torch

from shared import codec, protocol
from shared.algorithms.compress import compress_with_feedback, delta_to_tensors
from shared.algorithms.inner import make_optimizer, pseudo_gradient, run_steps
from shared.model import ModelConfig, TransformerLM, build_model, get_params, set_params

log = logging.getLogger(__name__)


def pick_device(requested: str = "auto") -> torch.device:
    """CUDA, then Apple MPS, then CPU; an explicit request that cannot be met is an error."""
    mps = getattr(torch.backends, "mps", None)
    has_mps = bool(mps and mps.is_available())
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "mps" if has_mps else "cpu")
    if requested == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda asked for, but torch sees no CUDA device; use --device auto or cpu")
    if requested == "mps" and not has_mps:
        raise RuntimeError("--device mps asked for, but Apple MPS is not available; use --device auto or cpu")
    return torch.device(requested)


@dataclasses.dataclass(frozen=True)
class RoundResult:
    body: bytes  # the encoded delta
    losses: list[float]
    tokens: int
    seconds: float
    values_sent: int


class LocalTrainer:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.model: TransformerLM | None = None
        self.model_cfg: ModelConfig | None = None
        self.opt: torch.optim.Optimizer | None = None
        self.residual: dict[str, torch.Tensor] = {}
        self.steps_done = 0
        self._last_sent: dict[str, torch.Tensor] = {}

    def _ensure_model(self, lease: protocol.Lease) -> TransformerLM:
        cfg = ModelConfig.from_dict(lease.model)
        if self.model is None or cfg != self.model_cfg:
            self.model = build_model(cfg).to(self.device)
            self.model_cfg = cfg
            self.opt = make_optimizer(self.model, lease.inner)
            self.residual, self.steps_done = {}, 0
        return self.model

    def train_round(self, lease: protocol.Lease, base: Mapping[str, torch.Tensor], tokens: torch.Tensor, *,
                    on_step: Callable[[int, float], None] | None = None) -> RoundResult:
        t0 = time.perf_counter()
        model = self._ensure_model(lease)
        set_params(model, {n: t.to(self.device) for n, t in base.items()})
        gen = torch.Generator().manual_seed(lease.seed)
        losses = run_steps(model, self.opt, tokens, lease.inner, lr=lease.lr, steps=lease.inner.steps,
                           generator=gen, step_offset=self.steps_done, on_step=on_step)
        self.steps_done += lease.inner.steps
        pg = pseudo_gradient(base, get_params(model))
        delta, self.residual = compress_with_feedback(pg, self.residual, lease.compression,
                                                      base_version=lease.base_version, round_seed=lease.seed)
        body = codec.encode(delta)
        self._last_sent = delta_to_tensors(delta, {n: tuple(t.shape) for n, t in pg.items()})
        n_tokens = lease.inner.steps * lease.inner.batch_size * model.cfg.context
        return RoundResult(body=body, losses=losses, tokens=n_tokens, seconds=time.perf_counter() - t0,
                           values_sent=sum(e.k for e in delta.entries))

    def undeliverable(self) -> None:
        """The last round's delta never arrived: keep what it carried for the next round
        (with error feedback on), so refused work still moves the model later."""
        if self.residual and self._last_sent:
            for name, sent in self._last_sent.items():
                self.residual[name] += sent
        self._last_sent = {}
