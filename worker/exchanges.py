"""The sparta exchanges of one round: a few of the model's parameters sent to the coordinator
while the round trains, through an injected `exchange(step, body) -> answer` callable (the loop
binds it to the HTTP client, so the trainer stays network-free). The values are selected on the
training thread, sent and answered on a background thread, and the answer (a correction) is
applied between later steps, so training never waits for the network.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable

import torch

from shared import codec, protocol
from shared.algorithms import sparta

log = logging.getLogger(__name__)

ExchangeFn = Callable[[int, bytes], bytes]  # (step, encoded values) -> encoded correction


class RoundExchanges:
    """The exchanges of one round. select() and apply_correction() run on the training thread,
    between steps; encoding, the request and decoding run on the trainer's background thread."""

    def __init__(self, pool: concurrent.futures.Executor, lease: protocol.Lease, params: dict[str, torch.Tensor],
                 exchange: ExchangeFn, max_in_flight: int) -> None:
        self.pool, self.lease, self.params, self.exchange = pool, lease, params, exchange
        self.schema = {n: tuple(t.shape) for n, t in params.items()}
        self.max_in_flight = max_in_flight
        self.pending: list[tuple[int, concurrent.futures.Future]] = []
        self.applied = self.failed = self.skipped = self.bytes_up = self.bytes_down = 0
        # exchange step -> the local step after which its correction was applied, before that step's own
        # exchange (last step + 1: at the round's end); a replay of the round applies each there (the
        # spot-check, shared/algorithms/spotcheck.py)
        self.applied_at: dict[int, int] = {}
        self.now = 0  # the last local step done
        self.stopped: str | None = None  # why no more exchanges are sent this round

    def after_step(self, step: int) -> None:
        self.now = step
        self.apply_finished()
        cfg = self.lease.sparta
        if step % cfg.every or self.stopped:
            return
        if len(self.pending) >= self.max_in_flight:
            self.skipped += 1
            log.debug("lease %d: exchange after step %d skipped, %d still in flight",
                      self.lease.lease_id, step, len(self.pending))
            return
        sent = sparta.select(self.params, p=cfg.p, seed=sparta.exchange_seed(self.lease.seed, step),
                             values=cfg.values, base_version=self.lease.base_version)
        self.pending.append((step, self.pool.submit(self._send, step, sent)))

    def _send(self, step: int, sent: codec.Delta) -> tuple[int, int, codec.Delta]:
        body = codec.encode(sent)
        answer = self.exchange(step, body)
        correction = codec.decode(answer, schema=self.schema)
        expected = {(e.name, e.seed, e.k) for e in sent.entries}
        if {(e.name, e.seed, e.k) for e in correction.entries} != expected or any(
                e.index_kind != codec.IndexKind.SEEDED for e in correction.entries):
            raise ValueError("the correction does not match the exchanged indices")
        return len(body), len(answer), correction

    def apply_finished(self) -> None:
        still = []
        for step, fut in self.pending:
            if not fut.done():
                still.append((step, fut))
                continue
            try:
                up, down, correction = fut.result()
            except Exception as exc:  # noqa: BLE001 -- a refused or failed exchange costs only itself
                self._failed(step, exc)
                continue
            sparta.apply_correction(self.params, correction)
            self.applied_at[step] = self.now
            self.applied += 1
            self.bytes_up += up
            self.bytes_down += down
        self.pending = still

    def _failed(self, step: int, exc: Exception) -> None:
        self.failed += 1
        status = getattr(exc, "status", None)  # the client's CoordinatorError; the trainer stays network-free
        if status in (403, 404, 410) and self.stopped is None:  # the lease is gone: stop asking this round
            self.stopped = str(exc)
        level = logging.WARNING if self.failed == 1 else logging.DEBUG
        log.log(level, "lease %d: exchange after step %d failed (skipped): %s", self.lease.lease_id, step, exc)

    def finish(self, timeout_s: float) -> None:
        """Wait (bounded) for the answers still in flight and apply them; drop the rest."""
        if self.pending:
            concurrent.futures.wait([f for _, f in self.pending], timeout=timeout_s)
        self.now += 1  # applied after the round's last exchange was selected
        self.apply_finished()
        for step, fut in self.pending:
            fut.cancel()
            self.failed += 1
            log.warning("lease %d: exchange after step %d unanswered after %.0f s; dropped",
                        self.lease.lease_id, step, timeout_s)
        self.pending = []
