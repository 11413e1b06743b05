"""The field's numbers from its rows: the lr each method keeps (validation slice), time to targets and loss
at equal wall-clock (test slice, read at evaluated points: a curve is a step function, never interpolated),
the speed-up of N volunteers over one, bytes per worker each way, intervals over seeds; results.json
(with its `summary` and the goals fixed before the run), results.md and loss.png."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from bench.numbers import sig

# fixed before the run (issue 35): 8 volunteers on 10/50 Mbit/s reach the lone worker's final loss >= 4x
# sooner than it; at equal wall-clock the default is below the best data-parallel row
GOALS = {"speedup_vs_alone": 4.0}
T95 = {1: 12.71, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def loss_at(curve: list[dict], t: float, key: str = "test") -> float | None:
    """The loss of the last evaluated point at or before `t` (None before the first)."""
    seen = [p[key] for p in curve if p["t"] <= t and p.get(key) is not None]
    return seen[-1] if seen else None


def time_to(curve: list[dict], target: float, key: str = "test") -> float | None:
    """When an evaluated point first reached `target` (None: never)."""
    return next((p["t"] for p in curve if p.get(key) is not None and p[key] <= target), None)


def interval(xs: list[float]) -> dict:
    """Mean and a 95% t-interval (none for one value)."""
    xs = [x for x in xs if x is not None]
    if not xs:
        return {"mean": None, "low": None, "high": None, "n": 0}
    mean = statistics.fmean(xs)
    if len(xs) < 2:
        return {"mean": sig(mean), "low": None, "high": None, "n": 1}
    half = T95.get(len(xs) - 1, 1.96) * statistics.stdev(xs) / math.sqrt(len(xs))
    return {"mean": sig(mean), "low": sig(mean - half), "high": sig(mean + half), "n": len(xs)}


def final(row: dict, key: str) -> float | None:
    points = [p[key] for p in row["curve"] if p.get(key) is not None]
    return points[-1] if points else None


def choose_lr(rows: list[dict]) -> float:
    """The lr whose rows end lowest on the validation slice (mean over seeds)."""
    by_lr: dict[float, list[float]] = {}
    for r in rows:
        v = final(r, "validation")
        by_lr.setdefault(r["lr"], []).append(v if v is not None and math.isfinite(v) else math.inf)
    return min(by_lr, key=lambda lr: statistics.fmean(by_lr[lr]))


def chosen_rows(rows: list[dict]) -> dict[str, list[dict]]:
    """Per method, its rows (one per seed) at the lr it keeps; idletrain's defaults need no choice."""
    out: dict[str, list[dict]] = {}
    for method in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == method]
        if method != "idletrain":
            lr = choose_lr(mine)
            mine = [r for r in mine if r["lr"] == lr]
        out[method] = sorted(mine, key=lambda r: r["seed"])
    return out


def summarise(rows: list[dict], meta: dict) -> dict:
    chosen = chosen_rows(rows)
    duration = meta["duration_s"]
    seeds = sorted({r["seed"] for r in rows})
    methods = {}
    alone = {r["seed"]: r for r in chosen.get("alone", [])}
    targets: dict[int, list[float]] = {}
    for seed in seeds:
        finals = [final(r, "test") for rs in chosen.values() for r in rs if r["seed"] == seed]
        finals = [f for f in finals if f is not None]
        if seed in alone and finals:
            first = alone[seed]["curve"][0]["test"]
            worst = max(finals)
            targets[seed] = sorted({sig(first - (first - worst) * 0.5), sig(worst), sig(final(alone[seed], "test"))},
                                   reverse=True)
    for method, rs in chosen.items():
        at_end = [loss_at(r["curve"], duration) for r in rs]
        to_targets = {}
        for r in rs:
            for i, target in enumerate(targets.get(r["seed"], [])):
                to_targets.setdefault(i, []).append(time_to(r["curve"], target))
        speed = []
        for r in rs:
            a = alone.get(r["seed"])
            if a is None:
                continue
            goal = final(a, "test")
            mine, theirs = time_to(r["curve"], goal), time_to(a["curve"], goal)
            speed.append(theirs / mine if mine and theirs else (0.0 if not mine else None))
        methods[method] = {
            "lr": rs[0]["lr"], "seeds": [r["seed"] for r in rs], "loss_at_equal_time": interval(at_end),
            "time_to_targets_s": {str(i): [sig(t) if t is not None else None for t in ts]
                                  for i, ts in to_targets.items()},
            "speedup_vs_alone": interval(speed),
            "bytes_up_per_worker": interval([r["bytes"]["up_mean"] for r in rs]),
            "bytes_down_per_worker": interval([r["bytes"]["down_mean"] for r in rs]),
            "coordinator_bytes": interval([r["bytes"]["coordinator_up"] + r["bytes"]["coordinator_down"] for r in rs]),
        }
    ddp = {m: v for m, v in methods.items() if m not in ("idletrain", "alone", "hivemind") and "free links" not in m}
    best_ddp = min(ddp, key=lambda m: ddp[m]["loss_at_equal_time"]["mean"] or math.inf) if ddp else None
    default = methods.get("idletrain")
    summary = {
        "speedup_vs_alone": default["speedup_vs_alone"]["mean"] if default else None,
        "speedup_vs_alone_ci": [default["speedup_vs_alone"]["low"], default["speedup_vs_alone"]["high"]]
        if default else None,
        "default_loss_at_equal_time": default["loss_at_equal_time"]["mean"] if default else None,
        "best_ddp": best_ddp,
        "best_ddp_loss_at_equal_time": ddp[best_ddp]["loss_at_equal_time"]["mean"] if best_ddp else None,
        "alone_loss_at_equal_time": methods["alone"]["loss_at_equal_time"]["mean"] if "alone" in methods else None,
        "hivemind_loss_at_equal_time": methods["hivemind"]["loss_at_equal_time"]["mean"] if "hivemind" in methods
        else None,
        "seeds": len(seeds),
    }
    met = {}
    if summary["speedup_vs_alone"] is not None:
        met["speedup_vs_alone"] = summary["speedup_vs_alone"] >= GOALS["speedup_vs_alone"]
    if summary["default_loss_at_equal_time"] is not None and summary["best_ddp_loss_at_equal_time"] is not None:
        met["below_best_ddp_at_equal_time"] = (summary["default_loss_at_equal_time"]
                                               < summary["best_ddp_loss_at_equal_time"])
    if summary["default_loss_at_equal_time"] is not None and summary["hivemind_loss_at_equal_time"] is not None:
        met["below_hivemind_at_equal_time"] = (summary["default_loss_at_equal_time"]
                                               < summary["hivemind_loss_at_equal_time"])
    summary["goals_met"] = met
    return {"meta": meta, "goals": {**GOALS, "below_best_ddp_at_equal_time": True,
                                    "below_hivemind_at_equal_time": True},
            "summary": summary, "targets": {str(s): t for s, t in targets.items()}, "methods": methods,
            "rows": rows}


def _f(x, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def _mb(x) -> str:
    return "-" if x is None else f"{x / 1e6:.1f}"


def write_markdown(results: dict, path: Path) -> None:
    m, s = results["meta"], results["summary"]
    lines = [f"# bench field ({m['profile']})", "",
             f"`{m['command']}`", "",
             f"{m['workers']} workers, each in its own network namespace at {m['links_mbit']['worker_up']} Mbit/s up / "
             f"{m['links_mbit']['worker_down']} down, the coordinator at {m['links_mbit']['coordinator']} Mbit/s; "
             f"latency: {m['latency']}. Every training process capped at {m['cpu_share']} of a core, the coordinator "
             f"(and the parameter server) at {m['coord_share']}. Model {m['model']}, batch {m['batch']}, "
             f"{m['duration_s']} s a row, seeds {m['seeds']}. Loss: nats/token on the test slice "
             f"({m['eval_tokens']} held-out tokens, the coordinator's eval split); lrs chosen on the validation slice.",
             "", "| method | lr | loss at equal time | speed-up to alone's final loss | up MB/worker | "
                 "down MB/worker | coordinator MB |", "|---|---|---|---|---|---|---|"]
    for name, v in results["methods"].items():
        loss, sp = v["loss_at_equal_time"], v["speedup_vs_alone"]
        ci = f" [{_f(loss['low'])}, {_f(loss['high'])}]" if loss["low"] is not None else ""
        spci = f" [{_f(sp['low'], 2)}, {_f(sp['high'], 2)}]" if sp["low"] is not None else ""
        speed = "not reached" if sp["mean"] == 0 else f"{_f(sp['mean'], 2)}x{spci}"
        lines.append(f"| {name} | {_f(v['lr'], 4) if v['lr'] else 'defaults'} | {_f(loss['mean'])}{ci} | "
                     f"{speed} | {_mb(v['bytes_up_per_worker']['mean'])} | "
                     f"{_mb(v['bytes_down_per_worker']['mean'])} | {_mb(v['coordinator_bytes']['mean'])} |")
    lines += ["", f"Targets (test loss, per seed): {results['targets']}; time to each, per method: see results.json.",
              "", f"Summary: {json.dumps(s)}", "",
              f"Goals (fixed before the run): {json.dumps(results['goals'])}", "",
              f"Rows tried (all kept in results.json): {len(results['rows'])}."]
    path.write_text("\n".join(lines) + "\n")


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for method, rs in chosen_rows(results["rows"]).items():
        for i, r in enumerate(rs):
            ts = [p["t"] for p in r["curve"]]
            ls = [p["test"] for p in r["curve"]]
            ax.step(ts, ls, where="post", label=method if i == 0 else None, lw=2.5 if method == "idletrain" else 1.2)
    ax.set_xlabel("wall-clock seconds (workers started at 0)")
    ax.set_ylabel("test loss (nats/token)")
    ax.set_title(f"bench field ({results['meta']['profile']}): {results['meta']['workers']} workers, 10/50 Mbit/s")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(results: dict, out: Path) -> None:
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    write_markdown(results, out / "results.md")
    plot(results, out / "loss.png")
