"""How a run's live model takes sparse exchanges (sparta): RunRuntime's side of them, in a class of its
own (coordinator/runtime.py is the rest of the run's live state).

An exchange is judged against what its own lease can have moved (shared/algorithms/exchange_screen.py),
folded in clipped (shared/algorithms/sparta.py mix_clipped), its centre step scaled by the descent guard, and undone exactly when its answer cannot be recorded (centre_at / undo_exchange). All of
it reads and writes the runtime's state under its `lock`, which the caller holds.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from shared import codec
from shared.algorithms import exchange_screen, sparta
from shared.model import set_params


class ExchangeFolding:
    """Mixed into RunRuntime: uses its config, outer (the flat merge state), merged_by, exchange_ratios,
    reference_norm, version, model, guard_tokens, _descent and last_exchange_id."""

    def _centre_values(self, e: codec.Entry) -> torch.Tensor:
        return self.outer.weights_at(torch.from_numpy(e.indices) + self.outer.offsets[e.name])

    def _exchange_limits(self, sent: codec.Delta, *, step: int, worker: int | None) -> exchange_screen.ExchangeLimits:
        inner = self.config.inner
        earlier = self.merged_by.get(str(worker), 0) * inner.steps if worker is not None else 0
        return exchange_screen.exchange_limits(
            step=step, earlier_steps=earlier, lr=inner.lr, sparta=self.config.sparta, cfg=self.config.robust,
            reference_norm=self.reference_norm, round_steps=inner.steps, n_params=self.outer.m.numel(),
            k=sum(e.k for e in sent.entries))

    def _distances(self, sent: codec.Delta) -> list[np.ndarray]:
        return [np.asarray(e.values, dtype=np.float64) - self._centre_values(e).numpy().astype(np.float64)
                for e in sent.entries]

    def screen_exchange(self, sent: codec.Delta, *, step: int, worker: int | None) -> exchange_screen.ExchangeVerdict:
        """The screen's verdict on `sent` after local step `step` of a lease of `worker` (caller holds
        `lock`): its distance from the centre against what the lease can have moved (exchange_screen.py)."""
        return exchange_screen.judge_exchange(self._distances(sent), self._exchange_limits(sent, step=step, worker=worker),
                                              cfg=self.config.robust)

    def exchange(self, sent: codec.Delta, *, step: int, exchange_id: int | None = None, worker: int | None = None,
                 scale: float | None = None) -> tuple[codec.Delta, float]:
        """Fold one sparse exchange into the global model (caller holds `lock`); returns the correction and
        the descent guard's scale of the centre's step. The centre moves by what the screen lets through
        times that scale; the worker is answered its whole correction (sparta.mix_clipped).

        Replay passes the recorded exchange_id and scale; live exchanges set the id once their row is
        committed, and the worker's record and the guard decide the scale. worker: the sender (None:
        unknown, judged by the limits of a new token at full share)."""
        distances = self._distances(sent)
        verdict = exchange_screen.judge_exchange(distances, self._exchange_limits(sent, step=step, worker=worker),
                                                 cfg=self.config.robust)
        rcfg, cfg = self.config.robust, self.config.sparta
        if worker is not None:
            exchange_screen.remember(self.exchange_ratios, str(worker), verdict, cfg=rcfg)

        # sparta's mix on theta = T - C M (T itself while C = 0), written through T; weights_at first
        # flushes the weights' deferred share of the pending deltas into T
        def flat(e: codec.Entry) -> torch.Tensor:
            return torch.from_numpy(e.indices) + self.outer.offsets[e.name]

        if scale is None:
            steps = distances if verdict.clipped is None else verdict.clipped
            trust = 1.0 if worker is None else exchange_screen.trust(self.merged_by.get(str(worker), 0))
            scale = trust * self._guard(sent, steps, flat, weight=cfg.alpha * trust) if verdict.merged else 1.0
        correction = sparta.mix_clipped(lambda e: self.outer.weights_at(flat(e)),
                                        lambda e, d: self.outer.t.index_add_(0, flat(e), d),
                                        sent, clipped=verdict.clipped, alpha=cfg.alpha, scale=scale,
                                        values=cfg.values)
        if exchange_id is not None:
            self.last_exchange_id = exchange_id
        return correction, scale

    def _guard(self, sent: codec.Delta, steps: Sequence[np.ndarray], flat, *, weight: float) -> float:
        """The descent guard's scale for a centre step of `weight` x steps at `sent`'s indices: the
        gradient of the published model's loss on the coordinator's own tokens (taken again once per
        version) says how much it would raise that loss (exchange_screen.guard_scale)."""
        if self.guard_tokens is None or not self.config.robust.enabled:
            return 1.0
        if self._descent is None or self._descent[0] != self.version:
            set_params(self.model, self.outer.views(self.outer.published_flat(self.config.outer)))
            with torch.enable_grad():
                loss, grad = exchange_screen.descent_gradient(self.model, self.guard_tokens,
                                                              context=self.config.model.context)
            self._descent = (self.version, loss, grad)
        _, loss, grad = self._descent
        predicted = weight * sum(float(np.dot(grad[flat(e)].numpy().astype(np.float64), d))
                                 for e, d in zip(sent.entries, steps))
        return exchange_screen.guard_scale(predicted, loss)

    def centre_at(self, sent: codec.Delta) -> dict[str, torch.Tensor]:
        """What undo_exchange needs to put the centre back at an exchange's indices (caller holds
        `lock`): the stored T there (the weights themselves while C = 0), so the undo is exact."""
        self.outer.flush()
        return {e.name: self.outer.t[torch.from_numpy(e.indices) + self.outer.offsets[e.name]].clone()
                for e in sent.entries}

    def undo_exchange(self, sent: codec.Delta, before: dict[str, torch.Tensor]) -> None:
        """Put back what centre_at saved: an exchange refused after exchange() changes nothing."""
        for e in sent.entries:
            self.outer.t[torch.from_numpy(e.indices) + self.outer.offsets[e.name]] = before[e.name]
