"""What `python -m bench load` measures besides the clients' latencies: CPU seconds of the
coordinator's process tree, of PostgreSQL and of the whole machine (from /proc), the sessions of
the database (pg_stat_activity, sampled on a thread), and the Server-Timing phases of the slowest
requests."""

from __future__ import annotations

import os
import statistics
import threading
import time
from pathlib import Path

from bench.numbers import pct, sig


def phase_breakdown(timed: list[tuple[float, dict[str, float]]], above_pct: float | None = None) -> dict | None:
    """Mean client latency of the requests (those at or above the `above_pct` percentile of latency, if
    given), split into the coordinator's Server-Timing phases (means, ms) and `outside`: client latency
    minus the server's total (the network, the event loops, the client itself)."""
    if above_pct is not None and timed:
        cut = pct([ms for ms, _ in timed], above_pct)
        timed = [t for t in timed if t[0] >= cut]
    timed = [t for t in timed if "total" in t[1]]  # answers without the header (an older coordinator)
    if not timed:
        return None
    names = sorted({name for _, ph in timed for name in ph if name != "total"})
    mean = {name: statistics.fmean(ph.get(name, 0.0) for _, ph in timed) for name in names}
    server = statistics.fmean(ph["total"] for _, ph in timed)
    return {"n": len(timed), "client_ms": sig(statistics.fmean(ms for ms, _ in timed)), "server_ms": sig(server),
            "outside_ms": sig(statistics.fmean(ms - ph["total"] for ms, ph in timed)),
            "unnamed_ms": sig(server - sum(mean.values())),  # in the server, outside every phase
            "phases_ms": {name: sig(v) for name, v in sorted(mean.items(), key=lambda kv: -kv[1])}}


def _proc_cpu_s(pid: int) -> float:
    """utime + stime of a process (all its threads), seconds; 0 when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of a process and its living descendants (`serve --processes N`: the supervisor's workers)."""
    parents: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parents[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    tree, frontier = {pid}, [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parents.items() if pp == p and c not in tree]
        tree.update(kids)
        frontier.extend(kids)
    return sum(_proc_cpu_s(p) for p in tree)


def postgres_cpu() -> dict[int, float]:
    """pid -> CPU seconds of every postgres process on this machine (empty if none is seen)."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if (d / "comm").read_text().strip().startswith("postgres"):
                out[int(d.name)] = _proc_cpu_s(int(d.name))
        except OSError:
            continue
    return out


def postgres_cpu_s(before: dict[int, float], after: dict[int, float]) -> float | None:
    """CPU seconds postgres used between two samples: per process, so backends that come and go do
    not count negative (a backend that exits in between loses its last stretch: a lower bound)."""
    if not before and not after:
        return None
    return sum(max(0.0, cpu - before.get(pid, 0.0)) for pid, cpu in after.items())


def machine_cpu() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]
    return sum(fields) - idle, sum(fields)


def pg_activity(db_url: str, t_end: float, period: float = 0.5) -> dict:
    """Sample pg_stat_activity of this database every `period` s until `t_end`, in a thread: how many
    of the coordinator's sessions run, wait for a lock, or sit idle inside a transaction, and which
    statements wait. Filled in as the thread goes; read it after t_end."""
    from sqlalchemy import create_engine, text

    out: dict = {}

    def sample() -> None:
        engine = create_engine(db_url, pool_size=1, max_overflow=0)
        counts: dict[str, list[int]] = {"active": [], "lock_wait": [], "idle_in_transaction": []}
        waiting: dict[str, int] = {}
        q = text("select state, wait_event_type, left(regexp_replace(query, '\\s+', ' ', 'g'), 70) "
                 "from pg_stat_activity where datname = current_database() and pid <> pg_backend_pid() "
                 "and backend_type = 'client backend'")
        try:
            with engine.connect() as conn:
                while time.monotonic() < t_end:
                    rows = conn.execute(q).all()
                    conn.rollback()
                    counts["active"].append(sum(1 for st, _, _ in rows if st == "active"))
                    counts["lock_wait"].append(sum(1 for st, w, _ in rows if st == "active" and w == "Lock"))
                    counts["idle_in_transaction"].append(sum(1 for st, _, _ in rows if st == "idle in transaction"))
                    for st, w, query in rows:
                        if st == "active" and w == "Lock":
                            waiting[query] = waiting.get(query, 0) + 1
                    time.sleep(period)
        finally:
            engine.dispose()
        n = len(counts["active"])
        out["summary"] = {"samples": n, **{f"mean_{k}": sig(statistics.fmean(v), 3) if v else None
                                            for k, v in counts.items()},
                          **{f"max_{k}": max(v) if v else None for k, v in counts.items()},
                          "lock_waits_by_statement": dict(sorted(waiting.items(), key=lambda kv: -kv[1])[:4])}

    out["thread"] = threading.Thread(target=sample, name="pg-activity", daemon=True)
    out["thread"].start()
    return out
