"""`python -m bench wallclock`: loss against simulated wall-clock time over home links.

Every row trains once per lr (x0.5, x1, x2 of the profile's tuned lr) in the convergence simulator
(bench/sim.py) or, for ddp with compressed gradients, in bench/wallclock_ddp.py, on the same model,
data and tokens. Training does not depend on the links (equal speeds), so each run's curve of loss
against tokens is then put on a clock for every link speed (bench/wallclock_clock.py): one step's
compute time calibrated once on this machine for every row, communication time from the bytes the
row encoded, overlapped as torch DDP or the idletrain worker does it (bench/links.py).
Writes results.json, results.md and wallclock.png (bench/wallclock_report.py).
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from pathlib import Path

import torch

from bench.convergence import Profile, methods_for
from bench.links import Link, spread_links
from bench.sim import Method, Result, Setup, run_method
from bench.wallclock_clock import Compute, RowTraffic, curve_on_links
from bench.wallclock_ddp import run_compressed_ddp
from bench.wallclock_report import summarise, write_outputs
from shared import codec
from shared.algorithms import sparta
from shared.algorithms.compress import compress_with_feedback
from shared.algorithms.inner import make_optimizer, run_steps
from shared.config import InnerConfig
from shared.data import load_corpus
from shared.model import ModelConfig, build_model, count_params, get_params

log = logging.getLogger(__name__)

LR_FACTORS = (0.5, 1.0, 2.0)


@dataclasses.dataclass(frozen=True)
class WallclockProfile:
    base: Profile  # model, steps, corpus, tuned lr, H: the convergence profile's fields
    workers: int


PROFILES = {
    # seconds: the tests' profile
    "tiny": WallclockProfile(Profile(ModelConfig(n_layer=1, n_head=2, d_model=16, context=16), steps_per_worker=8,
                                     corpus_max_bytes=1 << 16, eval_tokens=1 << 11, lr=1e-2, warmup_steps=2, H=4),
                             workers=3),
    # the convergence quick model, half its steps, 4 workers
    "quick": WallclockProfile(Profile(ModelConfig(n_layer=2, n_head=4, d_model=64, context=64), steps_per_worker=80,
                                      corpus_max_bytes=4 << 20, eval_tokens=1 << 15, lr=3e-3, warmup_steps=10, H=20),
                              workers=4),
    # the convergence quick profile itself: 8 workers, 160 steps each
    "default": WallclockProfile(Profile(ModelConfig(n_layer=2, n_head=4, d_model=64, context=64),
                                        steps_per_worker=160, corpus_max_bytes=4 << 20, eval_tokens=1 << 15, lr=3e-3,
                                        warmup_steps=20, H=40),
                                workers=8),
}


@dataclasses.dataclass(frozen=True)
class Row:
    """One row: how it trains (a sim Method, or ddp with a gradient compressor) and how it talks."""

    name: str
    method: Method
    pattern: str  # ddp (ring all-reduce every step) | alone | worker (idletrain rounds through a coordinator)
    compressor: str | None = None  # ddp rows: None (fp32), int8, powersgd


def rows_for(p: WallclockProfile, *, rank: int) -> list[Row]:
    methods = methods_for(p.base, workers=p.workers)
    ddp, alone = methods[0], methods[1]
    default = next(m for m in methods if m.name.endswith("(default)"))
    int8 = next(m for m in methods if m.kind == "diloco" and m.H == p.base.H // 2 and m.update_values == "int8"
                and m.compression.values == "int8" and not m.barrier and m.outer.lookahead)
    sparse = next(m for m in methods if m.kind == "sparta+diloco")
    return [
        Row("ddp fp32 (ring all-reduce, overlapped)", ddp, "ddp"),
        Row("ddp int8+EF gradients", ddp, "ddp", compressor="int8"),
        Row(f"ddp PowerSGD rank {rank}+EF", ddp, "ddp", compressor="powersgd"),
        Row(alone.name, alone, "alone"),
        Row(default.name, default, "worker"),
        Row(int8.name, int8, "worker"),
        Row(sparse.name, sparse, "worker"),
    ]


def calibrate_step_s(setup: Setup, *, steps: int = 20, warmup: int = 3) -> tuple[float, float]:
    """(fastest, median) seconds of one worker's step (forward, backward, AdamW) on its batch, over
    `steps` timed one by one after `warmup`. The fastest is what the clock charges every row: on a
    shared machine the median moves 2x with other jobs' load, the fastest step much less."""
    model = build_model(setup.model, seed=setup.seed)
    opt = make_optimizer(model, setup.inner)
    gen = torch.Generator().manual_seed(setup.seed)
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        run_steps(model, opt, setup.train, setup.inner, lr=setup.inner.lr, steps=1, generator=gen, step_offset=i)
        times.append(time.perf_counter() - t0)
    return min(times[warmup:]), statistics.median(times[warmup:])


def calibrate_round_s(setup: Setup, method: Method, *, repeats: int = 3) -> float:
    """Seconds to compress (with error feedback) and encode one round's delta under method's compression."""
    params = get_params(build_model(setup.model, seed=setup.seed))
    pg = {n: torch.randn_like(t) * 1e-3 for n, t in params.items()}
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        delta, _ = compress_with_feedback(pg, None, method.compression, base_version=0, round_seed=1)
        codec.encode(delta)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def exchange_bytes(setup: Setup, method: Method) -> tuple[int, int]:
    """(up, down) bytes of one sparta exchange under method: the same encoding bench/sim.py counts."""
    if method.sparta_p <= 0:
        return 0, 0
    params = get_params(build_model(setup.model, seed=setup.seed))
    sent = sparta.select(params, p=method.sparta_p, seed=sparta.exchange_seed(1, 0), values=method.sparta_values)
    answer = sparta.mix_into_centre({n: t.clone() for n, t in params.items()}, sent, alpha=0.5,
                                    values=method.sparta_values)
    return len(codec.encode(sent)), len(codec.encode(answer))


def train_row(setup: Setup, row: Row, *, rank: int) -> tuple[Result, RowTraffic]:
    """One training run of a row at setup's lr, and what its clock needs to know about its traffic."""
    n_params = count_params(build_model(setup.model))
    if row.pattern == "ddp" and row.compressor is not None:
        out = run_compressed_ddp(setup, row.name, compressor=row.compressor, rank=rank)
        return out.result, RowTraffic(payload_bytes_per_step=out.payload_bytes_per_step, allreduces=out.allreduces,
                                      extra_step_s=out.compress_s_per_step)
    r = dataclasses.replace(run_method(setup, row.method), method=row.name)
    if row.pattern == "ddp":  # sim.run_ddp counts 4P each way a step; on a ring a worker moves 2(N-1)/N of that
        ring = 2 * (setup.workers - 1) / setup.workers * 4 * n_params * setup.steps_per_worker
        return dataclasses.replace(r, bytes_up_per_worker=ring, bytes_down_per_worker=ring), RowTraffic(
            payload_bytes_per_step=4 * n_params, allreduces=1)
    if row.pattern == "alone":
        return r, RowTraffic()
    ex_up, ex_down = exchange_bytes(setup, row.method)
    steps = setup.steps_per_worker
    return r, RowTraffic(rounds=steps // row.method.H, H=row.method.H,
                         delta_bytes_up=r.bytes_up_per_worker - ex_up * steps,
                         update_bytes_down=r.bytes_down_per_worker - ex_down * steps,
                         exchange_bytes=(ex_up, ex_down), extra_round_s=calibrate_round_s(setup, row.method))


DATACENTER = Link.mbit(10_000, 10_000, 0.05)  # the reference panel: 10 Gbit/s each way, 50 us round trips


def link_sets(*, up_mbps: list[float], down_ratio: float, rtt_ms: float, workers: int,
              hetero: float) -> list[tuple[Link, ...]]:
    """One panel per uplink rate (downlink = down_ratio x up), then the datacenter's (equal links)."""
    return ([spread_links(Link.mbit(up, up * down_ratio, rtt_ms), workers, hetero) for up in up_mbps]
            + [(DATACENTER,) * workers])


def run(*, profile: str = "quick", out: Path = Path("bench-results/wallclock-quick"), workers: int | None = None,
        up_mbps: tuple[float, ...] = (10.0, 100.0, 1000.0), down_ratio: float = 5.0, rtt_ms: float = 30.0,
        hetero: float = 1.0, coordinator_mbps: float | None = 1000.0, rank: int = 4, threads: int | None = None,
        only: list[str] | None = None, step_ms: float | None = None, command: str = "") -> dict:
    """step_ms: one worker step's compute, ms (None: calibrated on this machine, calibrate_step_s)."""
    if profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r}: pick one of {sorted(PROFILES)}")
    if threads:
        torch.set_num_threads(threads)
    p = PROFILES[profile]
    if workers is not None:
        p = dataclasses.replace(p, workers=workers)
    t_start = time.perf_counter()
    corpus = load_corpus(max_bytes=p.base.corpus_max_bytes)
    base = Setup(model=p.base.model, inner=InnerConfig(lr=p.base.lr, warmup_steps=p.base.warmup_steps),
                 workers=p.workers, steps_per_worker=p.base.steps_per_worker, train=torch.from_numpy(corpus.train),
                 eval=torch.from_numpy(corpus.eval[: p.base.eval_tokens]))
    rows = rows_for(p, rank=rank)
    if only:
        rows = [r for r in rows if r.pattern in ("ddp", "alone") and r.compressor is None
                or any(o in r.name for o in only)]
    fastest_s, median_s = calibrate_step_s(base)
    step_s = step_ms / 1000 if step_ms else fastest_s
    log.info("one worker step: fastest %.4f s, median %.4f s; charged %.4f s", fastest_s, median_s, step_s)
    coordinator = Link.mbit(coordinator_mbps, coordinator_mbps, 0.0) if coordinator_mbps else None
    links = link_sets(up_mbps=list(up_mbps), down_ratio=down_ratio, rtt_ms=rtt_ms, workers=p.workers, hetero=hetero)
    compute = Compute(step_s=step_s, tokens_per_step=base.tokens_per_step, workers=p.workers)
    trained = []
    for row in rows:
        runs = []
        for factor in LR_FACTORS:
            setup = dataclasses.replace(base, inner=base.inner.model_copy(update={"lr": p.base.lr * factor}))
            log.info("running %s at lr %.2g", row.name, setup.inner.lr)
            result, traffic = train_row(setup, row, rank=rank)
            log.info("%s lr %.2g: eval loss %.4f, %.0f s", row.name, setup.inner.lr, result.eval_loss, result.wall_s)
            runs.append({"lr": setup.inner.lr, "result": result, "traffic": traffic,
                         "clock": [curve_on_links(result.curve, row.pattern, traffic, compute, ls,
                                                  coordinator=coordinator) for ls in links]})
        trained.append((row, runs))
    meta = {"profile": profile, "workers": p.workers, "n_params": count_params(build_model(p.base.model)),
            "steps_per_worker": p.base.steps_per_worker, "tokens_per_row": base.total_steps * base.tokens_per_step,
            "batch_per_worker": base.inner.batch_size, "context": p.base.model.context,
            "step_s": round(step_s, 5),
            "step_s_measured": {"fastest": round(fastest_s, 5), "median": round(median_s, 5)},
            "step_s_from": "--step-ms" if step_ms else "fastest calibrated step",
            "torch_threads": torch.get_num_threads(), "lr_factors": list(LR_FACTORS),
            "links": [ls[0].label() for ls in links], "datacenter_panel": DATACENTER.label(), "hetero_link_spread": hetero, "rank": rank,
            "coordinator_mbps": coordinator_mbps, "command": command}
    results = summarise(trained, links=links, meta=meta)
    results["meta"]["total_wall_s"] = round(time.perf_counter() - t_start, 1)
    write_outputs(results, out)
    return results


__all__ = ["LR_FACTORS", "PROFILES", "Row", "calibrate_step_s", "rows_for", "run", "train_row"]
