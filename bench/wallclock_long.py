"""`python -m bench wallclock --profile long`: the long convergence profile's curves on the clock.

Training the long profile takes hours on 2 cores and does not depend on the links, so this profile
does not train again: it reads `bench convergence --profile long`'s results.json (the rows at the
largest replica count, equal worker speeds), calibrates one worker step of that profile's model and
batch on this machine, and puts every row's curve on the same clocks as `bench wallclock`
(bench/wallclock_clock.py): ddp's ring all-reduce overlapped with backward, one worker alone, the
idletrain worker's rounds with their encoded bytes. ddp's lr sweep is the convergence profile's (x1
and x2); the other rows ran at the profile's lr. DES-LOC rows' state transfers are spread over their
rounds (they happen every few rounds, overlapped like a delta).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from bench.convergence_long import LONG_PROFILES, setup_for, tasks_for
from bench.links import Link
from bench.sim import Result
from bench.wallclock import DATACENTER, Row, calibrate_round_s, calibrate_step_s, link_sets
from bench.wallclock_clock import Compute, RowTraffic, clock_all
from bench.wallclock_report import summarise, write_outputs
from shared.model import build_model, count_params

DDP = "ddp fp32 (ring all-reduce, overlapped)"


def _result(row: dict) -> Result:
    return Result(row["method"], [tuple(c) for c in row["curve"]], row["eval_loss"], row["bytes_up_per_worker"],
                  row["bytes_down_per_worker"], row["wall_s"], merges=row.get("merges") or 0)


def trained_rows(conv: list[dict], profile: str) -> tuple[list[tuple[Row, list[dict]]], int]:
    """(rows as bench/wallclock.py's summarise takes them, before their clocks; replica count)."""
    p = LONG_PROFILES[profile]
    workers = max(p.replicas)
    methods = {t.method.name: (t.method, t.lr_factor) for t in tasks_for(profile) if t.replicas == workers}
    setup = setup_for(p, workers)
    n = count_params(build_model(p.model))
    ring = 2 * (workers - 1) / workers * 4 * n * setup.steps_per_worker
    ddp_runs, rows = [], []
    for r in conv:
        if r["replicas"] != workers or r["method"] not in methods or methods[r["method"]][0].speed_spread != 1.0:
            continue  # unequal speeds are a compute matter: the clock charges every worker one step time
        method, factor = methods[r["method"]]
        if r.get("seed", 0) or r["kind"] == "alone" and factor != 1.0:
            continue  # seed 0's rows, as the lr sweep is (another seed's clock is the same); one lone worker
        result = _result(r)
        if r["kind"] == "ddp":
            result.bytes_up_per_worker = result.bytes_down_per_worker = ring
            ddp_runs.append({"lr": p.lr * factor, "result": result,
                             "traffic": RowTraffic(payload_bytes_per_step=4 * n, allreduces=1)})
        elif r["kind"] == "alone":
            rows.append((Row(r["method"], method, "alone"), [{"lr": p.lr, "result": result, "traffic": RowTraffic()}]))
        else:
            rounds = setup.steps_per_worker // method.H
            traffic = RowTraffic(rounds=rounds, H=method.H, delta_bytes_up=result.bytes_up_per_worker,
                                 update_bytes_down=result.bytes_down_per_worker,
                                 extra_round_s=calibrate_round_s(setup, method))
            rows.append((Row(r["method"], method, "worker"),
                         [{"lr": p.lr * factor * method.inner_lr_factor, "result": result, "traffic": traffic}]))
    if not ddp_runs or not any(row.pattern == "alone" for row, _ in rows):
        raise ValueError(f"the convergence results hold no ddp or no lone-worker row at {workers} replicas: "
                         f"run `python -m bench convergence --profile {profile}` first")
    ddp_method = methods["ddp"][0]
    return [(Row(DDP, ddp_method, "ddp"), sorted(ddp_runs, key=lambda x: x["lr"])), *rows], workers


def run(*, source: Path, out: Path, up_mbps: tuple[float, ...] = (10.0, 100.0, 1000.0), down_ratio: float = 5.0,
        rtt_ms: float = 30.0, hetero: float = 1.0, coordinator_mbps: float | None = 1000.0,
        step_ms: float | None = None, threads: int | None = None, command: str = "") -> dict:
    if threads:
        torch.set_num_threads(threads)
    results_path, meta_path = source / "results.json", source / "meta.json"
    if not results_path.exists() or not meta_path.exists():
        raise FileNotFoundError(f"no long convergence results in {source}: run `python -m bench convergence "
                                f"--profile long --out {source}` first (hours on 2 cores)")
    conv_meta = json.loads(meta_path.read_text())
    profile = conv_meta["profile"]
    trained, workers = trained_rows(json.loads(results_path.read_text()), profile)
    p = LONG_PROFILES[profile]
    factors = [round(run["lr"] / p.lr, 3) for run in trained[0][1]]  # ddp's lr sweep
    setup = setup_for(p, workers)
    fastest_s, median_s = calibrate_step_s(setup)
    step_s = step_ms / 1000 if step_ms else fastest_s
    coordinator = Link.mbit(coordinator_mbps, coordinator_mbps, 0.0) if coordinator_mbps else None
    links = link_sets(up_mbps=list(up_mbps), down_ratio=down_ratio, rtt_ms=rtt_ms, workers=workers, hetero=hetero)
    compute = Compute(step_s=step_s, tokens_per_step=setup.tokens_per_step, workers=workers)
    clock_all(trained, compute, links, coordinator=coordinator)
    meta = {"profile": f"long (from {source})", "workers": workers, "n_params": conv_meta["n_params"],
            "steps_per_worker": setup.steps_per_worker, "tokens_per_row": conv_meta["tokens_per_row"],
            "batch_per_worker": p.batch, "context": p.model.context, "step_s": round(step_s, 5),
            "step_s_measured": {"fastest": round(fastest_s, 5), "median": round(median_s, 5)},
            "step_s_from": "--step-ms" if step_ms else "fastest calibrated step",
            "torch_threads": torch.get_num_threads(), "lr_factors": factors,
            "lr_note": f"ddp at x{', x'.join(f'{f:g}' for f in factors)} of the profile's lr (the best kept), every "
                       "other row at x1 unless its name says (the long convergence profile's rows)",
            "links": [ls[0].label() for ls in links], "datacenter_panel": DATACENTER.label(),
            "hetero_link_spread": hetero, "coordinator_mbps": coordinator_mbps, "command": command}
    results = summarise(trained, links=links, meta=meta)
    write_outputs(results, out)
    return results
