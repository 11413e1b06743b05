"""`bench regime`'s results.md and gain.png."""

from __future__ import annotations

from pathlib import Path

from shared.config import LONG_RUN_STEPS


def _gains(values: list[float]) -> str:
    return " / ".join(f"{g:.0%}" for g in values)


def write_markdown(summary: list[dict], rows: list[dict], path: Path, *, profile: str) -> None:
    lines = [f"# Regime: from which run length the long-run defaults win (profile `{profile}`)", "",
             "8 workers of the long convergence profile's model and batch; captured gain = (alone - row) / "
             "(alone - ddp) at the same length and seed. The rule (shared/config.py): the long-run defaults from "
             f"{LONG_RUN_STEPS} local steps a worker.", "",
             "| local steps a worker | seeds | short-run defaults | long-run configuration | wins | the rule gives |",
             "|---|---|---|---|---|---|"]
    for s in summary:
        lines.append(f"| {s['steps_per_worker']:,} | {', '.join(map(str, s['seeds']))} | {_gains(s['short_gain'])} "
                     f"(mean {s['short_mean']:.0%}) | {_gains(s['long_gain'])} (mean {s['long_mean']:.0%}) | "
                     f"{s['wins']} | {s['rule']} |")
    lines += ["", "| local steps a worker | seed | row | eval loss | bytes a worker | wall s |",
              "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['steps_per_worker']:,} | {r['seed']} | {r['method']} | {r['eval_loss']:.4f} | "
                     f"{r['bytes_per_worker'] / 1e6:.2f} MB | {r['wall_s']:.0f} |")
    path.write_text("\n".join(lines) + "\n")


def plot(summary: list[dict], path: Path, *, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    steps = [s["steps_per_worker"] for s in summary]
    for key, label, colour in (("short", "short-run defaults", "tab:blue"), ("long", "long-run configuration",
                                                                                   "tab:orange")):
        ax.plot(steps, [100 * s[f"{key}_mean"] for s in summary], marker="o", color=colour, label=f"{label} (mean)")
        for s in summary:
            ax.scatter([s["steps_per_worker"]] * len(s[f"{key}_gain"]), [100 * g for g in s[f"{key}_gain"]],
                       color=colour, alpha=0.35, s=14)
    ax.axvline(LONG_RUN_STEPS, color="grey", linestyle="--", label=f"the rule: long from {LONG_RUN_STEPS}")
    ax.set_xscale("log")
    ax.set_xlabel("local steps a worker (run length)")
    ax.set_ylabel("captured gain of ddp over one worker (%)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
