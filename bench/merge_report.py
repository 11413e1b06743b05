"""What `python -m bench merge` concludes and writes: the goals (merges/s and the ratio to the bound),
results.md and stages.png."""

from __future__ import annotations

from pathlib import Path

from bench.numbers import sig

GOAL_MERGES_PER_S = 500.0
GOAL_X_BOUND = 3.0


def goals(rows: list[dict], bound_ms: float) -> dict:
    """The goals against the rows: the replay path per index kind (and merge_batch as the coordinator
    calls it), and the live path's merges/s."""
    replay = {r["index"]: r for r in rows if r["stage"].startswith("(f) RunRuntime.merge, replay (")}
    # merge_batch as the coordinator would call it: its default, no helper thread
    batch = {r["index"]: r for r in rows
             if r["stage"].startswith("(f) RunRuntime.merge_batch") and r["stage"].endswith("no helper thread")}
    live = next((r for r in rows if r["stage"].startswith("(f) RunRuntime.merge, live")), None)
    goal = {"target_merges_per_s": GOAL_MERGES_PER_S, "target_x_bound": GOAL_X_BOUND, "bound_ms": sig(bound_ms),
            "per_index": {kind: {"merges_per_s": r["merges_per_s"], "x_bound": r["x_bound"],
                                 "met": bool(r["merges_per_s"] >= GOAL_MERGES_PER_S and r["x_bound"] <= GOAL_X_BOUND)}
                          for kind, r in replay.items()},
            "batch_per_index": {kind: {"stage": r["stage"], "merges_per_s": r["merges_per_s"], "x_bound": r["x_bound"],
                                       "met": bool(r["merges_per_s"] >= GOAL_MERGES_PER_S
                                                   and r["x_bound"] <= GOAL_X_BOUND)}
                                for kind, r in batch.items()},
            "live_merges_per_s": live["merges_per_s"] if live else None}
    goal["met"] = bool(goal["per_index"]) and all(v["met"] for v in goal["per_index"].values())
    return goal


def _fmt(x: float | None) -> str:
    if x is None:
        return "-"
    if x >= 100:
        return f"{x:,.0f}"
    return f"{x:.3g}"


def markdown(result: dict) -> str:
    meta, goal = result["meta"], result["goal"]
    lines = [f"# Merge throughput, `{meta['model']}` ({meta['n_params']:,} parameters), p = {meta['fraction']:g}",
             "",
             f"k = {meta['k']:,} values per delta, {meta['deltas_per_index']} deltas per index kind, int8 values, "
             f"{meta['torch_threads']} torch thread(s), {meta['cpus']} CPUs, torch {meta['torch']}, "
             f"outer group {meta['outer_group']}; {meta['total_wall_s']:.0f} s in all. "
             "ms per delta is the mean (p50: the median) over the deltas; x bound = ms per delta / the bound "
             "(a bare `index_add_` of the same k into an n-element fp32 tensor, median).",
             "",
             "| stage | index | ms per delta | p50 ms | merges/s | x bound | note |",
             "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['stage']} | {r['index']} | {_fmt(r['ms_per_delta'])} | {_fmt(r['p50_ms'])} | "
                     f"{_fmt(r['merges_per_s'])} | {_fmt(r['x_bound'])} | {r['note']} |")
    lines.append("")
    for kind, v in goal["per_index"].items():
        lines.append(f"- Goal (>= {goal['target_merges_per_s']:.0f} merges/s and within {goal['target_x_bound']:g}x "
                     f"the bound), replay path, {kind} indices: **{'met' if v['met'] else 'not met'}**: "
                     f"{_fmt(v['merges_per_s'])} merges/s, {_fmt(v['x_bound'])}x the bound.")
    for kind, v in goal.get("batch_per_index", {}).items():
        lines.append(f"- Goal, batched replay ({v['stage'].removeprefix('(f) ')}), {kind} indices: "
                     f"**{'met' if v['met'] else 'not met'}**: {_fmt(v['merges_per_s'])} merges/s, "
                     f"{_fmt(v['x_bound'])}x the bound.")
    if goal["live_merges_per_s"] is not None:
        lines.append(f"- Live path (a snapshot per merge): {_fmt(goal['live_merges_per_s'])} merges/s.")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    colors = {"random": "tab:blue", "topk": "tab:orange", "-": "tab:gray"}
    labels = [f"{r['stage']}" + (f" [{r['index']}]" if r["index"] != "-" else "") for r in rows]
    values = [r["ms_per_delta"] for r in rows]
    fig, ax = plt.subplots(figsize=(11, 0.32 * len(rows) + 1.8))
    ax.barh(range(len(rows)), values, color=[colors.get(r["index"], "tab:gray") if r["x_bound"] is not None
                                              else "tab:green" for r in rows])
    ax.set_yticks(range(len(rows)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")
    bound = result["goal"]["bound_ms"]
    ax.axvline(bound, color="black", linestyle="--", linewidth=1, label=f"bound: bare index_add_, {bound:.3g} ms")
    ax.axvline(GOAL_X_BOUND * bound, color="black", linestyle=":", linewidth=1,
               label=f"{GOAL_X_BOUND:g}x the bound")
    ax.axvline(1000 / GOAL_MERGES_PER_S, color="red", linestyle="-.", linewidth=1,
               label=f"goal: {GOAL_MERGES_PER_S:.0f} merges/s")
    ax.set_xlabel("ms per delta (log scale)\nblue: random (seeded) indices, orange: topk (packed), gray: either, "
                  "green: Merger.step on SQLite (its own model, no x bound)", fontsize=8)
    meta = result["meta"]
    ax.set_title(f"python -m bench merge: {meta['model']} ({meta['n_params']:,} params), p = {meta['fraction']:g}, "
                 f"{meta['torch_threads']} thread(s)", fontsize=10)
    ax.grid(axis="x", alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.09), ncol=3)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
