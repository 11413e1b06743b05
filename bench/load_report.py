"""What `python -m bench load` concludes and writes: whether each N holds the goal (p99 of leases
and uploads under GOAL_P99_MS, no errors), results.json, results.md and p99.png."""

from __future__ import annotations

import json
from pathlib import Path

from bench.load_client import REQUEST_TIMEOUT_S, TIMED_KINDS

GOAL_P99_MS = 100.0
GOAL_WORKERS = 1000


def write_results(out: Path, meta: dict, rows: list[dict]) -> dict:
    for r in rows:
        r["holds"] = bool(r["lease"]["p99_ms"] is not None and r["upload"]["p99_ms"] is not None
                          and r["lease"]["p99_ms"] < GOAL_P99_MS and r["upload"]["p99_ms"] < GOAL_P99_MS
                          and r["errors"] == 0 and r["upload"]["n"] > 0)
    held = [r["workers"] for r in rows if r["holds"]]
    goal = {"target_workers": GOAL_WORKERS, "target_p99_ms": GOAL_P99_MS, "largest_n_holding": max(held) if held
            else None, "met": bool(held and max(held) >= GOAL_WORKERS)}
    result = {"meta": meta, "goal": goal, "rows": rows}
    (out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "results.md").write_text(markdown(result) + "\n")
    plot(result, out / "p99.png")
    return result


def _fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and x >= 100:
        return f"{x:,.0f}"
    if isinstance(x, float):
        return f"{x:.3g}"
    return f"{x:,}" if isinstance(x, int) else str(x)


def markdown(result: dict) -> str:
    meta, goal = result["meta"], result["goal"]
    d = meta["delta"]
    pulled = "a 304 revalidation of the snapshot" if meta["pull"] == "304" else "the int8 update"
    procs = meta.get("processes", 1)
    lines = [f"# Coordinator load, `{meta['model']}` ({meta['n_params']:,} parameters), {meta['database']}"
             + (f", {procs} coordinator processes" if procs > 1 else ""),
             "",
             f"Each worker: lease -> pull (shard + {pulled} when the base version moved) -> think "
             f"{meta['think_s']:g} s x U(0.5, 1.5) -> upload a {d['delta_bytes']:,}-byte delta (random/seeded "
             f"indices, p = {meta['fraction']:g}, int8, k = {d['k']:,}). "
             f"Warm-up {meta['warmup_s']:g} s, measured {meta['duration_s']:g} s per N; {meta['shards']:,} shards; "
             f"{meta['cpus']} CPUs shared by the coordinator, {meta['database']} and the clients. Latency is "
             "client-side, request sent to answer read, in ms.",
             "",
             "| N | req/s | uploads/s (expected) | lease p50 / p95 / p99 | upload p50 / p95 / p99 | shard p99 | "
             "snapshot 304 p99 | errors | 429 | 204 | merge queue end | client CPU | loop lag p99 | coord CPU | "
             "PG CPU | drain s | holds |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        le, up = r["lease"], r["upload"]
        lines.append(
            f"| {r['workers']:,} | {_fmt(r['requests_per_s'])} | {_fmt(up['per_s'])} "
            f"({_fmt(r['expected_cycles_per_s'])}) | "
            f"{_fmt(le['p50_ms'])} / {_fmt(le['p95_ms'])} / {_fmt(le['p99_ms'])} | "
            f"{_fmt(up['p50_ms'])} / {_fmt(up['p95_ms'])} / {_fmt(up['p99_ms'])} | {_fmt(r['shard']['p99_ms'])} | "
            f"{_fmt(r['snapshot_304']['p99_ms'])} | {r['errors']} | {r['rate_limited_429']} | {r['no_work_204']} | "
            f"{_fmt(r['merge_queue_end'])} | {', '.join(_fmt(c) for c in r['client_cpu'])} | "
            f"{_fmt(r['loop_lag_p99_ms'])} | "
            f"{_fmt(r['coordinator_cpu'])} | {_fmt(r['postgres_cpu'])} | {_fmt(r['drain_s'])} | "
            f"{'yes' if r['holds'] else 'no'} |")
    lines += ["",
              f"- Goal: {goal['target_workers']:,} workers with p99 lease and upload latency under "
              f"{goal['target_p99_ms']:g} ms and zero errors: **{'met' if goal['met'] else 'not met'}**; the largest "
              f"N that holds here: **{goal['largest_n_holding'] if goal['largest_n_holding'] else 'none'}**.",
              f"- Delta bodies: codec.encode with the entries reused {_fmt(d['encode_reused_entries_ms'])} ms per "
              f"upload (a variant's values at the lease's seeds); the whole compress + encode from a dense pseudo-gradient "
              f"{_fmt(d['compress_and_encode_ms'])} ms.",
              f"- grant_lease's shard pick (the first pending shard by times_trained, index) among "
              f"{meta['shard_scan_ms']['rows']:,} shards: {_fmt(meta['shard_scan_ms']['median_ms'])} ms for that "
              f"query alone (from another connection).",
              "- CPU columns are shares of one core over the measured window (client: each client process); "
              "merge queue: acknowledged deltas not merged yet (the merger is not what this measures); drain s: "
              "seconds after the clients stopped until the coordinator answered /status again (it keeps working "
              f"through requests whose clients gave up after {meta['request_timeout_s']:g} s: those count as errors "
              "at that latency).",
              f"- Run created in {meta['run_create_s']:g} s (setup); whole benchmark {meta['total_wall_s']:g} s."]
    for r in result["rows"]:
        pg = r.get("pg_sessions")
        if pg and pg.get("samples"):
            waits = "; ".join(f"`{q}` x{c}" for q, c in pg["lock_waits_by_statement"].items()) or "none"
            lines.append(f"- N = {r['workers']:,}, PostgreSQL sessions of the database (mean / max over "
                         f"{pg['samples']} samples): active {_fmt(pg['mean_active'])} / {pg['max_active']}, waiting "
                         f"on a lock {_fmt(pg['mean_lock_wait'])} / {pg['max_lock_wait']}, idle in transaction "
                         f"{_fmt(pg['mean_idle_in_transaction'])} / {pg['max_idle_in_transaction']}; waiting "
                         f"statements: {waits}.")
        for kind in TIMED_KINDS:
            b = (r.get("phases") or {}).get(kind, {}).get("slowest_1pct")
            if b:
                top = ", ".join(f"{name} {_fmt(ms)}" for name, ms in list(b["phases_ms"].items())[:5])
                lines.append(f"- N = {r['workers']:,}, the slowest 1% of {kind}s ({b['n']}, mean "
                             f"{_fmt(b['client_ms'])} ms): in the coordinator {_fmt(b['server_ms'])} ms ({top}; "
                             f"unnamed {_fmt(b['unnamed_ms'])}), outside it {_fmt(b['outside_ms'])} ms "
                             "(Server-Timing).")
        if r["error_samples"]:
            lines.append(f"- N = {r['workers']:,}, first errors: " + "; ".join(
                f"`{e[:120]}`" for e in r["error_samples"][:3]))
    if meta.get("not_run"):
        lines.append(f"- Not run: N = {', '.join(str(n) for n in meta['not_run'])} (the coordinator stopped "
                     "answering).")
    p = meta.get("update_probe")
    if p and p.get("status") == 200:
        lines.append(f"- One incremental update {p['from']} -> {p['to']}: {p['bytes']:,} bytes, first GET (built from "
                     f"two snapshots) {p['first_s']:g} s, again {p['again_s']:g} s.")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    ns = [r["workers"] for r in rows]
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for kind, color in (("lease", "tab:blue"), ("upload", "tab:orange")):
        for q, style, alpha in (("p99_ms", "o-", 1.0), ("p50_ms", "o:", 0.6)):
            pts = [(n, r[kind][q]) for n, r in zip(ns, rows) if r[kind][q]]  # an N without answers has none
            if pts:
                ax.plot(*zip(*pts), style, color=color, alpha=alpha, label=f"{kind} {q[:3]}")
    ax.axhline(GOAL_P99_MS, color="red", linestyle="--", linewidth=1, label=f"goal: p99 < {GOAL_P99_MS:g} ms")
    meta = result["meta"]
    timeout_ms = 1000 * meta.get("request_timeout_s", REQUEST_TIMEOUT_S)
    ax.axhline(timeout_ms, color="gray", linestyle=":", linewidth=1,
               label=f"client timeout {timeout_ms / 1000:g} s (timed-out requests count at it, as errors)")
    for n in meta.get("not_run") or []:
        ax.axvline(n, color="gray", linewidth=1)
        ax.annotate(f"N = {n:,}: not run\n(coordinator unresponsive)", (n, timeout_ms), fontsize=7,
                    ha="right", va="top", xytext=(-4, -4), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("simulated workers N (log)")
    ax.set_ylabel("latency, ms (log)")
    ax.set_title(f"python -m bench load: {meta['model']}, {meta['database']}, think {meta['think_s']:g} s",
                 fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
