"""One worker over several local processes: `torchrun --nproc-per-node N -m idletrain worker run ...`.

torchrun starts N processes and tells each its place through WORLD_SIZE, RANK and LOCAL_RANK (the
worker has no flag of its own for it). To the coordinator they are ONE worker:

- Rank 0 runs the ordinary loop (worker/loop.py): registration, leases, downloads, checkpoints,
  pauses, uploads. It is the only process that talks HTTP or touches the state dir.
- The other ranks (followers) wait for rank 0. When a round's local steps start, rank 0 broadcasts
  all they need: the lease, the weights as the steps start (the snapshot, or a resumed round's
  progress), the AdamW state, the warm-up position, the batch sampler's state and the shard's
  tokens. Followers keep nothing between rounds, so a restored or resumed rank 0 needs nothing more.
- Every local step is data-parallel. Each rank draws the step's whole batch (the lease's
  batch_size rows) from the one seeded generator and trains its own contiguous rows of it (rank r
  of N: rows r*B//N up to (r+1)*B//N); the gradients, weighted by rows, are summed in one
  all-reduce (the whole batch's mean gradient), then clipped, then AdamW steps on every rank
  alike, so every rank holds the same weights. A round thus trains the very batches one process
  would, and equals it up to float rounding; the tokens reported stay steps x batch_size x context.
  Rank 0 alone takes the pseudo-gradient and encodes the delta.
- After each step rank 0 says whether the round goes on (its progress, checkpoints and pause gate
  run then; a paused rank 0 holds the followers there). When its step hook raises, RoundSuspended
  included, the followers drop the round and wait for the next; when rank 0 stops, it tells them
  and they exit 0. They ignore SIGINT and SIGTERM: rank 0 decides.
- Devices: cuda:LOCAL_RANK, gradients over NCCL, when CUDA is there (--device auto or cuda), else
  CPU processes over gloo. The messages, and so every wait between steps and rounds, go through a
  gloo group with a long timeout: a paused worker keeps no GPU spinning and times nothing out.

Not supported, each a clear error: Apple MPS (one device: run one process), ranks on several
machines (one worker is one machine), a batch_size below the number of processes, and the sparta
algorithms (their corrections arrive asynchronously on rank 0 and would have to be applied on every
rank at the same step: run those as one process). A failure inside a step's computation, on any
rank, ends the whole worker (torchrun stops the other processes; a follower that loses rank 0 exits
with an error); the round resumes from its last checkpoint at the next start.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import signal
from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist

from shared import protocol
from shared.algorithms.inner import make_optimizer, run_steps
from shared.algorithms.registry import ALGORITHMS
from shared.config import InnerConfig
from shared.model import ModelConfig, TransformerLM, build_model, get_params, set_params
from worker.state import OptimizerState, load_optimizer_state, optimizer_state
from worker.trainer import LocalTrainer, pick_device

log = logging.getLogger(__name__)

CONTROL_TIMEOUT = datetime.timedelta(days=365)  # followers wait as long as rank 0 pauses or waits
STOP_TIMEOUT = datetime.timedelta(seconds=60)  # at the end, how long the ranks wait for each other to leave
_GO, _ABORT = 1, 0


class RoundAborted(Exception):
    """A follower's round ended early: rank 0's step hook raised (or the round was set aside)."""


def rank_device(requested: str, local_rank: int) -> torch.device:
    """This rank's device: cuda:LOCAL_RANK when CUDA is there (and not --device cpu), else the CPU."""
    single = ("Apple MPS is one device: run the worker as one process, without torchrun "
              "(or pass --device cpu for CPU processes)")
    if requested == "mps":
        raise RuntimeError(single)
    if requested in ("auto", "cuda") and torch.cuda.is_available():
        count = torch.cuda.device_count()
        if local_rank >= count:
            raise RuntimeError(f"process {local_rank} has no GPU of its own: torch sees {count} CUDA device(s); "
                               f"use torchrun --nproc-per-node {count} or fewer")
        return torch.device("cuda", local_rank)
    device = pick_device(requested)  # a --device cuda without CUDA is its error
    if device.type == "mps":
        raise RuntimeError(single)
    return device


def from_env(requested_device: str = "auto", environ: Mapping[str, str] | None = None) -> Session | None:
    """The torchrun process group this process belongs to, joined; None outside torchrun
    (WORLD_SIZE unset or 1): the worker is then one process, as always."""
    env = os.environ if environ is None else environ
    world = int(env.get("WORLD_SIZE") or 1)
    if world <= 1:
        return None
    if "RANK" not in env:
        raise RuntimeError(f"WORLD_SIZE is {world} but RANK is not set: start several processes with torchrun")
    rank = int(env["RANK"])
    local_rank = int(env.get("LOCAL_RANK", rank))
    local_world = int(env.get("LOCAL_WORLD_SIZE", world))
    if local_world != world:
        raise RuntimeError(f"one worker runs on one machine: this torchrun spans {world} processes, "
                           f"{local_world} of them here; use torchrun --nnodes 1 and one worker per machine")
    device = rank_device(requested_device, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world)
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    log.info("rank %d of %d on %s%s", rank, world, device, " (talks to the coordinator)" if rank == 0 else "")
    return Session(rank=rank, world=world, device=device, control=control)


class _Sync:
    """The GradSync of one round on one rank (shared/algorithms/inner.py)."""

    def __init__(self, session: Session, batch_size: int) -> None:
        self.session = session
        n, r = session.world, session.rank
        self.lo, self.hi = r * batch_size // n, (r + 1) * batch_size // n
        self.weight = (self.hi - self.lo) / batch_size
        self.aborted = False

    def rows(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x[self.lo:self.hi], y[self.lo:self.hi]

    def all_reduce(self, model: torch.nn.Module, loss: torch.Tensor) -> float:
        params = list(model.parameters())
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads] + [loss.detach().reshape(1).to(grads[0].dtype)])
        flat.mul_(self.weight)  # each rank's mean over its rows, weighted by its share of the batch
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for p, g in zip(params, grads, strict=True):
            if p.grad is None:
                p.grad = g
            p.grad.copy_(flat[offset:offset + g.numel()].view_as(p))
            offset += g.numel()
        return flat[-1].item()

    def step_done(self, ok: bool) -> None:
        if self.session.leader:
            self.session._bcast(torch.tensor([_GO if ok else _ABORT], dtype=torch.int64))
            self.aborted = not ok
        elif int(self.session._bcast(torch.zeros(1, dtype=torch.int64)).item()) != _GO:
            raise RoundAborted


class Session:
    """This process's place in the torchrun group, and the messages between rank 0 and the others.
    Messages are JSON and plain tensors (no pickle), broadcast from rank 0 over the gloo group."""

    def __init__(self, *, rank: int, world: int, device: torch.device, control=None) -> None:
        self.rank, self.world, self.device = rank, world, device
        self.control = control
        self.in_round = False  # rank 0: the followers are inside a round's steps
        self.broken = False  # rank 0: a collective was left half-done; the followers cannot be told anything
        self.closed = False
        # a follower's replica (kept for tests and the logs; rebuilt from rank 0's message every round)
        self.model: TransformerLM | None = None
        self.opt: torch.optim.Optimizer | None = None
        self.rounds = 0  # rounds trained to the end (a follower's count)

    @property
    def leader(self) -> bool:
        return self.rank == 0

    # -- messages ---------------------------------------------------------------------------------

    def _bcast(self, t: torch.Tensor) -> torch.Tensor:
        dist.broadcast(t, src=0, group=self.control)
        return t

    def _send_json(self, obj: dict) -> None:
        raw = json.dumps(obj).encode()
        self._bcast(torch.tensor([len(raw)], dtype=torch.int64))
        self._bcast(torch.frombuffer(bytearray(raw), dtype=torch.uint8))

    def _recv_json(self) -> dict:
        n = int(self._bcast(torch.zeros(1, dtype=torch.int64)).item())
        return json.loads(self._bcast(torch.empty(n, dtype=torch.uint8)).numpy().tobytes())

    def _send_tensors(self, tensors: list[torch.Tensor]) -> None:
        """One flat broadcast per dtype (the receiver knows the shapes from the JSON before)."""
        for dtype in dict.fromkeys(t.dtype for t in tensors):
            self._bcast(torch.cat([t.detach().to("cpu").reshape(-1) for t in tensors if t.dtype == dtype]))

    def _recv_tensors(self, specs: list[tuple[list[int], str]]) -> list[torch.Tensor]:
        shapes = [(torch.Size(shape), getattr(torch, dtype)) for shape, dtype in specs]
        out: list[torch.Tensor | None] = [None] * len(shapes)
        for dtype in dict.fromkeys(d for _, d in shapes):
            which = [i for i, (_, d) in enumerate(shapes) if d == dtype]
            flat = self._bcast(torch.empty(sum(shapes[i][0].numel() for i in which), dtype=dtype))
            offset = 0
            for i in which:
                n = shapes[i][0].numel()
                out[i] = flat[offset:offset + n].view(shapes[i][0]).clone()
                offset += n
        return out  # type: ignore[return-value]

    # -- rank 0 -----------------------------------------------------------------------------------

    def check_lease(self, lease: protocol.Lease) -> None:
        """What several processes cannot train: a clear error before anything moves."""
        if ALGORITHMS[lease.algorithm].exchanges:
            raise RuntimeError(f"lease {lease.lease_id}: run {lease.run!r} uses {lease.algorithm}, whose exchanges "
                               f"this worker of {self.world} processes cannot apply on every rank alike; run "
                               "`idletrain worker run` as one process (without torchrun) for this run")
        if lease.inner.batch_size < self.world:
            raise RuntimeError(f"lease {lease.lease_id}: a batch of {lease.inner.batch_size} rows cannot be split "
                               f"across {self.world} processes; use torchrun --nproc-per-node "
                               f"{lease.inner.batch_size} or fewer")

    def lead_round(self, lease: protocol.Lease, model: TransformerLM, opt: torch.optim.Optimizer,
                   inner: InnerConfig, tokens: torch.Tensor, *, steps: int, generator: torch.Generator,
                   step_offset: int) -> _Sync:
        """Rank 0, as a round's steps start: send the followers everything they need for them."""
        if self.broken or self.closed:
            raise RuntimeError("the other processes of this worker are gone; restart the worker")
        params = get_params(model)
        ost = optimizer_state(model, opt)
        entries: list[list] = [["param", n, None] for n in params]
        tensors = list(params.values())
        for name, keyed in ost.tensors.items():
            for key, t in keyed.items():
                entries.append(["opt", name, key])
                tensors.append(t)
        entries += [["tokens", None, None], ["generator", None, None]]
        tensors += [tokens.reshape(-1), generator.get_state()]
        header = {"op": "round", "lease": lease.model_dump(mode="json"), "model": model.cfg.to_dict(),
                  "inner": inner.model_dump(mode="json"), "steps": steps, "step_offset": step_offset,
                  "scalars": ost.scalars, "groups": ost.groups,
                  "tensors": [[*e, list(t.shape), str(t.dtype).removeprefix("torch.")]
                              for e, t in zip(entries, tensors, strict=True)]}
        self.in_round = True  # from here on, a failure leaves the followers mid-message or mid-round
        try:
            self._send_json(header)
            self._send_tensors(tensors)
        except BaseException:
            self.broken = True
            raise
        return _Sync(self, lease.inner.batch_size)

    def end_round(self, sync: _Sync, ok: bool) -> None:
        """Rank 0, after its steps returned (ok) or raised: were the followers told?"""
        if ok or sync.aborted:
            self.in_round = False
        else:  # raised inside a step's computation: the followers wait in a collective rank 0 left
            self.broken = True

    def close(self) -> None:
        """Rank 0: tell the followers to exit (when they can still be told); every rank: leave the group."""
        if self.closed:
            return
        self.closed = True
        if self.leader and not self.broken:
            try:
                self._send_json({"op": "stop"})
                self._leave_together()
            except Exception as exc:  # noqa: BLE001 -- the followers are gone already
                log.warning("could not tell the other processes to stop (%s)", exc)
                self.broken = True
        if not self.broken and dist.is_initialized():
            dist.destroy_process_group()

    def _leave_together(self) -> None:
        """Every rank past the last message before any leaves the group: rank 0 destroying its
        groups while a follower still received the stop left gloo's threads mid-transfer, and at
        exit the process aborted ('terminate called without an active exception', exit -6)."""
        dist.monitored_barrier(group=self.control, timeout=STOP_TIMEOUT)

    # -- the other ranks --------------------------------------------------------------------------

    def follow(self, *, threads: int | None = None, on_round: Callable[[], None] | None = None) -> int:
        """A follower's life: train each round rank 0 sends, until it says stop. Returns the number of
        rounds trained to the end (on_round() runs after each). Never talks to the coordinator."""
        if threads:
            torch.set_num_threads(threads)
        for sig in (signal.SIGINT, signal.SIGTERM):  # rank 0 decides when the worker stops
            try:
                signal.signal(sig, signal.SIG_IGN)
            except ValueError:  # not the main thread (tests)
                pass
        # torch's first optimizer costs seconds (lazy imports): pay it now, while rank 0 prepares the
        # first round, not after its message, while rank 0 waits in the first all-reduce
        torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
        try:
            while True:
                msg = self._recv_json()
                if msg.get("op") == "stop":
                    break
                if msg.get("op") != "round":
                    raise RuntimeError(f"rank {self.rank}: unknown message {msg.get('op')!r} from rank 0")
                try:
                    self._follow_round(msg)
                    self.rounds += 1
                    if on_round is not None:
                        on_round()
                except RoundAborted:
                    log.info("rank %d: rank 0 ended lease %d early; waiting for the next round",
                             self.rank, msg["lease"]["lease_id"])
        except (RuntimeError, dist.DistError) as exc:
            self.closed = True
            raise RuntimeError(f"rank {self.rank} of this worker stops: {exc}") from exc
        log.info("rank %d: rank 0 stopped after %d rounds trained together", self.rank, self.rounds)
        self.closed = True
        self._leave_together()
        dist.destroy_process_group()
        return self.rounds

    def _follow_round(self, msg: dict) -> None:
        lease = protocol.Lease.model_validate(msg["lease"])
        cfg = ModelConfig.from_dict(msg["model"])
        inner = InnerConfig.model_validate(msg["inner"])
        specs = [(shape, dtype) for *_, shape, dtype in msg["tensors"]]
        received = self._recv_tensors(specs)
        params: dict[str, torch.Tensor] = {}
        saved = OptimizerState(tensors={}, scalars=msg["scalars"], groups=msg["groups"])
        tokens = generator_state = None
        for (kind, name, key, *_), t in zip(msg["tensors"], received, strict=True):
            if kind == "param":
                params[name] = t
            elif kind == "opt":
                saved.tensors.setdefault(name, {})[key] = t
            elif kind == "tokens":
                tokens = t
            elif kind == "generator":
                generator_state = t
        if self.model is None or self.model.cfg != cfg:
            self.model = build_model(cfg).to(self.device)
        set_params(self.model, {n: t.to(self.device) for n, t in params.items()})
        self.opt = make_optimizer(self.model, inner)
        load_optimizer_state(self.model, self.opt, saved)
        gen = torch.Generator()
        gen.set_state(generator_state)
        run_steps(self.model, self.opt, tokens, lease.inner, lr=lease.lr, steps=int(msg["steps"]), generator=gen,
                  step_offset=int(msg["step_offset"]), sync=_Sync(self, lease.inner.batch_size))


class LeadTrainer(LocalTrainer):
    """Rank 0's trainer: LocalTrainer, with each round's steps run across every rank of the session."""

    def __init__(self, session: Session, **kwargs) -> None:
        if not session.leader:
            raise ValueError("only rank 0 leads the rounds")
        super().__init__(session.device, **kwargs)
        self.session = session

    def train_round(self, lease: protocol.Lease, base, tokens: torch.Tensor, **kwargs):
        self.session.check_lease(lease)
        return super().train_round(lease, base, tokens, **kwargs)

    def run_local_steps(self, lease: protocol.Lease, tokens: torch.Tensor, *, steps: int,
                        generator: torch.Generator, step_offset: int,
                        on_step: Callable[[int, float], None]) -> list[float]:
        sync = self.session.lead_round(lease, self.model, self.opt, self.inner_cfg, tokens, steps=steps,
                                       generator=generator, step_offset=step_offset)
        try:
            losses = run_steps(self.model, self.opt, tokens, lease.inner, lr=lease.lr, steps=steps,
                               generator=generator, step_offset=step_offset, on_step=on_step, sync=sync)
        except BaseException:
            self.session.end_round(sync, ok=False)
            raise
        self.session.end_round(sync, ok=True)
        return losses
