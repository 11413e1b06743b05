"""`python -m bench regime`: the run length from which the long-run defaults win (shared/config.py
LONG_RUN_STEPS, the rule by which a run's regime is chosen).

The long convergence profile's model, batch and 8 workers, trained over runs of several lengths (local
steps a worker, the lr decaying over each run's own tokens), with four rows at each length and seed: ddp,
one worker alone, the short-run defaults (H = 64, int4 both ways, outer lr 0.8 / Nesterov 0.2) and the
long-run configuration (bench/convergence_long.py long_run_method). A row's captured gain is (alone - row) /
(alone - ddp) at its length and seed, as in the long profile, whose own length (6,400 steps a worker) is
`bench convergence --profile long`. Rows run in `jobs` processes of one torch thread; the losses do not
depend on it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from statistics import mean

import torch

from bench.convergence_long import LONG_PROFILES, long_run_method, setup_for, short_run_method
from bench.sim import Method, run_method
from shared.config import LONG_RUN_STEPS

log = logging.getLogger(__name__)

WORKERS = 8
ROWS = ("ddp", "alone", "short", "long")


@dataclasses.dataclass(frozen=True)
class RegimeProfile:
    profile: str  # the long profile whose model, batch and lr each run takes
    lengths: tuple[int, ...]  # local steps a worker
    seeds: dict[int, tuple[int, ...]]  # per length; the lengths where the rows cross get two


PROFILES = {
    # ~25 CPU-minutes in all (12 minutes in 2 processes on an idle machine): 2 x (400 + 600 + 800) + 1,600 +
    # 3,200 steps a worker, four rows each
    "default": RegimeProfile("long", (400, 600, 800, 1600, 3200), {400: (0, 1), 600: (0, 1), 800: (0, 1)}),
    "tiny": RegimeProfile("long-tiny", (12,), {}),  # the tests'
}


@dataclasses.dataclass(frozen=True)
class Task:
    profile: str
    steps: int  # local steps a worker
    seed: int
    row: str  # one of ROWS


def method(task: Task) -> Method:
    p = LONG_PROFILES[task.profile]
    short = short_run_method(p, WORKERS)
    return {"ddp": Method("ddp", "ddp"), "alone": Method("1 worker alone", "alone"), "short": short,
            "long": long_run_method(short, WORKERS)}[task.row]


def train(task: Task) -> dict:
    """One row, in this process's torch threads."""
    p = dataclasses.replace(LONG_PROFILES[task.profile], worker_steps=task.steps * WORKERS)
    m = method(task)
    r = run_method(setup_for(p, WORKERS, seed=task.seed), m)
    return {"steps_per_worker": task.steps, "seed": task.seed, "row": task.row, "method": m.name,
            "eval_loss": round(r.eval_loss, 4),
            "bytes_per_worker": int(r.bytes_up_per_worker + r.bytes_down_per_worker),
            "wall_s": round(r.wall_s, 1), "curve": [[int(t), round(x, 4)] for t, x in r.curve]}


def _pooled(task: Task) -> dict:
    torch.set_num_threads(1)
    return train(task)


def summarise(rows: list[dict]) -> list[dict]:
    """Per length: each seed's captured gain of the short-run and long-run rows, their means, and which wins."""
    by = {(r["steps_per_worker"], r["seed"], r["row"]): r["eval_loss"] for r in rows}
    out = []
    for steps in sorted({r["steps_per_worker"] for r in rows}):
        gains: dict[str, list[float]] = {"short": [], "long": []}
        seeds = sorted({s for (n, s, _) in by if n == steps})
        for seed in seeds:
            alone, ddp = by.get((steps, seed, "alone")), by.get((steps, seed, "ddp"))
            for row in gains:
                loss = by.get((steps, seed, row))
                if None not in (alone, ddp, loss) and alone > ddp:
                    gains[row].append((alone - loss) / (alone - ddp))
        if gains["short"] and gains["long"]:
            short, long = mean(gains["short"]), mean(gains["long"])
            out.append({"steps_per_worker": steps, "seeds": seeds, "short_gain": [round(g, 3) for g in gains["short"]],
                        "long_gain": [round(g, 3) for g in gains["long"]], "short_mean": round(short, 3),
                        "long_mean": round(long, 3), "wins": "long" if long > short else "short",
                        "rule": "long" if steps >= LONG_RUN_STEPS else "short"})
    return out


def run(*, profile: str = "default", out: Path = Path("bench-results/regime"), jobs: int = 2,
        keep: bool = False) -> list[dict]:
    """Train every row (reusing those in out/results.json when `keep`); write results.json, results.md, gain.png."""
    rp = PROFILES[profile]
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    done = {(r["steps_per_worker"], r["seed"], r["row"]): r for r in
            (json.loads(path.read_text())["rows"] if keep and path.exists() else [])}
    tasks = [Task(rp.profile, n, s, row) for n in rp.lengths for s in rp.seeds.get(n, (0,)) for row in ROWS]
    todo = [t for t in tasks if (t.steps, t.seed, t.row) not in done]
    log.info("%d rows to train (%d kept), %d jobs", len(todo), len(tasks) - len(todo), jobs)
    t0 = time.perf_counter()
    rows = dict(done)
    with contextlib.ExitStack() as stack:
        if jobs > 1:
            results = stack.enter_context(ProcessPoolExecutor(jobs, mp_context=get_context("spawn"))).map(_pooled, todo)
        else:  # in this process (the tests)
            results = map(train, todo)
        for task, row in zip(todo, results):
            log.info("%d steps a worker, seed %d, %s: %.4f", task.steps, task.seed, task.row, row["eval_loss"])
            rows[task.steps, task.seed, task.row] = row
            _write(path, rp, rows, tasks, wall_s=None)  # resumable with keep
    ordered, summary = _write(path, rp, rows, tasks, wall_s=round(time.perf_counter() - t0, 1))
    from bench.regime_report import plot, write_markdown

    write_markdown(summary, ordered, out / "results.md", profile=profile)
    plot(summary, out / "gain.png", title=f"python -m bench regime --profile {profile}")
    return summary


def _write(path: Path, rp: RegimeProfile, rows: dict, tasks: list[Task], *,
           wall_s: float | None) -> tuple[list[dict], list[dict]]:
    """Write results.json; (its rows in the tasks' order, its summary)."""
    order = {(t.steps, t.seed, t.row): i for i, t in enumerate(tasks)}
    ordered = sorted(rows.values(), key=lambda r: order.get((r["steps_per_worker"], r["seed"], r["row"]), len(order)))
    meta = {"profile": rp.profile, "workers": WORKERS, "long_run_steps": LONG_RUN_STEPS, "wall_s": wall_s}
    summary = summarise(ordered)
    path.write_text(json.dumps({"meta": meta, "summary": summary, "rows": ordered}, indent=1) + "\n")
    return ordered, summary
