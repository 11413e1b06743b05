"""What `python -m bench utilisation` writes besides results.json: results.md and utilisation.png."""

from __future__ import annotations

from pathlib import Path

GOAL = 0.97
DOWN_GOAL = 2.0  # issue 6: after joining, bytes down per round within 2x of bytes up


def markdown(r: dict) -> str:
    lines = [f"# Worker utilisation, upload throttled to {r['upload_kbps'] / 1000:g} Mbit/s", ""]
    if r["command"]:
        lines += [f"`{r['command']}`", ""]
    sent = r["sent_per_round_bytes"]
    lines += [f"One worker, {r['rounds']} rounds of {r['steps']} local steps (batch {r['batch']}, model of "
              f"{r['n_params']:,} parameters, {r.get('values', 'int8')} dense delta ~{(sent or 0) / 1e3:.0f} KB sent per "
              f"round, {r.get('update_values', 'int8')} model updates down), "
              f"{r['threads']} torch thread(s), {r['repeats']} repeat(s) per mode interleaved, each worker run "
              f"training a fresh run of its own from the same initial model; "
              f"{r['machine']['cpus']} CPUs, started {r['started_at']}, {r['seconds']:.0f} s in all.", "",
              "| mode | utilisation (median) | min-max | wall/round | compute/round | not computing/round "
              "| of it waiting for an upload | goal >= 97% |",
              "|---|---|---|---|---|---|---|---|"]
    for name, m in r["modes"].items():
        s = m["summary"]
        if "utilisation_median" not in s:
            lines.append(f"| {name}: {m['label']} | failed: {'; '.join(s['failed'])} |||||||")
            continue
        label = m["label"] + (" (coordinator patched to keep the uploading lease)" if m["patched_coordinator"]
                              else "")
        lines.append(f"| {name}: {label} | {100 * s['utilisation_median']:.1f}% | "
                     f"{100 * s['utilisation_min']:.1f}-{100 * s['utilisation_max']:.1f}% | "
                     f"{s['wall_per_round_s']:.2f} s | {s['compute_per_round_s']:.2f} s | "
                     f"{s['idle_per_round_s']:.2f} s | "
                     f"{s['upload_wait_per_round_s']:.2f} s | {'met' if s['goal_met'] else 'not met'} |")
    lines += ["", f"Bytes per round after joining (the one full snapshot of version 0 left out; goal: down within "
              f"{DOWN_GOAL:g}x of up):", "", "| mode | up / round | down / round | down / up | goal |",
              "|---|---|---|---|---|"]
    for name, m in r["modes"].items():
        s = m["summary"]
        if "down_over_up_after_join" in s:
            lines.append(f"| {name} | {s['sent_per_round_bytes'] / 1e3:.0f} KB | "
                         f"{s['received_per_round_after_join_bytes'] / 1e3:.0f} KB | "
                         f"{s['down_over_up_after_join']:.2f} | "
                         f"{'met' if s['down_over_up_after_join'] <= DOWN_GOAL else 'not met'} |")
    phases = sorted({p for m in r["modes"].values() for p in m["summary"].get("phase_per_round_s", {})})
    lines += ["", "Where a round's wall time goes, by the worker's phase (seconds per round, median; `training` "
              "includes what the trainer did besides steps: compressing the delta):", "",
              "| mode | " + " | ".join(phases) + " |", "|---|" + "---|" * len(phases)]
    for name, m in r["modes"].items():
        per = m["summary"].get("phase_per_round_s", {})
        lines.append(f"| {name} | " + " | ".join(f"{per.get(p, 0.0):.3f}" for p in phases) + " |")
    failures = [(n, e) for n, m in r["modes"].items() for e in m["summary"]["failed"]]
    if failures:
        lines += ["", "Failed runs: " + "; ".join(f"{n}: {e}" for n, e in failures)]
    lines += ["", f"Robust screening of the run: {r['robust'] or 'defaults'}.", ""]
    lines += ["", "Utilisation = time in the trainer's rounds / wall time from the first lease request to the last "
              "acknowledged upload, both counted by the worker (worker/progress.py `Utilisation`)."]
    if any(m["patched_coordinator"] for m in r["modes"].values()):
        lines += ["Mode `ahead` ran against a coordinator process patched by the benchmark to give no lease up "
                  "when the worker asks for its next one: the coordinator under test did not keep a lease whose "
                  "delta is still uploading."]
    else:
        lines += ["Every mode ran against the same, unpatched coordinator (it keeps a lease whose delta is still "
                  "uploading when the lease request names it)."]
    lines.append("")
    return "\n".join(lines)


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n, m in r["modes"].items() if "utilisation_median" in m["summary"]]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, name in enumerate(names):
        s = r["modes"][name]["summary"]
        ax1.bar(i, s["compute_per_round_s"], color="tab:green", label="computing" if i == 0 else None)
        ax1.bar(i, s["idle_per_round_s"], bottom=s["compute_per_round_s"], color="tab:red",
                label="not computing" if i == 0 else None)
        util = [100 * x["utilisation"] for x in r["modes"][name]["samples"] if "error" not in x]
        ax2.scatter([i] * len(util), util, color="tab:blue", zorder=3)
        ax2.bar(i, 100 * s["utilisation_median"], color="tab:blue", alpha=0.35)
    for ax in (ax1, ax2):
        ax.set_xticks(range(len(names)), names)
    ax1.set_ylabel("seconds per round (median)")
    ax1.legend()
    ax1.set_title("where a round's wall time goes")
    ax2.axhline(100 * r["goal"], color="black", linestyle="--", label=f"goal {100 * r['goal']:.0f}%")
    lo = min((100 * x["utilisation"] for m in r["modes"].values() for x in m["samples"] if "error" not in x),
             default=90.0)
    ax2.set_ylim(max(0.0, lo - 5), 100)
    ax2.set_ylabel("% of wall time computing")
    ax2.set_title(f"utilisation, upload {r['upload_kbps'] / 1000:g} Mbit/s")
    ax2.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
