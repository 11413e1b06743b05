"""An in-process simulator of N workers training one model: every method on the same tokens,
with the same shared math (shared/algorithms) and the same wire format (shared/codec) as the
real coordinator and worker, so bytes counted here are the bytes that would travel.

Asynchrony is simulated with a clock: worker i finishes a round H / speed_i after it started,
deltas merge in finishing order, and a worker always restarts from the newest published model
(shared/algorithms/outer.py `published`), fetched as the real worker fetches it (worker/downloads.py
`Downloads.base`): version 0 built from the run's seed, then the int8 or int4 change since the copy it
holds, a full snapshot after sync.MAX_HOPS changes in a row. A round's lr is the schedule's at the
tokens delivered so far, as the coordinator leases it.
"""

from __future__ import annotations

import dataclasses
import heapq
import time
from collections.abc import Callable

import numpy as np
import torch

from bench.moments import MomentSchedule, MomentSync
from shared import codec
from shared.algorithms import sparta, sync
from shared.algorithms.compress import compress_with_feedback
from shared.algorithms.inner import make_optimizer, pseudo_gradient, run_steps, scheduled_lr
from shared.algorithms.outer import OuterState, apply_delta, published, staleness_weight
from shared.config import CompressionConfig, InnerConfig, OuterConfig
from shared.model import ModelConfig, build_model, count_params, evaluate_loss, get_params, set_params
from shared.snapshot import encode_snapshot


@dataclasses.dataclass(frozen=True)
class Setup:
    """What every method shares: model, data, worker count, token budget."""

    model: ModelConfig
    inner: InnerConfig  # batch size, peak lr, warm-up, etc. (steps is per-method H)
    workers: int
    steps_per_worker: int  # local steps each worker would take at equal speed
    train: torch.Tensor  # (N,) uint8
    eval: torch.Tensor  # (M,) uint8
    eval_points: int = 12
    seed: int = 0
    device: str = "cpu"  # where the replicas train and evaluate (compression, merging and the wire stay on the CPU)

    @property
    def total_steps(self) -> int:
        return self.workers * self.steps_per_worker

    @property
    def tokens_per_step(self) -> int:
        return self.inner.batch_size * self.model.context


@dataclasses.dataclass(frozen=True)
class Method:
    name: str
    kind: str  # ddp | alone | diloco | sparta | sparta+diloco
    H: int = 1  # local steps per outer round (diloco kinds)
    compression: CompressionConfig = CompressionConfig(index="dense", fraction=1.0, values="fp32",
                                                       error_feedback=False)
    outer: OuterConfig = OuterConfig()
    sparta_p: float = 0.0  # fraction exchanged per sparta step
    sparta_every: int = 1  # local steps between sparta exchanges
    sparta_values: str = "fp16"  # dtype of the exchanged values on the wire
    # how a worker gets a round's base: "update" as the real worker does (the int8 change since the copy it
    # holds, a full snapshot every sync.MAX_HOPS + 1 rounds), "feedback" (the change from the copy it holds to
    # the model, never a snapshot: see _Replica.fetch), or "snapshot" (the full model every round)
    down: str = "update"
    update_values: str = "int8"  # RunConfig.update_values: the values of those updates
    join: str = "seed"  # version 0: "seed" (built from the run's seed, as the real worker does) or "snapshot"
    speed_spread: float = 1.0  # diloco: worker speeds spread geometrically up to this factor (async merges)
    # diloco: a round starts only once every worker's previous delta is merged (synchronous DiLoCo, the
    # reference for the asynchronous merge; what idletrain never does, since a worker would wait)
    barrier: bool = False
    # diloco: each worker's H scaled by its speed, so every worker's round takes the same time (Async
    # Local-SGD's dynamic local steps, arXiv 2401.09135); False: every worker takes H steps a round
    dynamic_h: bool = False
    moments: MomentSchedule = MomentSchedule()  # diloco: DES-LOC's averaging of AdamW states (bench/moments.py)
    # diloco: InnerConfig.second_moment_workers, each worker's AdamW normalised for this many workers'
    # combined batch (shared/algorithms/group_adamw.py); 1: plain AdamW
    second_moment_workers: int = 1
    inner_lr_factor: float = 1.0  # the setup's inner lr times this (a row tuned apart from the others)


@dataclasses.dataclass
class Result:
    method: str
    curve: list[tuple[int, float]]  # (tokens trained, eval loss)
    eval_loss: float
    bytes_up_per_worker: float
    bytes_down_per_worker: float
    wall_s: float
    merges: int = 0
    mean_staleness: float = 0.0
    max_staleness: int = 0


class _Evaluator:
    def __init__(self, setup: Setup) -> None:
        self.model = build_model(setup.model).to(setup.device)
        self.tokens = setup.eval

    def __call__(self, params: dict[str, torch.Tensor]) -> float:
        set_params(self.model, params)
        return evaluate_loss(self.model, self.tokens, context=self.model.cfg.context)


def _lr(setup: Setup, tokens_done: int) -> float:
    return scheduled_lr(setup.inner, tokens_done=tokens_done, schedule_tokens=setup.total_steps * setup.tokens_per_step)


def run_ddp(setup: Setup, method: Method) -> Result:
    """One model on the combined batch (what averaging every gradient every step amounts to)."""
    t0 = time.perf_counter()
    inner = setup.inner.model_copy(update={"batch_size": setup.inner.batch_size * setup.workers})
    model = build_model(setup.model, seed=setup.seed).to(setup.device)
    opt = make_optimizer(model, inner)
    gen = torch.Generator().manual_seed(setup.seed)
    evaluate = _Evaluator(setup)
    steps = setup.steps_per_worker
    every = max(1, steps // setup.eval_points)
    curve = [(0, evaluate(get_params(model)))]
    done = 0
    while done < steps:
        n = min(every, steps - done)
        run_steps(model, opt, setup.train, inner, lr=_lr(setup, done * setup.workers * setup.tokens_per_step),
                  steps=n, generator=gen, step_offset=done)
        done += n
        curve.append((done * setup.workers * setup.tokens_per_step, evaluate(get_params(model))))
    dense = 4 * count_params(model) * steps
    return Result(method.name, curve, curve[-1][1], dense, dense, time.perf_counter() - t0)


def run_alone(setup: Setup, method: Method) -> Result:
    """The no-communication reference: one worker trains its own share of the tokens (1/N of the
    others') with the same steps and lr schedule as each worker of the other methods, and nothing
    travels (version 0 comes from the run's seed)."""
    t0 = time.perf_counter()
    init = get_params(build_model(setup.model, seed=setup.seed))
    r = _Replica(setup, 0, init)
    evaluate = _Evaluator(setup)
    steps = setup.steps_per_worker
    every = max(1, steps // setup.eval_points)
    curve = [(0, evaluate(init))]
    while r.steps < steps:
        n = min(every, steps - r.steps)
        r.train(setup, n, _lr(setup, r.steps * setup.workers * setup.tokens_per_step))
        curve.append((r.steps * setup.tokens_per_step, evaluate(get_params(r.model))))
    return Result(method.name, curve, curve[-1][1], 0.0, 0.0, time.perf_counter() - t0)


class _Replica:
    def __init__(self, setup: Setup, i: int, init: dict[str, torch.Tensor], *, second_moment_workers: int = 1) -> None:
        self.model = build_model(setup.model, seed=setup.seed).to(setup.device)
        set_params(self.model, init)
        self.opt = make_optimizer(self.model, setup.inner.model_copy(
            update={"second_moment_workers": second_moment_workers}))
        self.gen = torch.Generator().manual_seed(setup.seed * 1000 + i + 1)
        self.steps = 0
        self.rounds = 0  # rounds trained (diloco)
        self.residual: dict[str, torch.Tensor] = {}
        self.bytes_up = 0
        self.bytes_down = 0
        self.held: tuple[int, dict[str, torch.Tensor]] | None = None  # (version, the copy of it this worker holds)
        self.hops = 0  # updates applied since the last full snapshot

    def train(self, setup: Setup, n: int, lr: float) -> None:
        run_steps(self.model, self.opt, setup.train, setup.inner, lr=lr, steps=n, generator=self.gen,
                  step_offset=self.steps)
        self.steps += n

    def fetch(self, version: int, served: dict[int, dict[str, torch.Tensor]],
              method: Method) -> dict[str, torch.Tensor]:
        """The base of a round at `version`, got and counted as worker/downloads.py `Downloads.base` gets it;
        `served` holds the coordinator's published model of every version a worker may ask for."""
        if self.held is not None and self.held[0] == version:
            params = self.held[1]
        elif self.held is None and version == 0 and method.join == "seed":
            params = {n: t.clone() for n, t in served[0].items()}  # the run's seed gives the same weights
        elif self.held is not None and (method.down == "feedback" or method.down == "update"
                                        and self.hops < sync.MAX_HOPS):
            # "update": the change between the two published versions, so the copy's rounding adds up over
            # hops; "feedback": the change from the copy itself, so each update also carries the last one's
            # rounding (error feedback: the copy stays within one update's rounding of the model)
            old = self.held[1] if method.down == "feedback" else served[self.held[0]]
            blob = codec.encode(sync.model_update(old, served[version], from_version=self.held[0],
                                                  values=method.update_values))
            self.bytes_down += len(blob)
            params = {n: t.clone() for n, t in self.held[1].items()}
            sync.apply_update(params, codec.decode(blob, schema={n: tuple(t.shape) for n, t in params.items()}))
            self.hops += 1
        else:
            self.bytes_down += len(encode_snapshot(served[version]))
            params, self.hops = {n: t.clone() for n, t in served[version].items()}, 0
        self.held = (version, params)
        return params


def run_sparta(setup: Setup, method: Method, *, outer_every: int | None = None) -> Result:
    """Lock-step local AdamW on every replica; every `sparta_every` steps each replica swaps a
    seeded random fraction p of its parameters with the global model (shared/algorithms/sparta.py,
    exactly as the coordinator does it). With outer_every (sparta+diloco), every H steps each
    replica also sends its compressed pseudo-gradient, merged with the coordinator's rule, and
    restarts from the global model. The global model is what gets evaluated."""
    t0 = time.perf_counter()
    init = get_params(build_model(setup.model, seed=setup.seed))
    schema = {n: tuple(t.shape) for n, t in init.items()}
    replicas = [_Replica(setup, i, init) for i in range(setup.workers)]
    state = OuterState.fresh(init)
    outer = method.outer.model_copy(update={"group": setup.workers})
    bases = [{n: t.clone() for n, t in init.items()} for _ in replicas]
    evaluate = _Evaluator(setup)
    steps = setup.steps_per_worker
    every = max(1, steps // setup.eval_points)
    curve = [(0, evaluate(init))]
    served = {0: init}  # published model by version (one version per outer round)
    for r in replicas:
        r.fetch(0, served, method)  # joining
    for step in range(steps):
        lr = _lr(setup, step * setup.workers * setup.tokens_per_step)
        for i, r in enumerate(replicas):
            r.train(setup, 1, lr)
            if method.sparta_p > 0 and (step + 1) % method.sparta_every == 0:
                live = dict(r.model.named_parameters())
                sent = sparta.select(live, p=method.sparta_p, seed=sparta.exchange_seed(setup.seed * 7919 + i, step),
                                     values=method.sparta_values)
                body = codec.encode(sent)
                answer = codec.encode(sparta.mix_into_centre(state.params, codec.decode(body, schema=schema),
                                                             alpha=0.5, values=method.sparta_values))
                sparta.apply_correction(live, codec.decode(answer, schema=schema))
                r.bytes_up += len(body)
                r.bytes_down += len(answer)
        if outer_every and (step + 1) % outer_every == 0:
            for i, r in enumerate(replicas):
                pg = pseudo_gradient(bases[i], get_params(r.model))
                delta, r.residual = compress_with_feedback(pg, r.residual, method.compression, base_version=0,
                                                           round_seed=setup.seed * 100_003 + i * 7 + r.steps)
                body = codec.encode(delta)
                r.bytes_up += len(body)
                apply_delta(state, codec.decode(body, schema=schema), weight=1.0, cfg=outer)
            version = (step + 1) // outer_every
            served[version] = published(state, outer)
            for i, r in enumerate(replicas):
                bases[i] = {n: t.clone() for n, t in r.fetch(version, served, method).items()}
                set_params(r.model, bases[i])
        if (step + 1) % every == 0 or step + 1 == steps:
            curve.append(((step + 1) * setup.workers * setup.tokens_per_step, evaluate(published(state, outer))))
    up = float(np.mean([r.bytes_up for r in replicas]))
    down = float(np.mean([r.bytes_down for r in replicas]))
    return Result(method.name, curve, curve[-1][1], up, down, time.perf_counter() - t0)


def run_diloco(setup: Setup, method: Method, *, on_merge: Callable[[int], None] | None = None) -> Result:
    """Asynchronous DiLoCo as the coordinator runs it: each finished round is compressed with
    error feedback, encoded, and merged on arrival with the staleness-weighted delayed-Nesterov
    rule; the worker then restarts from the newest published model."""
    t0 = time.perf_counter()
    init = get_params(build_model(setup.model, seed=setup.seed))
    state = OuterState.fresh(init)
    version = 0
    replicas = [_Replica(setup, i, init, second_moment_workers=method.second_moment_workers)
                for i in range(setup.workers)]
    speeds = speeds_for(setup.workers, method.speed_spread)
    local = local_steps(method, speeds)
    moments = MomentSync(method.moments) if method.moments.active else None
    evaluate = _Evaluator(setup)
    budget = setup.total_steps * setup.tokens_per_step
    tokens_started = 0
    tokens_merged = 0
    curve = [(0, evaluate(init))]
    next_eval = budget / setup.eval_points
    schema = {n: tuple(t.shape) for n, t in init.items()}
    staleness: list[int] = []
    heap: list[tuple[float, int, int, bytes, int]] = []  # (finish time, worker, base version, delta, tokens)
    served = {0: init}  # the coordinator's published model of every version still held by a worker

    def start(i: int, now: float) -> None:
        nonlocal tokens_started
        r = replicas[i]
        if version not in served:
            served[version] = published(state, method.outer)
        base = {n: t.clone() for n, t in r.fetch(version, served, method).items()}
        for v in [v for v in served if v != version and all(x.held is None or x.held[0] != v for x in replicas)]:
            del served[v]
        set_params(r.model, base)
        # the coordinator's rule (coordinator/services/leases.py): the schedule's position is the tokens
        # delivered so far, not those still being trained in other workers' open rounds
        lr = _lr(setup, tokens_merged)
        r.train(setup, local[i], lr)
        r.rounds += 1
        tokens_started += local[i] * setup.tokens_per_step
        pg = pseudo_gradient(base, get_params(r.model))
        delta, r.residual = compress_with_feedback(pg, r.residual, method.compression, base_version=version,
                                                   round_seed=setup.seed * 100_003 + i * 7 + r.steps)
        body = codec.encode(delta)
        r.bytes_up += len(body)
        heapq.heappush(heap, (now + local[i] / speeds[i], i, version, body, local[i] * setup.tokens_per_step))

    waiting: list[int] = []  # barrier: workers done with this round
    for i in range(setup.workers):
        start(i, 0.0)
    while heap:
        now, i, base_version, body, tokens = heapq.heappop(heap)
        delta = codec.decode(body, schema=schema)
        s = version - base_version
        staleness.append(s)
        apply_delta(state, delta, weight=staleness_weight(s, method.outer), cfg=method.outer)
        version += 1
        tokens_merged += tokens
        if on_merge:
            on_merge(version)
        if moments:  # the round is over in simulated time: its AdamW state is the one it ended with
            moments.round_done(i, replicas[i])
        if tokens_merged >= next_eval or (not heap and tokens_started >= budget):
            curve.append((tokens_merged, evaluate(published(state, method.outer))))
            next_eval += budget / setup.eval_points
        if method.barrier:  # the synchronous reference: every worker waits for the round's last delta
            waiting.append(i)
            if not heap and tokens_started < budget:
                for j in waiting:
                    start(j, now)
                waiting.clear()
        elif tokens_started < budget:
            start(i, now)
    if curve[-1][0] != tokens_merged:
        curve.append((tokens_merged, evaluate(published(state, method.outer))))
    up = float(np.mean([r.bytes_up for r in replicas]))
    down = float(np.mean([r.bytes_down for r in replicas]))
    return Result(method.name, curve, curve[-1][1], up, down, time.perf_counter() - t0, merges=version,
                  mean_staleness=float(np.mean(staleness)) if staleness else 0.0,
                  max_staleness=max(staleness, default=0))


def run_method(setup: Setup, method: Method) -> Result:
    if method.inner_lr_factor != 1.0:
        setup = dataclasses.replace(setup, inner=setup.inner.model_copy(
            update={"lr": setup.inner.lr * method.inner_lr_factor}))
    if method.kind == "ddp":
        return run_ddp(setup, method)
    if method.kind == "alone":
        return run_alone(setup, method)
    if method.kind == "diloco":
        return run_diloco(setup, method)
    if method.kind == "sparta":
        return run_sparta(setup, method)
    if method.kind == "sparta+diloco":
        return run_sparta(setup, method, outer_every=method.H)
    raise ValueError(f"unknown method kind {method.kind!r}")


def local_steps(method: Method, speeds: tuple[float, ...]) -> tuple[int, ...]:
    """Each worker's local steps a round: H, or with dynamic_h H scaled by speed / mean speed (at least 1)."""
    if not method.dynamic_h:
        return (method.H,) * len(speeds)
    mean = sum(speeds) / len(speeds)
    return tuple(max(1, round(method.H * s / mean)) for s in speeds)


def ddp_bytes_per_worker(setup: Setup) -> float:
    """Dense fp32 gradients up and down every step, for one worker."""
    return 2 * 4 * count_params(build_model(setup.model)) * setup.steps_per_worker


def speeds_for(workers: int, spread: float) -> tuple[float, ...]:
    """Speeds spread geometrically from 1 to `spread` (the fastest is `spread` times the slowest)."""
    if workers == 1:
        return (1.0,)
    return tuple(float(spread ** (i / (workers - 1))) for i in range(workers))


__all__ = ["Method", "Result", "Setup", "ddp_bytes_per_worker", "local_steps", "run_method", "speeds_for"]
