"""One round of local training, with no network: snapshot in, encoded delta out.

The trainer keeps what DiLoCo keeps between rounds on a worker: the inner AdamW state and the
error-feedback residual (what earlier rounds computed but did not send).

With the sparta algorithms it also exchanges a few parameters with the global model while it
trains, through an injected `exchange(step, body) -> answer` callable (the loop binds it to the
HTTP client): the values are selected on the training thread, sent and answered on a background
thread, and the answer (a correction) is applied between later steps, so training never waits.
With `sparta` alone the worker's replica is never reset to a snapshot (only the first lease, or a
new model shape, loads one) and a round ends with an empty delta; `sparta+diloco` resets to the
lease's snapshot and ends with the compressed pseudo-gradient, as `diloco` does.

Checkpoints: export_state() is everything a restart needs (worker/state.py writes it) and
restore_state() puts it back; train_round(checkpoint=..., checkpoint_every=N) hands one to the
caller every N local steps, and train_round(resume=...) continues a round from one, bit for bit
for diloco (same batches, same AdamW state, same warm-up position).

Pauses: train_round(gate=...) asks the gate between local steps whether to go on; the gate may
block (the worker is paused), first saving the round through the `save` it is handed, and may
answer False, which ends the call with RoundSuspended (the round resumes later from that save).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping

import torch

from shared import codec, protocol
from shared.algorithms import sparta
from shared.algorithms.compress import compress_with_feedback, delta_to_tensors
from shared.algorithms.inner import make_optimizer, pseudo_gradient, run_steps
from shared.config import InnerConfig
from shared.model import (
    ModelConfig,
    TransformerLM,
    build_model,
    get_params,
    param_schema,
    set_params,
)
from worker.state import RoundState, TrainerState, load_optimizer_state, optimizer_state

log = logging.getLogger(__name__)

ALGORITHMS = ("diloco", "sparta", "sparta+diloco")
ExchangeFn = Callable[[int, bytes], bytes]  # (step, encoded values) -> encoded correction
CheckpointFn = Callable[[TrainerState], None]
# (step just done, save the round now) -> go on? Called between steps; may block while paused.
GateFn = Callable[[int, Callable[[], None]], bool]


class RoundSuspended(Exception):
    """train_round stopped after `step` because its gate said so; the round was saved there first."""

    def __init__(self, lease_id: int, step: int) -> None:
        super().__init__(f"lease {lease_id} suspended after step {step}")
        self.lease_id = lease_id
        self.step = step


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
    losses: list[float]  # every step of the lease, those before a resume included
    tokens: int  # trained in this call (a resumed round counts only the steps it trained)
    seconds: float  # training time of this call (time paused at the gate left out)
    values_sent: int
    exchanges: int = 0  # answered and applied
    exchanges_failed: int = 0  # refused, failed, or still unanswered when the round ended
    exchanges_skipped: int = 0  # not sent because too many were still in flight
    exchange_bytes_up: int = 0
    exchange_bytes_down: int = 0
    resumed_at: int = 0  # the local step this call resumed from (0: the round started here)


class _RoundExchanges:
    """The exchanges of one round. select() and apply_correction() run on the training thread,
    between steps; encoding, the request and decoding run on the trainer's background thread."""

    def __init__(self, pool: concurrent.futures.Executor, lease: protocol.Lease, params: dict[str, torch.Tensor],
                 exchange: ExchangeFn, max_in_flight: int) -> None:
        self.pool, self.lease, self.params, self.exchange = pool, lease, params, exchange
        self.schema = {n: tuple(t.shape) for n, t in params.items()}
        self.max_in_flight = max_in_flight
        self.pending: list[tuple[int, concurrent.futures.Future]] = []
        self.applied = self.failed = self.skipped = self.bytes_up = self.bytes_down = 0
        self.stopped: str | None = None  # why no more exchanges are sent this round

    def after_step(self, step: int) -> None:
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
        self.apply_finished()
        for step, fut in self.pending:
            fut.cancel()
            self.failed += 1
            log.warning("lease %d: exchange after step %d unanswered after %.0f s; dropped",
                        self.lease.lease_id, step, timeout_s)
        self.pending = []


class LocalTrainer:
    def __init__(self, device: torch.device, *, exchange_wait_s: float = 30.0,
                 max_exchanges_in_flight: int = 4) -> None:
        self.device = device
        self.model: TransformerLM | None = None
        self.model_cfg: ModelConfig | None = None
        self.inner_cfg: InnerConfig | None = None  # what the optimizer was made with
        self.opt: torch.optim.Optimizer | None = None
        self.residual: dict[str, torch.Tensor] = {}
        self.steps_done = 0
        self._last_sent: dict[str, torch.Tensor] = {}
        self._replica = False  # sparta: the model holds this worker's own replica, kept between rounds
        self.exchange_wait_s = exchange_wait_s
        self.max_exchanges_in_flight = max_exchanges_in_flight
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    @property
    def last_sent(self) -> dict[str, torch.Tensor]:
        """The dense form of the last round's delta as sent (empty for sparta, or after undeliverable()).
        Read it, don't write it."""
        return self._last_sent

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def _ensure_model(self, lease: protocol.Lease) -> TransformerLM:
        cfg = ModelConfig.from_dict(lease.model)
        if self.model is None or cfg != self.model_cfg:
            self.model = build_model(cfg).to(self.device)
            self.model_cfg = cfg
            self.inner_cfg = lease.inner
            self.opt = make_optimizer(self.model, lease.inner)
            self.residual, self.steps_done, self._replica = {}, 0, False
        return self.model

    def needs_snapshot(self, lease: protocol.Lease) -> bool:
        """Whether train_round needs the lease's snapshot: always, except with `sparta` once this
        worker holds a replica of the same model (SPARTA replicas are never reset)."""
        return not (lease.algorithm == "sparta" and self._replica and self.model is not None
                    and ModelConfig.from_dict(lease.model) == self.model_cfg)

    def train_round(self, lease: protocol.Lease, base: Mapping[str, torch.Tensor] | None, tokens: torch.Tensor, *,
                    on_step: Callable[[int, float], None] | None = None,
                    exchange: ExchangeFn | None = None,
                    resume: RoundState | None = None,
                    checkpoint: CheckpointFn | None = None, checkpoint_every: int = 0,
                    gate: GateFn | None = None, ahead: Mapping[str, torch.Tensor] | None = None) -> RoundResult:
        """One round. `base` (the lease's snapshot) may be None when needs_snapshot() is False.
        `exchange` sends the sparta exchanges of this lease; without it a sparta round trains alone.

        `checkpoint(state)` is called after every `checkpoint_every` local steps (0: never; not after
        the last step: the caller saves the round's end itself). `resume` continues the round such
        a state describes; restore_state() that state first. `on_step` sees the lease's step numbers
        (a round resumed at step 40 goes on with 41).

        `gate(step, save)` runs after each step but the last; it may block, and it calls save() to
        checkpoint the round before a long wait (through `checkpoint`; nothing is saved twice for
        one step). When it answers False, train_round raises RoundSuspended.

        `ahead` (diloco, a new round): the sum of this worker's own pseudo-gradients that the base
        does not hold yet (delivered, or still uploading, after the coordinator cut this base). The
        round starts from base - ahead, where the coordinator's model is headed once it merges them,
        and its pseudo-gradient is taken against that start: this round's progress only. Started
        from the bare base instead, the round would learn those deltas' progress again and send it
        twice -- an overshoot the coordinator's screening sees as a delta pointing against the
        consensus (docs/BENCHMARKS.md)."""
        if lease.algorithm not in ALGORITHMS:
            raise ValueError(f"this worker does not know the algorithm {lease.algorithm!r} "
                             f"(it knows {', '.join(ALGORITHMS)}): upgrade idletrain")
        t0 = time.perf_counter()
        total = lease.inner.steps
        start = 0
        if resume is not None:
            if resume.lease.lease_id != lease.lease_id:
                raise ValueError(f"resume state is for lease {resume.lease.lease_id}, not {lease.lease_id}")
            if self.model is None or ModelConfig.from_dict(lease.model) != self.model_cfg:
                raise ValueError(f"lease {lease.lease_id}: restore_state() the saved trainer before resuming")
            start = resume.step
            if base is None:
                base = resume.base
            keep = True  # the model already holds the round's progress
        else:
            keep = not self.needs_snapshot(lease)
        model = self._ensure_model(lease)
        if not keep:
            if base is None:
                raise ValueError(f"lease {lease.lease_id} needs its snapshot (version {lease.base_version})")
            if ahead and lease.algorithm == "diloco":
                base = {n: t - ahead[n].to(t.device, t.dtype) if n in ahead else t for n, t in base.items()}
            set_params(model, {n: t.to(self.device) for n, t in base.items()})
        if lease.algorithm != "sparta" and base is None:  # the pseudo-gradient is base - local
            raise ValueError(f"lease {lease.lease_id} needs the snapshot it started from "
                             f"(version {lease.base_version})")
        self._replica = lease.algorithm == "sparta"
        round_base = None if lease.algorithm == "sparta" else dict(base)

        gen = torch.Generator().manual_seed(lease.seed)
        if resume is not None:
            gen.set_state(resume.generator.clone())
        losses = list(resume.losses) if resume is not None else []

        rx = None
        if "sparta" in lease.algorithm:
            if exchange is None:
                log.warning("lease %d: %s without an exchange callable; training without exchanges",
                            lease.lease_id, lease.algorithm)
            else:
                if self._pool is None:
                    self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1,
                                                                       thread_name_prefix="idletrain-exchange")
                live = {n: p.detach() for n, p in model.named_parameters()}
                rx = _RoundExchanges(self._pool, lease, live, exchange, self.max_exchanges_in_flight)
                # A resumed sparta round goes on exchanging from its resume step. Exchanges that were in
                # flight at the interruption are lost, and those made after the last checkpoint are made
                # again and refused (409): that costs only those corrections, never the round.

        saved_at = [start]  # the step of the last checkpoint this call made (or resumed from)
        gated_s = [0.0]  # time spent in the gate (paused): not training time

        def save(step: int) -> None:
            if checkpoint is not None and saved_at[0] != step:
                checkpoint(self.export_state(RoundState(lease=lease, step=step, losses=list(losses),
                                                        generator=gen.get_state(), base=round_base)))
                saved_at[0] = step

        def step_hook(i: int, loss: float) -> None:
            step = start + i  # the lease's step number
            losses.append(loss)
            if rx is not None:
                rx.after_step(step)
            if on_step is not None:
                on_step(step, loss)
            if checkpoint_every > 0 and step % checkpoint_every == 0 and step < total:
                save(step)
            if gate is not None and step < total:
                t_gate = time.perf_counter()
                go_on = gate(step, lambda: save(step))
                gated_s[0] += time.perf_counter() - t_gate
                if not go_on:
                    raise RoundSuspended(lease.lease_id, step)

        try:
            self._run_steps(lease, tokens, steps=total - start, generator=gen,
                            step_offset=self.steps_done + start, on_step=step_hook)
        except BaseException:
            if rx is not None:
                rx.finish(0.0)
            raise
        if rx is not None:
            rx.finish(self.exchange_wait_s)
        self.steps_done += total

        if lease.algorithm == "sparta":  # progress travelled through the exchanges; the empty delta closes the lease
            delta = codec.Delta(base_version=lease.base_version, entries=())
            body = codec.encode(delta)
            self._last_sent = {}
        else:
            pg = pseudo_gradient(base, get_params(model))
            delta, self.residual = compress_with_feedback(pg, self.residual, lease.compression,
                                                          base_version=lease.base_version, round_seed=lease.seed)
            body = codec.encode(delta)
            self._last_sent = delta_to_tensors(delta, {n: tuple(t.shape) for n, t in pg.items()})
        n_tokens = (total - start) * lease.inner.batch_size * model.cfg.context
        return RoundResult(
            body=body, losses=losses, tokens=n_tokens, seconds=time.perf_counter() - t0 - gated_s[0],
            values_sent=sum(e.k for e in delta.entries),
            exchanges=rx.applied if rx else 0, exchanges_failed=rx.failed if rx else 0,
            exchanges_skipped=rx.skipped if rx else 0, exchange_bytes_up=rx.bytes_up if rx else 0,
            exchange_bytes_down=rx.bytes_down if rx else 0, resumed_at=start)

    def _run_steps(self, lease: protocol.Lease, tokens: torch.Tensor, *, steps: int, generator: torch.Generator,
                   step_offset: int, on_step: Callable[[int, float], None]) -> list[float]:
        """The round's local steps on the model as it stands (worker/distributed.py overrides this
        to run them across several processes)."""
        return run_steps(self.model, self.opt, tokens, lease.inner, lr=lease.lr, steps=steps, generator=generator,
                         step_offset=step_offset, on_step=on_step)

    # -- checkpoints ------------------------------------------------------------------------------

    def has_state(self) -> bool:
        return self.model is not None

    def export_state(self, round_state: RoundState | None = None) -> TrainerState:
        """What a restart needs, between rounds (round_state None) or in the middle of one: copies,
        which later training does not change."""
        if self.model is None or self.model_cfg is None or self.inner_cfg is None or self.opt is None:
            raise ValueError("nothing to export: this trainer has not trained yet")
        return TrainerState(model=self.model_cfg.to_dict(), inner=self.inner_cfg.model_dump(mode="json"),
                            steps_done=self.steps_done, replica=self._replica, params=get_params(self.model),
                            optimizer=optimizer_state(self.model, self.opt),
                            residual={n: t.clone() for n, t in self.residual.items()},
                            round=round_state)

    def restore_state(self, saved: TrainerState) -> None:
        """Put an exported state back: model, a fresh optimizer loaded with the saved AdamW state,
        the residual and the warm-up count. Checks everything first (ValueError), then changes it all."""
        cfg = ModelConfig.from_dict(saved.model)
        inner = InnerConfig.model_validate(saved.inner)
        model = build_model(cfg).to(self.device)
        set_params(model, {n: t.to(self.device) for n, t in saved.params.items()})
        opt = make_optimizer(model, inner)
        load_optimizer_state(model, opt, saved.optimizer)
        schema = param_schema(model)
        for name, t in saved.residual.items():
            if name not in schema or tuple(t.shape) != schema[name]:
                raise ValueError(f"residual {name}: not a parameter of this model, or of another shape")
        self.model, self.model_cfg, self.inner_cfg, self.opt = model, cfg, inner, opt
        self.residual = {n: t.to("cpu", torch.float32, copy=True) for n, t in saved.residual.items()}
        self.steps_done = int(saved.steps_done)
        self._replica = bool(saved.replica)
        self._last_sent = {}

    def undeliverable_body(self, body: bytes) -> None:
        """As undeliverable(), for a delta known only by its bytes (one saved before a restart, or
        refused while a later round trained: that round's own delta, _last_sent, stays as it is).
        Call it between rounds, on the training thread."""
        if self.model is None or not self.residual:
            return
        schema = param_schema(self.model)
        for name, sent in delta_to_tensors(codec.decode(body, schema=schema), schema).items():
            self.residual[name] += sent

    def undeliverable(self) -> None:
        """The last round's delta never arrived: keep what it carried for the next round
        (with error feedback on), so refused work still moves the model later."""
        if self.residual and self._last_sent:
            for name, sent in self._last_sent.items():
                self.residual[name] += sent
        self._last_sent = {}
