"""One round of local training, with no network: snapshot in, encoded delta out.

The trainer keeps what DiLoCo keeps between rounds on a worker: the inner AdamW state and the
error-feedback residual (what earlier rounds computed but did not send).

With the sparta algorithms it also exchanges a few parameters with the global model while it
trains, through an injected `exchange(step, body) -> answer` callable (worker/exchanges.py: sent
and answered on a background thread, the correction applied between later steps, so training
never waits).
With `sparta` alone the worker's replica is never reset to a snapshot (only the first lease, or a
new model shape, loads one) and a round ends with an empty delta; `sparta+diloco` resets to the
lease's snapshot and ends with the compressed pseudo-gradient, as `diloco` does.

Checkpoints: export_state() is everything a restart needs (worker/state.py writes it) and
restore_state() puts it back; train_round(checkpoint=..., checkpoint_every=N) hands one to the
caller every N local steps, and train_round(resume=...) continues a round from one, bit for bit
for diloco (same batches, same AdamW state, same warm-up position).

How a round fits the machine (micro-batches, bf16 autocast, activation checkpointing) is
worker/fit.py's FitOptions, handed to LocalTrainer; none of it changes the delta's format.

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
from shared.algorithms import start_state
from shared.algorithms.compress import compress_with_feedback, delta_to_tensors
from shared.algorithms.inner import make_optimizer, pseudo_gradient, run_steps
from shared.algorithms.registry import ALGORITHMS, End, Start
from shared.config import InnerConfig
from shared.model import (
    ModelConfig,
    TransformerLM,
    build_model,
    get_params,
    param_schema,
    set_params,
)
from worker.exchanges import ExchangeFn, RoundExchanges
from worker.fit import FitOptions, autocast_dtype, checkpoint_blocks, pick_micro_batch
from worker.state import RoundState, TrainerState, load_optimizer_state, optimizer_state

log = logging.getLogger(__name__)

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
    # sparta: exchange step -> the local step after which its correction was applied (RoundExchanges)
    exchanges_applied_at: dict[int, int] = dataclasses.field(default_factory=dict)


class StepHook:
    """What runs after each local step of one round (run_steps' on_step): the loss kept, the sparta
    exchanges moved on, the caller's on_step, a checkpoint every `checkpoint_every` steps, and the
    gate, which may block (paused) and may end the round (RoundSuspended)."""

    def __init__(self, lease: protocol.Lease, *, start: int, losses: list[float], generator: torch.Generator,
                 round_base: dict[str, torch.Tensor] | None, exchanges: RoundExchanges | None,
                 on_step: Callable[[int, float], None] | None, export: Callable[[RoundState], TrainerState],
                 checkpoint: CheckpointFn | None, checkpoint_every: int, gate: GateFn | None) -> None:
        self.lease, self.start, self.losses, self.generator = lease, start, losses, generator
        self.round_base, self.exchanges, self.on_step, self.export = round_base, exchanges, on_step, export
        self.checkpoint, self.checkpoint_every, self.gate = checkpoint, checkpoint_every, gate
        self.saved_at = start  # the step of the last checkpoint this call made (or resumed from)
        self.gated_s = 0.0  # time spent in the gate (paused): not training time

    def save(self, step: int) -> None:
        if self.checkpoint is not None and self.saved_at != step:
            applied = dict(self.exchanges.applied_at) if self.exchanges is not None else {}
            self.checkpoint(self.export(RoundState(lease=self.lease, step=step, losses=list(self.losses),
                                                   generator=self.generator.get_state(), base=self.round_base,
                                                   exchanges_applied=applied)))
            self.saved_at = step

    def __call__(self, i: int, loss: float) -> None:
        step = self.start + i  # the lease's step number
        total = self.lease.inner.steps
        self.losses.append(loss)
        if self.exchanges is not None:
            self.exchanges.after_step(step)
        if self.on_step is not None:
            self.on_step(step, loss)
        if self.checkpoint_every > 0 and step % self.checkpoint_every == 0 and step < total:
            self.save(step)
        if self.gate is not None and step < total:
            t_gate = time.perf_counter()
            go_on = self.gate(step, lambda: self.save(step))
            self.gated_s += time.perf_counter() - t_gate
            if not go_on:
                raise RoundSuspended(self.lease.lease_id, step)


class LocalTrainer:
    def __init__(self, device: torch.device, *, exchange_wait_s: float = 30.0,
                 max_exchanges_in_flight: int = 4, fit: FitOptions | None = None) -> None:
        """`fit`: micro-batches, precision and activation checkpointing (worker/fit.py; default: whole
        batches in fp32 on CPU, bf16 autocast on CUDA and MPS). A precision the device cannot run
        raises RuntimeError here."""
        self.device = device
        self.fit = fit if fit is not None else FitOptions()
        self.autocast = autocast_dtype(self.fit.precision, device)  # None: fp32
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
        self._split_logged: tuple | None = None  # the (model, batch) last told to go in micro-batches

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
        cfg = lease.model
        if self.model is None or cfg != self.model_cfg:
            self.model = self._build(cfg)
            self.model_cfg = cfg
            self.inner_cfg = lease.inner
            self.opt = make_optimizer(self.model, lease.inner)
            self.residual, self.steps_done, self._replica = {}, 0, False
        return self.model

    def _build(self, cfg: ModelConfig) -> TransformerLM:
        model = build_model(cfg).to(self.device)
        if self.fit.activation_checkpointing:
            checkpoint_blocks(model)
        return model

    def micro_batch(self, lease: protocol.Lease) -> int | None:
        """Rows per forward/backward pass for this lease's steps (None: the whole batch at once): the
        run's micro_batch_size, this worker's --micro-batch, and what its memory holds."""
        rows = pick_micro_batch(lease.model, lease.inner, cap=self.fit.micro_batch, max_params=self.fit.max_params)
        wanted = pick_micro_batch(lease.model, lease.inner, cap=self.fit.micro_batch) or lease.inner.batch_size
        if rows is not None and rows < wanted and (lease.model, lease.inner.batch_size) != self._split_logged:
            log.info("run %s: a batch of %d at context %d does not fit this worker's memory budget at once; "
                     "training it in micro-batches of %d rows", lease.run, lease.inner.batch_size,
                     lease.model.context, rows)
            self._split_logged = (lease.model, lease.inner.batch_size)
        return rows

    def needs_snapshot(self, lease: protocol.Lease) -> bool:
        """Whether train_round needs the lease's snapshot: always, except when the algorithm starts
        from the worker's replica (sparta) and this worker holds one of the same model (such replicas
        are never reset)."""
        return not (ALGORITHMS[lease.algorithm].starts_from is Start.REPLICA and self._replica
                    and self.model is not None and lease.model == self.model_cfg)

    def train_round(self, lease: protocol.Lease, base: Mapping[str, torch.Tensor] | None, tokens: torch.Tensor, *,
                    on_step: Callable[[int, float], None] | None = None,
                    exchange: ExchangeFn | None = None,
                    resume: RoundState | None = None,
                    checkpoint: CheckpointFn | None = None, checkpoint_every: int = 0,
                    gate: GateFn | None = None, ahead: Mapping[str, torch.Tensor] | None = None,
                    on_start: Callable[[bytes], None] | None = None) -> RoundResult:
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
        consensus (docs/BENCHMARKS.md).

        `on_start(blob)` (a new round): the round's start state
        (start_state_blob), before the first step; its upload commits to it (worker/start_states.py)."""
        t0 = time.perf_counter()
        start, base = self._start_round(lease, base, resume, ahead)
        if on_start is not None and resume is None:
            on_start(self.start_state_blob(replica=ALGORITHMS[lease.algorithm].starts_from is Start.REPLICA))
        round_base = None if ALGORITHMS[lease.algorithm].ends_with is End.EMPTY else dict(base)
        gen = torch.Generator().manual_seed(lease.seed)
        if resume is not None:
            gen.set_state(resume.generator.clone())
        rx = self._exchanges(lease, exchange)
        if rx is not None and resume is not None:  # the corrections applied before the interruption
            rx.applied_at.update(resume.exchanges_applied)
            rx.now = start
        hook = StepHook(lease, start=start, losses=list(resume.losses) if resume is not None else [],
                        generator=gen, round_base=round_base, exchanges=rx, on_step=on_step, export=self.export_state,
                        checkpoint=checkpoint, checkpoint_every=checkpoint_every, gate=gate)
        try:
            self.run_local_steps(lease, tokens, steps=lease.inner.steps - start, generator=gen,
                                 step_offset=self.steps_done + start, on_step=hook)
        except BaseException:
            if rx is not None:
                rx.finish(0.0)
            raise
        if rx is not None:
            rx.finish(self.exchange_wait_s)
        self.steps_done += lease.inner.steps
        return self._end_round(lease, base, hook, seconds=time.perf_counter() - t0 - hook.gated_s)

    def _start_round(self, lease: protocol.Lease, base: Mapping[str, torch.Tensor] | None,
                     resume: RoundState | None,
                     ahead: Mapping[str, torch.Tensor] | None) -> tuple[int, Mapping[str, torch.Tensor] | None]:
        """The model as the round's steps start: the base (minus `ahead`) loaded, or the replica or
        the resumed round's progress kept. Returns (the step it starts after, the round's base)."""
        algo = ALGORITHMS[lease.algorithm]
        start = 0
        if resume is not None:
            if resume.lease.lease_id != lease.lease_id:
                raise ValueError(f"resume state is for lease {resume.lease.lease_id}, not {lease.lease_id}")
            if self.model is None or lease.model != self.model_cfg:
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
            if ahead and algo.leases_ahead:
                base = {n: t - ahead[n].to(t.device, t.dtype) if n in ahead else t for n, t in base.items()}
            set_params(model, {n: t.to(self.device) for n, t in base.items()})
        if algo.ends_with is End.PSEUDO_GRADIENT and base is None:  # the pseudo-gradient is base - local
            raise ValueError(f"lease {lease.lease_id} needs the snapshot it started from "
                             f"(version {lease.base_version})")
        self._replica = algo.starts_from is Start.REPLICA
        return start, base

    def _exchanges(self, lease: protocol.Lease, exchange: ExchangeFn | None) -> RoundExchanges | None:
        """The round's sparta exchanges (None: diloco, or no exchange callable given)."""
        if not ALGORITHMS[lease.algorithm].exchanges:
            return None
        if exchange is None:
            log.warning("lease %d: %s without an exchange callable; training without exchanges",
                        lease.lease_id, lease.algorithm)
            return None
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="idletrain-exchange")
        live = {n: p.detach() for n, p in self.model.named_parameters()}
        # A resumed sparta round goes on exchanging from its resume step. Exchanges that were in
        # flight at the interruption are lost, and those made after the last checkpoint are made
        # again and refused (409): that costs only those corrections, never the round.
        return RoundExchanges(self._pool, lease, live, exchange, self.max_exchanges_in_flight)

    def _end_round(self, lease: protocol.Lease, base: Mapping[str, torch.Tensor] | None, hook: StepHook, *,
                   seconds: float) -> RoundResult:
        """The round's delta, encoded (its error feedback kept in the residual), and its numbers."""
        # End.EMPTY: progress travelled through the exchanges; the empty delta closes the lease
        if ALGORITHMS[lease.algorithm].ends_with is End.EMPTY:
            delta = codec.Delta(base_version=lease.base_version, entries=())
            body = codec.encode(delta)
            self._last_sent = {}
        else:
            pg = pseudo_gradient(base, get_params(self.model))
            delta, self.residual = compress_with_feedback(pg, self.residual, lease.compression,
                                                          base_version=lease.base_version, round_seed=lease.seed)
            body = codec.encode(delta)
            self._last_sent = delta_to_tensors(delta, {n: tuple(t.shape) for n, t in pg.items()})
        rx = hook.exchanges
        return RoundResult(
            body=body, losses=hook.losses, tokens=(lease.inner.steps - hook.start) * lease.inner.batch_size
            * self.model.cfg.context, seconds=seconds, values_sent=sum(e.k for e in delta.entries),
            exchanges=rx.applied if rx else 0, exchanges_failed=rx.failed if rx else 0,
            exchanges_skipped=rx.skipped if rx else 0, exchange_bytes_up=rx.bytes_up if rx else 0,
            exchange_bytes_down=rx.bytes_down if rx else 0, resumed_at=hook.start,
            exchanges_applied_at=dict(rx.applied_at) if rx else {})

    def run_local_steps(self, lease: protocol.Lease, tokens: torch.Tensor, *, steps: int,
                        generator: torch.Generator, step_offset: int,
                        on_step: Callable[[int, float], None]) -> list[float]:
        """The round's local steps on the model as it stands (worker/distributed.py's LeadTrainer
        overrides this to run them across several processes)."""
        return run_steps(self.model, self.opt, tokens, lease.inner, lr=lease.lr, steps=steps, generator=generator,
                         step_offset=step_offset, on_step=on_step, micro_batch=self.micro_batch(lease),
                         autocast=self.autocast)

    def start_state_blob(self, *, replica: bool = False) -> bytes:
        """The state the next steps start from that the coordinator does not hold: the optimizer's
        state, the error-feedback residual and the steps done, and (replica: a sparta round) the
        weights themselves (shared/algorithms/start_state.py)."""
        opt = optimizer_state(self.model, self.opt) if self.opt is not None and self.opt.state else None
        params = get_params(self.model) if replica else None
        return start_state.encode(opt, self.residual, steps_done=self.steps_done, params=params)

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
        model = self._build(cfg)
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
