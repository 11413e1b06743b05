"""`python -m bench convergence --profile long`: the regime of the published parity results.

DiLoCo's scaling-law study (arXiv 2503.09799, Table 4) compares M replicas with data-parallel at
equal tokens, at >= 20 tokens per parameter and hundreds of outer rounds. The quick and full profiles
give each worker 4-5 rounds, too few for outer momentum to matter and too short for eight workers'
data to show. Here every row trains the same tokens (`worker_steps` local steps of `batch` sequences,
split over the row's workers), and for every replica count M in `replicas`:

- ddp: one model on the M workers' combined batch (M x batch sequences a step),
- one worker alone: the same steps as each of the M workers, 1/M of the tokens, nothing sent,
- the default: asynchronous DiLoCo exactly as bench/sim.py runs the coordinator's rule,

and at the largest M the algorithms measured against the default (`algorithm_methods`). A row's
captured gain is (alone - row) / (alone - ddp) at its M: the share of what M workers' data gives a
single worker that the row keeps. Rows run in `jobs` processes (one torch thread each); the losses do
not depend on jobs or load, only the wall times do.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import torch

from bench.convergence_long_report import add_gains, plot, write_markdown
from bench.moments import MomentSchedule
from bench.sim import Method, Result, Setup, ddp_bytes_per_worker, run_method
from shared.config import LONG_RUN, LONG_RUN_LR_FACTOR, CompressionConfig, InnerConfig, RunConfig, choose_regime
from shared.data import load_corpus
from shared.model import ModelConfig, build_model, count_params

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LongProfile:
    model: ModelConfig
    batch: int  # sequences per worker step
    worker_steps: int  # local steps of all workers together: M workers take worker_steps / M each
    H: int  # local steps per round of the default
    replicas: tuple[int, ...]
    lr: float
    warmup_steps: int
    corpus_max_bytes: int
    eval_tokens: int
    eval_points: int = 20
    # a probe of what bounds the captured gain: at one M, these per-worker batches side by side, each with
    # its own ddp and alone rows, and the probe's rows (probe_methods) instead of replicas x algorithms
    probe_batches: tuple[int, ...] = ()


LONG_PROFILES = {
    # 72,000 parameters, 256 tokens a step; 8 workers take 6,400 steps each: 100 rounds of H=64, 13.1M
    # tokens (182 per parameter). One row is 51,200 steps of one worker: ~8 min on one idle core.
    "long": LongProfile(ModelConfig(n_layer=2, n_head=4, d_model=48, context=64), batch=4, worker_steps=51_200,
                        H=64, replicas=(1, 2, 4, 8), lr=3e-3, warmup_steps=50, corpus_max_bytes=16 << 20,
                        eval_tokens=1 << 15),
    # The long profile's first 25 rounds at M = 8 (a quarter of its tokens), to find what bounds its captured
    # gain: the per-worker batch (4 or 16 sequences), synchronous rounds, the outer step's gain, H.
    "long-probe": LongProfile(ModelConfig(n_layer=2, n_head=4, d_model=48, context=64), batch=4,
                              worker_steps=12_800, H=64, replicas=(8,), lr=3e-3, warmup_steps=50,
                              corpus_max_bytes=16 << 20, eval_tokens=1 << 15, eval_points=10, probe_batches=(4, 16)),
    # the tests' profile: seconds
    "long-tiny": LongProfile(ModelConfig(n_layer=1, n_head=2, d_model=16, context=16), batch=2, worker_steps=48,
                             H=3, replicas=(1, 2, 4), lr=1e-2, warmup_steps=2, corpus_max_bytes=1 << 16,
                             eval_tokens=1 << 11, eval_points=3),
}


SEEDS = (1, 2)  # the repeats of the long profile's default and best rows (seed 0: every row)
MORE_SEEDS = (3, 4)  # and of the best row at >= 500x, whose mean sits at the goal's line
# every element at int2 (2.25 bits a value, error feedback): about half the bytes of the default's int4 a round
DENSE_INT2 = CompressionConfig(index="dense", values="int2", error_feedback=True)
# every element at int1 (1.125 bits a value) up and down; downloads with error feedback (sim.Method.down
# "feedback": each update is the change from the worker's own copy, never a snapshot). Without that feedback
# int1 updates add up their rounding until the next snapshot (probe, H=16: 17% at 323x against 29% at 444x).
INT1_BOTH_WAYS = {"compression": CompressionConfig(index="dense", values="int1", error_feedback=True),
                  "update_values": "int1", "down": "feedback"}
INT1_FEEDBACK = "int1 up and down, downloads with error feedback"
INT1_TUNED = ", outer lr 1.2, no momentum"  # what the int1 row at ~520x is run with again (seeds)
# that row again at lower inner lrs (the group's AdamW steps up to sqrt(N) further than each worker's): the
# first of them at every seed, with ddp and the lone worker at the same factor beside it. 0.7 won at seed 0
# and then at each of seeds 1-4: the long-run configuration's
LOWER_INNER_LRS = (0.7, 0.5)


def long_run_method(default: Method, workers: int, name: str | None = None) -> Method:
    """The long-run configuration (shared/config.py LONG_RUN: what a long run gets by default, and what
    deploy/run.long.toml spells out) from the short-run defaults' row: AdamW normalised for the workers' combined
    batch at 0.7x the inner lr, int1 both ways with downloads from the worker's copy, rounds of 19 (about 520x
    less traffic than ddp), outer lr 1.2 without momentum."""
    H, low = LONG_RUN["inner", "steps"], LONG_RUN_LR_FACTOR
    outer = {"lr": LONG_RUN["outer", "lr"], "momentum": LONG_RUN["outer", "momentum"]}
    name = name or (f"long-run configuration: group-normalised AdamW, H={H}, {INT1_FEEDBACK}{INT1_TUNED}, "
                    f"inner lr x{low:g}")
    return dataclasses.replace(default, name=name, H=H, second_moment_workers=workers, inner_lr_factor=low,
                               outer=default.outer.model_copy(update=outer), **INT1_BOTH_WAYS)


@dataclasses.dataclass(frozen=True)
class Task:
    profile: str
    replicas: int
    method: Method
    lr_factor: float = 1.0  # the profile's lr times this (the ddp baseline's sweep)
    batch: int | None = None  # sequences per worker step; None: the profile's
    seed: int = 0  # the run's seed: the model's initial weights and every worker's batches


def short_run_method(p: LongProfile, workers: int, label: str = "short-run defaults") -> Method:
    """The coordinator's defaults for a short run (regime "short"), with the profile's H."""
    d = RunConfig(name="defaults", regime="short")
    return Method(f"diloco H={p.H} int4+EF, int4 down ({label})", "diloco", H=p.H, compression=d.compression,
                  outer=d.outer.model_copy(update={"group": workers}), update_values=d.update_values)


def default_method(p: LongProfile, workers: int) -> Method:
    """What the coordinator runs when the run leaves its regime's fields out: the regime its length calls for
    (shared/config.py choose_regime, here M workers of `worker_steps / M` steps each)."""
    return regime_default(p.model, batch=p.batch, workers=workers, steps_per_worker=p.worker_steps // workers,
                          short=short_run_method(p, workers, "default"))


def regime_default(model: ModelConfig, *, batch: int, workers: int, steps_per_worker: int, short: Method) -> Method:
    """`short` (the short-run defaults' row) where the run's length calls for the short regime, else the
    long-run configuration, named as the default."""
    regime = choose_regime({"name": "defaults", "schedule_tokens": steps_per_worker * workers * batch * model.context,
                            "inner": {"batch_size": batch}, "outer": {"group": workers}, "model": model})
    if regime == "short":
        return short
    m = long_run_method(short, workers)
    return dataclasses.replace(m, name=f"diloco H={m.H} int1+EF both ways from the copy, group-normalised AdamW, "
                                       f"inner lr x{m.inner_lr_factor:g}, outer lr {m.outer.lr:g} (default)")


def shorter(p: LongProfile, factors: tuple[int, ...]) -> list[int]:
    """The profile's H divided by each factor (at least 1, each H once, longest first)."""
    return sorted({max(1, p.H // f) for f in factors}, reverse=True)


def int1_rounds(p: LongProfile) -> list[int]:
    """H for the int1 rows: the profile's H / 3, / 3.33 and / 4 (64: 21, 19, 16; about 580x, 520x and 440x
    less traffic than ddp), longest first."""
    return sorted({max(1, round(p.H / f)) for f in (3, 10 / 3, 4)}, reverse=True)


def int1_methods(p: LongProfile, grouped: Method, name: str) -> list[Method]:
    """`grouped` (the group-normalised row, named `name`) with int1 both ways at each of int1_rounds, and
    the one at ~520x (H / 3.33) again with outer lr 1.2 and no momentum."""
    int1 = [dataclasses.replace(grouped, name=f"{name}, H={h}, {INT1_FEEDBACK}", H=h, **INT1_BOTH_WAYS)
            for h in int1_rounds(p)]
    tuned = next(m for m in int1 if m.H == max(1, round(p.H * 3 / 10)))
    return int1 + [dataclasses.replace(tuned, name=f"{tuned.name}{INT1_TUNED}",
                                       outer=tuned.outer.model_copy(update={"lr": 1.2, "momentum": 0.0}))]


def algorithm_methods(p: LongProfile, workers: int) -> list[Method]:
    """What the literature says captures more, each against the short-run defaults at the same M and tokens."""
    default = short_run_method(p, workers)
    outer = default.outer
    rows = [dataclasses.replace(default, name=f"Nesterov 0.9, outer lr {lr:g}",
                                outer=outer.model_copy(update={"lr": lr, "momentum": 0.9})) for lr in (0.4, 0.7, 1.0)]
    rows.append(dataclasses.replace(default, name="Nesterov 0.9, outer lr 0.7, warm-up 10 rounds",
                                    outer=outer.model_copy(update={"lr": 0.7, "momentum": 0.9, "warmup": 10})))
    rows += [
        dataclasses.replace(default, name="DES-LOC: second moments averaged every 6 rounds",
                            moments=MomentSchedule(second=6)),
        dataclasses.replace(default, name="DES-LOC: first moments every 3 rounds, second every 6",
                            moments=MomentSchedule(first=3, second=6)),
    ]
    sparse = CompressionConfig(index="topk", fraction=0.02, values="int2", error_feedback=True, feedback_decay=0.95)
    rows.append(dataclasses.replace(default, name="SparseLoCo: top-2% int2, EF decay 0.95, outer lr 1 no momentum",
                                    compression=sparse, outer=outer.model_copy(update={"lr": 1.0, "momentum": 0.0})))
    group = dataclasses.replace(default, name=f"group-normalised AdamW (second_moment_workers {workers})",
                                second_moment_workers=workers)
    # and what it captures given more traffic: shorter rounds at the default's int4 (4x and 8x the bytes), and
    # at int2 both ways (2.25 bits a value: about half the bytes a round; int2 downloads are a simulator-only
    # setting, RunConfig.update_values takes int8 / int4)
    rows += [group] + [dataclasses.replace(group, name=f"{group.name}, H={h} ({p.H // h}x the rounds and traffic)",
                                           H=h) for h in shorter(p, (4, 8))]
    rows += [dataclasses.replace(group, name=f"{group.name}, H={h}, int2 up and down", H=h,
                                 compression=DENSE_INT2, update_values="int2") for h in shorter(p, (2, 4))]
    rows += int1_methods(p, group, group.name)
    rows += [
        dataclasses.replace(default, name="default, speeds 1-4x", speed_spread=4.0),
        dataclasses.replace(default, name="dynamic H (H x speed / mean), speeds 1-4x", speed_spread=4.0,
                            dynamic_h=True),
    ]
    return rows


def probe_methods(p: LongProfile, workers: int, batch: int) -> list[Method]:
    """The probe's rows beside the default at one batch: synchronous rounds (every worker waits for the
    round's last delta: asynchrony's cost), and at the smallest batch the outer step's gain, H, H / 2
    at 2-bit values (more rounds for about the same bytes), averaging every step in fp32 (what
    averaging can capture at all) with each worker's AdamW and with the group-normalised one, and the
    default with the group-normalised AdamW."""
    default = short_run_method(p, workers)
    rows = [dataclasses.replace(default, name="synchronous rounds", barrier=True)]
    if batch == min(p.probe_batches):
        outer = default.outer
        rows += [
            dataclasses.replace(default, name="outer gain 2 (lr 1.6, momentum 0.2)",
                                outer=outer.model_copy(update={"lr": 1.6})),
            dataclasses.replace(default, name="synchronous, Nesterov 0.9, outer lr 0.7", barrier=True,
                                outer=outer.model_copy(update={"lr": 0.7, "momentum": 0.9})),
            dataclasses.replace(default, name=f"synchronous, H={p.H // 4} (4x the rounds and traffic)",
                                barrier=True, H=p.H // 4),
        ]
        # twice the rounds in about the default's bytes: int2 (2.25 bits) instead of int4 (4.125) both ways;
        # int2 downloads are a simulator-only setting (RunConfig.update_values takes int8 / int4)
        half = p.H // 2
        rows += [
            dataclasses.replace(default, name=f"H={half}, int2 up and down (2x the rounds, ~the bytes)", H=half,
                                compression=DENSE_INT2, update_values="int2"),
            dataclasses.replace(default, name=f"H={half}, int2 up, int4 down", H=half, compression=DENSE_INT2),
        ]
        # the ceiling of averaging: synchronous, fp32 both ways, every single step (ddp's traffic and more),
        # with each worker's own AdamW and with AdamW normalised for the group (group_adamw.py)
        every = Method("synchronous fp32 averaging every step", "diloco", H=1, barrier=True, down="snapshot",
                       outer=outer.model_copy(update={"lr": 1.0, "momentum": 0.0}))
        group = f"group-normalised AdamW (second_moment_workers {workers})"
        rows += [every, dataclasses.replace(every, name=f"{every.name}, {group}", second_moment_workers=workers),
                 dataclasses.replace(default, name=group, second_moment_workers=workers)]
        # what the group-normalised AdamW captures against the bytes it is given: shorter rounds at int4,
        # and at int2 (about half the bytes a round) -- the captured gain as a function of traffic
        grouped = dataclasses.replace(default, second_moment_workers=workers)
        rows += [dataclasses.replace(grouped, name=f"{group}, H={h}", H=h) for h in shorter(p, (4, 8))]
        rows += [dataclasses.replace(grouped, name=f"{group}, H={h}, int2 up and down", H=h, compression=DENSE_INT2,
                                     update_values="int2") for h in shorter(p, (2, 4))]
        rows += int1_methods(p, grouped, group)
        # what the downloads' feedback is worth: int1 updates of the change between versions, re-synced by
        # a full snapshot every sync.MAX_HOPS + 1 (a simulator-only setting: RunConfig refuses int1 updates
        # without update_feedback)
        h = min(int1_rounds(p))
        rows.append(dataclasses.replace(grouped, name=f"{group}, H={h}, int1 up and down, downloads without "
                                        "feedback", H=h, **{**INT1_BOTH_WAYS, "down": "update"}))
    return rows


def _probe_tasks(profile: str, p: LongProfile) -> list[Task]:
    (m,) = p.replicas
    tasks = []
    for b in p.probe_batches:
        def named(method: Method, b: int = b) -> Method:
            return dataclasses.replace(method, name=f"B={b}: {method.name}")
        tasks += [Task(profile, m, named(Method("ddp", "ddp")), batch=b),
                  Task(profile, m, named(Method("ddp, lr x2", "ddp")), lr_factor=2.0, batch=b),
                  Task(profile, m, named(Method(f"1 worker alone (1/{m} of the tokens)", "alone")), batch=b),
                  Task(profile, m, named(short_run_method(p, m)), batch=b)]
        tasks += [Task(profile, m, named(x), batch=b) for x in probe_methods(p, m, b)]
    return tasks


def tasks_for(profile: str, *, algorithms: bool = True) -> list[Task]:
    p = LONG_PROFILES[profile]
    if p.probe_batches:
        return _probe_tasks(profile, p)
    tasks = []
    for m in p.replicas:
        tasks.append(Task(profile, m, Method("ddp", "ddp")))
        if m > 1:
            tasks.append(Task(profile, m, Method(f"1 worker alone (1/{m} of the tokens)", "alone")))
        default = default_method(p, m)
        tasks.append(Task(profile, m, default))
        if default.H != p.H:  # a long run: the short-run defaults beside the default
            tasks.append(Task(profile, m, short_run_method(p, m)))
    top = max(p.replicas)
    default = default_method(p, top)
    tasks.append(Task(profile, top, Method("ddp, lr x2", "ddp"), lr_factor=2.0))
    if algorithms:
        low = LOWER_INNER_LRS[0]  # ddp's lr sweep x{low} / x1 / x2, and the lone worker's x{low} / x1
        tasks += [Task(profile, top, Method(f"ddp, lr x{low:g}", "ddp"), lr_factor=low),
                  Task(profile, top, Method(f"1 worker alone (1/{top} of the tokens), lr x{low:g}", "alone"),
                       lr_factor=low)]
        methods = algorithm_methods(p, top)
        tasks += [Task(profile, top, m) for m in methods]
        tuned = next(m for m in methods if m.name.endswith(INT1_TUNED))
        # the tuned int1 row at lower inner lrs; at {low}x it is the long-run configuration, which is the default
        # where the profile's length calls for the long regime: then it is that row, at every seed
        lowered = [dataclasses.replace(tuned, name=f"{tuned.name}, inner lr x{f:g}", inner_lr_factor=f)
                   for f in LOWER_INNER_LRS]
        if default.inner_lr_factor == low:
            lowered[0] = default
        tasks += [Task(profile, top, m) for m in lowered if m is not default]
        tasks += [Task(profile, top, dataclasses.replace(lowered[0], name=f"{lowered[0].name}, seed {s}"), seed=s)
                  for s in (*SEEDS, *MORE_SEEDS)]
        # one run of a row carries seed noise as large as most differences between rows: the short-run defaults
        # and the best rows again at other seeds (other initial weights and batches), with ddp and the lone
        # worker at those seeds too, each seed's rows measured against its own
        repeated = [short_run_method(p, top)] + [m for m in methods if m.second_moment_workers > 1 and m.H == p.H]
        repeated += [m for m in methods if m.name.endswith(INT1_TUNED)]  # the best row at >= 500x
        repeated += [Method("ddp", "ddp"), Method(f"1 worker alone (1/{top} of the tokens)", "alone")]
        tasks += [Task(profile, top, dataclasses.replace(m, name=f"{m.name}, seed {s}"), seed=s)
                  for m in repeated for s in SEEDS]
        tasks += [Task(profile, top, dataclasses.replace(m, name=f"{m.name}, seed {s}"), seed=s)
                  for m in repeated if m.kind != "diloco" or m.name.endswith(INT1_TUNED) for s in MORE_SEEDS]
    return tasks


@functools.lru_cache(maxsize=2)
def _corpus(max_bytes: int):
    return load_corpus(max_bytes=max_bytes)


def setup_for(p: LongProfile, replicas: int, lr_factor: float = 1.0, batch: int | None = None,
              seed: int = 0) -> Setup:
    corpus = _corpus(p.corpus_max_bytes)
    inner = InnerConfig(lr=p.lr * lr_factor, warmup_steps=p.warmup_steps, batch_size=batch or p.batch)
    return Setup(model=p.model, inner=inner, workers=replicas, steps_per_worker=p.worker_steps // replicas,
                 train=torch.from_numpy(corpus.train), eval=torch.from_numpy(corpus.eval[: p.eval_tokens]),
                 eval_points=p.eval_points, seed=seed)


def run_task(task: Task, *, threads: int | None) -> Result:
    """One row, with `threads` torch threads (None: as set)."""
    if threads:
        torch.set_num_threads(threads)
    return run_method(setup_for(LONG_PROFILES[task.profile], task.replicas, task.lr_factor, task.batch, task.seed),
                      task.method)


def train(task: Task) -> Result:
    """One row in a pool process: one torch thread, so `jobs` rows share the cores."""
    return run_task(task, threads=1)


def key(replicas: int, method: str) -> str:
    return f"M={replicas}: {method}"


def row_for(task: Task, r: Result, *, dense_bytes: float) -> dict:
    moved = r.bytes_up_per_worker + r.bytes_down_per_worker
    return {"replicas": task.replicas, "batch": task.batch or LONG_PROFILES[task.profile].batch,
            "method": task.method.name, "kind": task.method.kind, "seed": task.seed,
            "lr": LONG_PROFILES[task.profile].lr * task.lr_factor * task.method.inner_lr_factor,
            "eval_loss": round(r.eval_loss, 4),
            "bytes_up_per_worker": int(r.bytes_up_per_worker), "bytes_down_per_worker": int(r.bytes_down_per_worker),
            "traffic_reduction_vs_ddp": round(dense_bytes / moved, 1) if moved and task.method.kind != "ddp" else None,
            "merges": r.merges, "wall_s": round(r.wall_s, 1),
            "curve": [[int(t), round(loss, 4)] for t, loss in r.curve]}


def run(*, profile: str = "long", out: Path = Path("bench-results/convergence-long"), jobs: int = 2,
        keep: bool = False, only: list[str] | None = None, algorithms: bool = True) -> list[dict]:
    """Train every task (or those whose name contains one of `only`), reusing rows already in
    out/results.json when `keep`; write results.json, results.md and loss.png."""
    if profile not in LONG_PROFILES:
        raise ValueError(f"unknown profile {profile!r}: pick one of {sorted(LONG_PROFILES)}")
    p = LONG_PROFILES[profile]
    out.mkdir(parents=True, exist_ok=True)
    # rows written before rows carried their batch were trained at the profile's
    kept = _load(out / "results.json") if keep else []
    done = {key(r["replicas"], r["method"]): {"batch": p.batch, **r} for r in kept}
    listed = tasks_for(profile, algorithms=algorithms)  # the results' order, whichever rows train now
    tasks = [t for t in listed
             if not only or t.method.kind in ("ddp", "alone") and not t.seed or any(o in t.method.name for o in only)]
    todo = [t for t in tasks if key(t.replicas, t.method.name) not in done]
    dense = {(m, b): ddp_bytes_per_worker(setup_for(p, m, batch=b))  # once per (replicas, batch)
             for m, b in {(t.replicas, t.batch) for t in tasks}}
    t0 = time.perf_counter()
    log.info("%d rows to train (%d kept), %d jobs", len(todo), len(tasks) - len(todo), jobs)
    rows = dict(done)
    with contextlib.ExitStack() as stack:
        if jobs > 1:
            pool = stack.enter_context(ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn")))
            results = pool.map(train, todo)
        else:  # in this process (the tests)
            results = map(functools.partial(run_task, threads=None), todo)
        for task, result in zip(todo, results):
            log.info("M=%d %s: eval loss %.4f, %.0f s", task.replicas, task.method.name, result.eval_loss,
                     result.wall_s)
            dense_bytes = dense[task.replicas, task.batch]
            rows[key(task.replicas, task.method.name)] = row_for(task, result, dense_bytes=dense_bytes)
            _save(out, rows, listed)  # a row is kept as soon as it is trained: an interrupted run resumes with --keep
    ordered = _save(out, rows, listed)
    n_params = count_params(build_model(p.model))
    setup = setup_for(p, max(p.replicas))
    meta = {"profile": profile, "n_params": n_params, "replicas": list(p.replicas), "H": p.H,
            "batch_per_worker": p.batch, "probe_batches": list(p.probe_batches), "context": p.model.context,
            "worker_steps": p.worker_steps,
            "tokens_per_row": setup.total_steps * setup.tokens_per_step,
            "tokens_per_param": round(setup.total_steps * setup.tokens_per_step / n_params, 1),
            "rounds_per_worker_at_max_replicas": setup.steps_per_worker // p.H, "jobs": jobs,
            "rows_trained_now": len(todo), "wall_s": round(time.perf_counter() - t0, 1),
            "rows_wall_s_sum": round(sum(r["wall_s"] for r in ordered), 1)}
    (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    write_markdown(ordered, meta, out / "results.md")
    plot(ordered, out / "loss.png", title=f"python -m bench convergence --profile {profile}")
    return ordered


def _load(path: Path) -> list[dict]:
    return json.loads(path.read_text()) if path.exists() else []


def _save(out: Path, rows: dict[str, dict], tasks: list[Task]) -> list[dict]:
    order = {key(t.replicas, t.method.name): i for i, t in enumerate(tasks)}
    ordered = sorted(rows.values(), key=lambda r: order.get(key(r["replicas"], r["method"]), len(order)))
    add_gains(ordered)
    (out / "results.json").write_text(json.dumps(ordered, indent=1) + "\n")
    return ordered
