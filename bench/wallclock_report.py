"""`bench wallclock`'s numbers and outputs: the best lr per row, time to fixed target losses, loss at
equal wall-clock, traffic, the captured-gain fraction; results.json, results.md and wallclock.png."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from bench.links import Link
from bench.numbers import sig


def loss_at(curve: Sequence[tuple[float, float]], t: float) -> float:
    """The loss at simulated time t, linear between evaluations; the last loss once the run is over."""
    if t <= curve[0][0]:
        return curve[0][1]
    for (t0, l0), (t1, l1) in zip(curve, curve[1:]):
        if t <= t1:
            return l0 if t1 == t0 else l0 + (l1 - l0) * (t - t0) / (t1 - t0)
    return curve[-1][1]


def time_to(curve: Sequence[tuple[float, float]], target: float) -> float | None:
    """The first simulated time the loss reaches target, linear between evaluations; None: never."""
    if curve[0][1] <= target:
        return curve[0][0]
    for (t0, l0), (t1, l1) in zip(curve, curve[1:]):
        if l1 <= target:
            return t1 if l0 == l1 else t0 + (t1 - t0) * (l0 - target) / (l0 - l1)
    return None


def captured(alone: float, method: float, ddp: float) -> float | None:
    """(alone - method) / (alone - ddp): the share of ddp's gain over one worker alone that the method
    keeps; None when ddp has not gained (the fraction means nothing)."""
    return None if alone - ddp <= 0 else sig((alone - method) / (alone - ddp), 3)


def summarise(trained: list, *, links: list[tuple[Link, ...]], meta: dict) -> dict:
    """trained: [(Row, [{"lr", "result", "traffic", "clock": [per link set]}])] -> results.json's dict."""
    rows = []
    for row, runs in trained:
        best = min(range(len(runs)), key=lambda i: runs[i]["result"].eval_loss)
        rows.append({"row": row.name, "pattern": row.pattern, "compressor": row.compressor, "best": best,
                     "runs": [_run_json(r) for r in runs]})
    ddp = next(r for r in rows if r["pattern"] == "ddp" and r["compressor"] is None)
    alone = next(r for r in rows if r["pattern"] == "alone")
    default = next((r for r in rows if r["row"].endswith("(default)")), ddp)
    ddp_final, alone_final = _best(ddp)["final_loss"], _best(alone)["final_loss"]
    targets = [sig(alone_final), sig((alone_final + ddp_final) / 2), sig(ddp_final)]
    panels = []
    for j, ls in enumerate(links):
        equal_s = _best(default)["clock"][j]["curve"][-1][0]
        ref = {name: loss_at(_best(r)["clock"][j]["curve"], equal_s) for name, r in (("ddp", ddp), ("alone", alone))}
        per_row = []
        for r in rows:
            curve = _best(r)["clock"][j]["curve"]
            at_equal = loss_at(curve, equal_s)
            per_row.append({"row": r["row"], "finish_s": sig(curve[-1][0]),
                            "time_to_targets_s": [sig(time_to(curve, x)) for x in targets],
                            "loss_at_equal_s": sig(at_equal),
                            "captured_gain_at_equal_s": captured(ref["alone"], at_equal, ref["ddp"])})
        panels.append({"links": ls[0].label(), "slowest_link": min(ls, key=lambda k: k.up_bps).label(),
                       "equal_s": sig(equal_s), "equal_s_is": f"{default['row']} finishing", "rows": per_row})
    for r in rows:
        b = _best(r)
        r["best_lr"], r["final_loss"] = b["lr"], b["final_loss"]
        r["captured_gain_at_equal_tokens"] = captured(alone_final, b["final_loss"], ddp_final)
    return {"meta": meta, "targets": targets, "rows": rows, "panels": panels}


def _best(row: dict) -> dict:
    return row["runs"][row["best"]]


def _run_json(run: dict) -> dict:
    r = run["result"]
    return {"lr": sig(run["lr"], 3), "final_loss": sig(r.eval_loss), "bytes_up_per_worker": int(r.bytes_up_per_worker),
            "bytes_down_per_worker": int(r.bytes_down_per_worker), "train_wall_s": round(r.wall_s, 1),
            "traffic": run["traffic"].as_json(), "curve_tokens": [[int(t), sig(loss)] for t, loss in r.curve],
            "clock": [{**{k: sig(v) if isinstance(v, float) else v for k, v in c.items() if k != "curve"},
                       "curve": [[sig(t), sig(loss)] for t, loss in c["curve"]]} for c in run["clock"]]}


def _s(x: float | None) -> str:
    if x is None:
        return "never"
    return f"{x:.3g} s" if x < 100 else f"{x:,.0f} s"


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def write_markdown(results: dict, path: Path) -> None:
    m = results["meta"]
    t = results["targets"]
    lines = [f"# Wall-clock, profile `{m['profile']}`", "",
             f"`{m['command']}`", "",
             f"{m['workers']} workers, {m['n_params']:,} parameters, {m['tokens_per_row']:,} tokens per row, "
             f"one worker step {m['step_s'] * 1000:.1f} ms ("
             + ("given by --step-ms" if m.get("step_s_from", "").startswith("--step-ms") else "calibrated once")
             + f", every row charged it; {m['torch_threads']} torch thread(s)); "
             + m.get("lr_note", f"lr sweep x{', x'.join(f'{f:g}' for f in m['lr_factors'])} of each row's tuned lr, "
                                "the best kept")
             + f". Target losses: {t[0]} (one worker alone's final), "
             f"{t[1]} (halfway), {t[2]} (ddp's final). Captured gain = (alone - row) / (alone - ddp).", "",
             "| row | best lr (final loss per lr) | final loss | captured gain, equal tokens | up / worker | "
             "down / worker |", "|---|---|---|---|---|---|"]
    for r in results["rows"]:
        sweep = ", ".join(f"{x['lr']:g}: {x['final_loss']:.3f}" for x in r["runs"])
        edge = " (edge)" if r["best"] in (0, len(r["runs"]) - 1) else ""
        b = r["runs"][r["best"]]
        lines.append(f"| {r['row']} | {r['best_lr']:g}{edge} ({sweep}) | {r['final_loss']:.3f} | "
                     f"{_f(r['captured_gain_at_equal_tokens'])} | {b['bytes_up_per_worker'] / 1e6:.2f} MB | "
                     f"{b['bytes_down_per_worker'] / 1e6:.2f} MB |")
    for p in results["panels"]:
        lines += ["", f"## Links {p['links']} (slowest {p['slowest_link']})", "",
                  f"Equal wall-clock: {_s(p['equal_s'])} ({p['equal_s_is']}).", "",
                  f"| row | finish | to {t[0]} | to {t[1]} | to {t[2]} | loss at {_s(p['equal_s'])} | "
                  "captured gain there |", "|---|---|---|---|---|---|---|"]
        for r in p["rows"]:
            to = " | ".join(_s(x) for x in r["time_to_targets_s"])
            lines.append(f"| {r['row']} | {_s(r['finish_s'])} | {to} | {r['loss_at_equal_s']:.3f} | "
                         f"{_f(r['captured_gain_at_equal_s'])} |")
    path.write_text("\n".join(lines) + "\n")


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = results["panels"]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.8), sharey=True, squeeze=False)
    lows = [r["final_loss"] for r in results["rows"]]
    for j, (ax, p) in enumerate(zip(axes[0], panels)):
        for r in results["rows"]:
            curve = r["runs"][r["best"]]["clock"][j]["curve"][1:]  # t = 0 has no place on a log axis
            ax.plot([c[0] for c in curve], [c[1] for c in curve], marker="o", markersize=2.5, label=r["row"])
        ax.set_xscale("log")
        ax.set_title(p["links"], fontsize=10)
        ax.set_xlabel("simulated wall-clock (s)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("held-out loss (nats/byte)")
    axes[0][0].set_ylim(min(lows) * 0.97, max(lows) * 1.25)
    axes[0][-1].legend(fontsize=7)
    fig.suptitle(f"python -m bench wallclock --profile {results['meta']['profile']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(results: dict, out: Path) -> None:
    """results.json, results.md and wallclock.png into out."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    write_markdown(results, out / "results.md")
    plot(results, out / "wallclock.png")


__all__ = ["captured", "loss_at", "plot", "summarise", "time_to", "write_markdown", "write_outputs"]
