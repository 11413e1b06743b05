"""The long convergence profile's captured gains, results.md and loss.png (bench/convergence_long.py)."""

from __future__ import annotations

import textwrap
from pathlib import Path


DEFAULT_ROWS = ("(default)", "(short-run defaults)")  # the rows of each replica count's panel beside ddp and alone


def _fmt(value, spec: str, none: str = "-") -> str:
    return none if value is None else format(value, spec)


def _probe_note(meta: dict) -> list[str]:
    if not meta.get("probe_batches"):
        return []
    batches = ", ".join(map(str, meta["probe_batches"]))
    return ["", (f"A probe: each row's B is its sequences per worker step ({batches}); a row at B trains "
                f"B / {meta['batch_per_worker']} times the tokens above, and is compared with ddp and alone at its B.")]


def add_gains(rows: list[dict]) -> None:
    """Per replica count, per-worker batch and seed: each row's loss over ddp's and its captured gain
    (alone - row) / (alone - ddp), ddp and alone each the best of its lrs (no baseline tuned down). A seed
    without its own ddp and lone worker is measured against seed 0's."""
    for m, b, seed in {(r["replicas"], r.get("batch"), r.get("seed", 0)) for r in rows}:
        group = [r for r in rows if r["replicas"] == m and r.get("batch") == b and r.get("seed", 0) == seed]
        bases = [r for r in rows if r["replicas"] == m and r.get("batch") == b and r["kind"] in ("ddp", "alone")]
        if not any(r.get("seed", 0) == seed for r in bases):
            seed = 0
        bases = [r for r in bases if r.get("seed", 0) == seed]
        ddp = min((r for r in bases if r["kind"] == "ddp"), key=lambda r: r["eval_loss"], default=None)
        alone = min((r for r in bases if r["kind"] == "alone"), key=lambda r: r["eval_loss"], default=None)
        for r in group:
            r["loss_ratio_vs_ddp"] = round(r["eval_loss"] / ddp["eval_loss"], 4) if ddp else None
            gap = alone["eval_loss"] - ddp["eval_loss"] if ddp and alone else 0.0
            r["captured_gain"] = (round((alone["eval_loss"] - r["eval_loss"]) / gap, 3)
                                  if gap > 0 and r["kind"] not in ("ddp", "alone") else None)


def write_markdown(rows: list[dict], meta: dict, path: Path) -> None:
    lines = [f"# Convergence, profile `{meta['profile']}`", "",
             (f"{meta['n_params']:,} parameters; every row trains {meta['tokens_per_row']:,} tokens "
             f"({meta['tokens_per_param']:g} per parameter): {meta['worker_steps']:,} local steps of "
             f"{meta['batch_per_worker']} x {meta['context']} tokens, split over the row's M workers; the short-run "
             f"defaults' H = {meta['H']} gives {meta['rounds_per_worker_at_max_replicas']} rounds per worker at "
             f"M = {max(meta['replicas'])}; the default is the regime the run's length calls for (shared/config.py "
             "choose_regime). Captured gain = (alone - row) / (alone - best ddp) at the same M; "
             "traffic reduction = ddp's bytes per worker (dense fp32 gradients up and down every step) / the row's."),
             *_probe_note(meta),
             "", ("| M | method | eval loss | x best ddp | captured gain | up / worker | down / worker | "
             "traffic reduction | merges | wall s |"), "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        gain = _fmt(r.get("captured_gain"), ".0%")
        reduction = _fmt(r["traffic_reduction_vs_ddp"], ".0f")
        lines.append(f"| {r['replicas']} | {r['method']} | {r['eval_loss']:.3f} | "
                     f"{_fmt(r.get('loss_ratio_vs_ddp'), '.3f')} | {gain} | {r['bytes_up_per_worker'] / 1e6:.2f} MB | "
                     f"{r['bytes_down_per_worker'] / 1e6:.2f} MB | {reduction}{'x' if reduction != '-' else ''} | "
                     f"{r['merges'] or '-'} | {r['wall_s']:.0f} |")
    path.write_text("\n".join(lines) + "\n")


def plot(rows: list[dict], path: Path, *, title: str) -> None:
    """One panel per replica count (ddp, alone, default), and one of the algorithms at the largest M."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = sorted({r["replicas"] for r in rows})
    top = max(counts)
    base_kinds = {"ddp", "alone"}
    panels = [(f"M = {m}", [r for r in rows if r["replicas"] == m and not r.get("seed") and (
        r["kind"] in base_kinds or r["method"].endswith(DEFAULT_ROWS))]) for m in counts]
    batches = sorted({r["batch"] for r in rows if r.get("batch")})
    if len(batches) > 1:  # a probe: one panel per batch, every row
        panels = [(f"M = {top}, B = {b}", [r for r in rows if r.get("batch") == b]) for b in batches]
    else:
        panels.append((f"M = {top}: the algorithms and the default (seed 0)",
                       [r for r in rows if r["replicas"] == top and r["kind"] != "alone" and not r.get("seed")]))
    # the legends go under the panels, each name wrapped to the panel's width, so that a panel of twenty curves
    # stays readable and no legend runs into its neighbour's
    def label(r: dict) -> str:
        return textwrap.fill(r["method"], 70)

    most = max(sum(label(r).count("\n") + 1 for r in group) for _, group in panels)
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4.4 + 0.12 * most), sharey=True)
    lows = [loss for r in rows for _, loss in r["curve"]]
    finals = [r["curve"][-1][1] for r in rows]
    strong = plt.get_cmap("tab20").colors
    colours = strong[0::2] + strong[1::2]  # the ten strong colours first, then their light twins
    for ax, (name, group) in zip(axes, panels):
        for i, r in enumerate(group):
            t, loss = zip(*r["curve"])
            ax.plot([x / 1e6 for x in t], loss, linewidth=1.2, label=label(r), color=colours[i % len(colours)],
                    linestyle=("-", "--")[i // len(colours) % 2])
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("tokens trained (millions)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.17), frameon=False)
    axes[0].set_ylabel("held-out loss (nats/token)")
    axes[0].set_ylim(min(lows) * 0.97, max(min(lows) * 1.5, max(finals) * 1.05))
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
