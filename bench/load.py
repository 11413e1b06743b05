"""`python -m bench load`: N simulated workers against a real coordinator over loopback HTTP.

The coordinator runs as a subprocess (`idletrain coordinator serve`) on PostgreSQL (a fresh schema,
dropped after) or SQLite, with one run whose model is GPT-2 124M (or the small default model) and
whose compression is index "random" (seeded: only a seed travels), p = 0.1%, int8 values, so a
delta is ~120 KB at 124M. Creating the run (building the model, writing its ~460 MB snapshot) and
registering the workers is setup, not measured. IDLETRAIN_REGISTER_RATE=0 is set in the
coordinator's environment (registration is rate-limited per client address, and every simulated
worker comes from 127.0.0.1); every other setting is the default except IDLETRAIN_SNAPSHOT_KEEP,
IDLETRAIN_SNAPSHOT_EVERY and IDLETRAIN_CHECKPOINT_EVERY (kept snapshots: disk space, not a serving
path; a snapshot every 50 versions and a checkpoint every 500: what a 124M run's operator sets).

Each simulated worker is an asyncio task with its own token, doing what `idletrain worker run`
does per round, minus the training:

    lease   POST /runs/{run}/leases                       (204: no work, wait Retry-After; 429: rate limited)
    pull    GET  /runs/{run}/shards/{i}                   the lease's data shard (a few KB here)
            GET  /runs/{run}/snapshots/{base} If-None-Match: the ETag of that version -> 304
                 when the base version differs from the one the worker holds, standing in for the
                 model download (a 124M snapshot is ~460 MB; the worker is taken to hold it already).
                 With --pull update: GET /runs/{run}/updates/{held}/{base} instead (the int8 change,
                 built on demand by the coordinator: fine for the small model, tens of MB and seconds
                 of coordinator CPU per version pair at 124M, so not the default).
    think   sleep think_s * U(0.5, 1.5): the local training the round stands for (the lease is held)
    push    POST /leases/{id}/delta                       a valid encoded delta for the lease: 202

Deltas: the compressed entries (seeded indices, int8-quantised values) are built once per
variant (4 variants) in the parent, and each client process encodes `codec.encode(Delta(base,
entries))` once per (variant, base version) the first time a lease asks for it, then reuses the
bytes: the base version sits inside the zstd frame, so a body cannot be patched, but workers that
share a base version share the body. Both costs are measured and reported.

Workers are split over client processes (one asyncio loop each, `--clients`, default one per 500
workers); each reports its CPU use and event-loop lag over the measured window, so a saturated
client (which would inflate latencies) shows. Each N: workers start spread over one think time,
warm up for --warmup-s, then every request that starts within the next --duration-s is recorded;
requests in flight at the end are waited for. Writes results.json, results.md and p99.png.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import logging
import math
import multiprocessing
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.load_client import (API, KINDS, REQUEST_TIMEOUT_S, RUN, TIMED_KINDS, ClientJob, build_entries,
                               client_main, encode_costs, register)
from bench.load_coordinator import (COORDINATOR_ENV, DRAIN_LIMIT_S, PASSED_ENV, Database, coordinator_env,
                                    log_tail, probe_update, run_id_of, shard_scan_ms, stop, wait_status,
                                    write_corpus)
from bench.load_probes import machine_cpu, pg_activity, phase_breakdown, postgres_cpu, postgres_cpu_s, tree_cpu_s
from bench.load_report import write_results
from bench.numbers import pct, sig
from idletrain.harness import free_port, wait_healthy

log = logging.getLogger(__name__)

VARIANTS = 4  # distinct delta bodies per base version
WORKERS_PER_CLIENT = 500
SHARD_TOKENS = 2048  # > the 124M context (1024); a shard is ~1 KB compressed
EVAL_TOKENS = 2048
PULL_MODES = ("304", "update")
DEFAULT_PG_URL = os.environ.get("IDLETRAIN_TEST_POSTGRES", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


def model_configs():
    from bench.merge import PARAM_MODELS

    return {"gpt2-124m": PARAM_MODELS["gpt2-124m"], "small": PARAM_MODELS["small"]}


# -- the run -------------------------------------------------------------------------------------

def run(*, workers: list[int] = (10, 100, 1000), think_s: float = 10.0, duration_s: float = 60.0,
        warmup_s: float | None = None, database_url: str | None = DEFAULT_PG_URL, model: str = "gpt2-124m",
        fraction: float = 0.001, pull: str = "304", clients: int | None = None, shards: int | None = None,
        out: Path = Path("bench-results/load"), update_probe: bool = True, keep: bool = False,
        processes: int = 1) -> dict:
    """Run the benchmark at each N in `workers`; write results.json, results.md and p99.png under `out`."""
    models = model_configs()
    if model not in models:
        raise ValueError(f"unknown model {model!r}: pick one of {', '.join(models)}")
    if pull not in PULL_MODES:
        raise ValueError(f"unknown pull mode {pull!r}: pick one of {', '.join(PULL_MODES)}")
    workers = sorted(set(int(n) for n in workers))
    if not workers or workers[0] < 1:
        raise ValueError("--workers takes one or more positive counts")
    if processes < 1 or (processes > 1 and not database_url):
        raise ValueError("--processes takes 1 or more, and several processes need PostgreSQL")
    if think_s <= 0 or duration_s <= 0 or not 0 < fraction <= 1:
        raise ValueError("--think-s and --duration-s must be positive, --fraction in (0, 1]")
    warmup_s = think_s + 5.0 if warmup_s is None else warmup_s
    mcfg = models[model]
    n_max = max(workers)
    # Enough shards that no epoch ends during the benchmark: at an epoch's end no lease is granted
    # (204) until every leased shard is delivered.
    if shards is None:  # a cycle takes think_s on average (x U(0.5, 1.5)) plus the requests
        leases = sum(n * (warmup_s + duration_s + think_s) / max(think_s, 0.05) for n in workers)
        shards = int(1.1 * leases) + n_max + 64
    t_start = time.perf_counter()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="idletrain-load-"))
    try:
        with Database(database_url) as db:
            return _run(mcfg, model=model, workers=workers, think_s=think_s, duration_s=duration_s,
                        warmup_s=warmup_s, db=db, fraction=fraction, pull=pull, clients=clients, shards=shards,
                        out=out, tmp=tmp, update_probe=update_probe, t_start=t_start, processes=processes)
    finally:
        if keep:
            log.info("kept %s", tmp)
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def _run(mcfg, *, model: str, workers: list[int], think_s: float, duration_s: float, warmup_s: float, db: Database,
         fraction: float, pull: str, clients: int | None, shards: int, out: Path, tmp: Path, update_probe: bool,
         t_start: float, processes: int = 1) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    data_dir = tmp / "data"
    corpus = tmp / "corpus.txt"
    # load_corpus holds out the file's last 1/20 and cuts the rest into whole shards: `shards` of them
    corpus_bytes = max(math.ceil((shards * SHARD_TOKENS + SHARD_TOKENS // 2) / 0.95), 20 * EVAL_TOKENS + 4096)
    write_corpus(corpus, corpus_bytes)
    log_path = tmp / "coordinator.log"
    admin = {"Authorization": f"Bearer {(token := secrets.token_urlsafe(32))}"}  # through the environment
    log.info("starting the coordinator on %s (%s)", url, "PostgreSQL schema " + db.schema if db.url else "SQLite")
    proc = _serve(port=port, data_dir=data_dir, tmp=tmp, db=db, processes=processes, log_path=log_path, token=token)
    http = httpx.Client(base_url=url, timeout=600)
    try:
        wait_healthy(http, proc, 120)
        created, create_s = _create_run(http, admin, mcfg=mcfg, corpus=corpus, corpus_bytes=corpus_bytes,
                                        fraction=fraction)
        db_url = db.url or f"sqlite:///{(data_dir / 'idletrain.sqlite3').resolve()}"
        run_id = run_id_of(db_url)
        variants, costs = _variants(mcfg, fraction=fraction)
        tokens, ids = register(url, max(workers))
        scan = shard_scan_ms(db_url, run_id)
        meta = {"model": model, "model_config": mcfg.to_dict(), "n_params": created["n_params"],
                "fraction": fraction, "delta": costs, "database": "postgresql" if db.url else "sqlite", "pull": pull,
                "think_s": think_s, "warmup_s": warmup_s, "duration_s": duration_s, "shards": created["n_shards"],
                "shard_tokens": SHARD_TOKENS, "shard_scan_ms": scan, "run_create_s": round(create_s, 1),
                "request_timeout_s": REQUEST_TIMEOUT_S, "schema": db.schema,
                "coordinator_env": {**COORDINATOR_ENV, **{k: os.environ[k] for k in PASSED_ENV if k in os.environ}},
                "processes": processes, "cpus": os.cpu_count(), "python": sys.version.split()[0],
                "httpx": httpx.__version__,
                "date": datetime.date.today().isoformat(), "workers_asked": workers, "not_run": [],
                "final_status": None, "update_probe": None, "total_wall_s": None}
        step = dict(url=url, http=http, proc=proc, variants=variants, db_url=db_url, pg=bool(db.url), run_id=run_id,
                    think_s=think_s, warmup_s=warmup_s, duration_s=duration_s, pull=pull, clients=clients)
        rows = _steps(workers, tokens, ids, step, meta=meta, out=out, t_start=t_start)
        responsive = proc.poll() is None and rows[-1]["merge_queue_end"] is not None
        if update_probe and responsive:
            meta["update_probe"] = probe_update(url, http, db_url, run_id)
        final, _ = wait_status(url, http, patience_s=60) if responsive else (None, 0)
        if final:
            meta["final_status"] = {k: final.get(k) for k in ("version", "merged_deltas", "pending_deltas",
                                                               "rejected_deltas")}
    except BaseException:
        sys.stderr.write(log_tail(log_path))
        raise
    finally:
        http.close()
        stop(proc)
    meta["total_wall_s"] = round(time.perf_counter() - t_start, 1)
    return write_results(out, meta, rows)


def _serve(*, port: int, data_dir: Path, tmp: Path, db: Database, processes: int, log_path: Path,
           token: str) -> subprocess.Popen:
    """`idletrain coordinator serve` in a subprocess, its output appended to `log_path`."""
    serve = [sys.executable, "-m", "idletrain", "--log-level", "WARNING", "coordinator", "serve",
             "--port", str(port), "--data-dir", str(data_dir), "--processes", str(processes),
             "--corpus-dir", str(tmp)]  # corpus.txt's folder: a run's corpus must be in an allowed one
    if db.url:
        serve += ["--database-url", db.url]
    with log_path.open("ab") as logf:
        return subprocess.Popen(serve, stdout=logf, stderr=subprocess.STDOUT,
                                env={**coordinator_env(), "IDLETRAIN_ADMIN_TOKEN": token})


def _create_run(http: httpx.Client, admin: dict, *, mcfg, corpus: Path, corpus_bytes: int,
                fraction: float) -> tuple[dict, float]:
    """The benchmark's run (setup, not measured): what the coordinator answered, and the seconds it took."""
    cfg = {"name": RUN, "corpus": str(corpus), "corpus_max_bytes": corpus_bytes, "shard_tokens": SHARD_TOKENS,
           "eval_tokens": EVAL_TOKENS, "eval_every": 10**9, "model": mcfg.to_dict(),
           "compression": {"index": "random", "fraction": fraction, "values": "int8"}}
    t0 = time.perf_counter()
    resp = http.post(f"{API}/runs", json=cfg, headers=admin)
    if resp.status_code != 201:
        raise RuntimeError(f"creating the run failed: {resp.status_code} {resp.text}")
    created = resp.json()
    create_s = time.perf_counter() - t0
    log.info("run created in %.1f s: %s params, %d shards", create_s, f"{created['n_params']:,}",
             created["n_shards"])
    return created, create_s


def _variants(mcfg, *, fraction: float) -> tuple[list, dict]:
    """Deltas: entries once per variant, and what encoding costs."""
    from shared.model import build_model, param_schema

    schema = param_schema(build_model(mcfg, seed=0))
    variants = [build_entries(schema, fraction=fraction, seed=1000 + v) for v in range(VARIANTS)]
    costs = encode_costs(schema, variants[0], fraction=fraction)
    del schema
    log.info("delta: %s bytes, k = %s; encode with entries reused %.3g ms, compress + encode %.3g ms",
             f"{costs['delta_bytes']:,}", f"{costs['k']:,}", costs["encode_reused_entries_ms"],
             costs["compress_and_encode_ms"])
    return variants, costs


def _steps(workers: list[int], tokens: list[str], ids: list[int], step: dict, *, meta: dict, out: Path,
           t_start: float) -> list[dict]:
    """One _step per N, the results written after each; the Ns after one the coordinator did not
    survive (or answer again after) are not run (meta["not_run"])."""
    proc = step["proc"]
    rows: list[dict] = []
    for j, n in enumerate(workers):
        row = _step(n, tokens=tokens[:n], ids=ids[:n], **step)
        rows.append(row)
        log.info("N = %d: lease p99 %s ms, upload p99 %s ms, errors %d, 429 %d, queue %s, answered again "
                 "after %.1f s", n, row["lease"]["p99_ms"], row["upload"]["p99_ms"], row["errors"],
                 row["rate_limited_429"], row["merge_queue_end"], row["drain_s"])
        meta["total_wall_s"] = round(time.perf_counter() - t_start, 1)
        write_results(out, meta, rows)  # a step's numbers survive whatever happens later
        if proc.poll() is not None or row["merge_queue_end"] is None:
            meta["not_run"] = workers[j + 1:]
            log.warning("the coordinator %s; not running N = %s", "exited" if proc.poll() is not None else
                        f"did not answer within {DRAIN_LIMIT_S:g} s", meta["not_run"])
            break
    return rows


def _step(n: int, *, url: str, http: httpx.Client, proc: subprocess.Popen, tokens: list[str], ids: list[int],
          variants, db_url: str, pg: bool, run_id: int, think_s: float, warmup_s: float, duration_s: float,
          pull: str, clients: int | None) -> dict:
    k = clients or max(1, math.ceil(n / WORKERS_PER_CLIENT))
    k = min(k, n)
    before, _ = wait_status(url, http)
    if before is None:
        raise RuntimeError("the coordinator does not answer /status")
    startup = 3.0 + 0.5 * k  # client processes import and connect
    t_begin = time.monotonic() + startup
    t_measure, t_end = t_begin + warmup_s, t_begin + warmup_s + duration_s
    parts = [list(range(j, n, k)) for j in range(k)]
    jobs = [ClientJob(index=j, url=url, tokens=[tokens[i] for i in p], worker_ids=[ids[i] for i in p],
                      entries=list(variants), database_url=db_url, run_id=run_id, think_s=think_s, pull=pull,
                      t_begin=t_begin, t_measure=t_measure, t_end=t_end) for j, p in enumerate(parts)]
    log.info("N = %d: %d client process(es), warm-up %.0f s, measuring %.0f s", n, k, warmup_s, duration_s)
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=k, mp_context=ctx) as pool:
        futs = [pool.submit(client_main, job) for job in jobs]
        time.sleep(max(0.0, t_measure - time.monotonic()))
        c0, p0, m0, l0 = tree_cpu_s(proc.pid), postgres_cpu(), machine_cpu(), os.getloadavg()
        activity = pg_activity(db_url, t_end) if pg else {}
        time.sleep(max(0.0, t_end - time.monotonic()))
        c1, p1, m1 = tree_cpu_s(proc.pid), postgres_cpu(), machine_cpu()
        load = os.getloadavg()
        parts_out = [f.result(timeout=REQUEST_TIMEOUT_S * 3 + 60) for f in futs]
    t_clients_done = time.monotonic()
    if activity:
        activity["thread"].join(10)
    after, _ = wait_status(url, http)
    drain_s = time.monotonic() - t_clients_done
    after = after or {}
    window = duration_s
    lat = {kind: [x for p in parts_out for x in p["lat"][kind]] for kind in KINDS}
    status: dict[str, dict[str, int]] = {kind: {} for kind in KINDS}
    for p in parts_out:
        for kind, counts in p["status"].items():
            for code, c in counts.items():
                status[kind][code] = status[kind].get(code, 0) + c
    ok = {"lease": ("200", "204", "429"), "shard": ("200", "429"), "snapshot_304": ("304",),
          "update": ("200", "404", "410"), "upload": ("202", "429")}  # update 404/410: falls back to the snapshot
    errors = sum(c for kind in KINDS for code, c in status[kind].items() if code not in ok[kind])
    lag = [x for p in parts_out for x in p["lag_ms"]]
    requests = sum(len(v) for v in lat.values())

    def summary(kind: str) -> dict:
        xs = lat[kind]
        return {"n": len(xs), "per_s": sig(len(xs) / window), "p50_ms": pct(xs, 50), "p95_ms": pct(xs, 95),
                "p99_ms": pct(xs, 99), "max_ms": sig(max(xs)) if xs else None, "status": status[kind]}

    busy, total = m1[0] - m0[0], m1[1] - m0[1]
    timed = {kind: [x for p in parts_out for x in p["timed"][kind]] for kind in TIMED_KINDS}
    return {"workers": n, "clients": k, "requests_per_s": sig(requests / window),
            "phases": {kind: {"all": phase_breakdown(timed[kind]), "slowest_1pct": phase_breakdown(timed[kind], 99)}
                       for kind in TIMED_KINDS},
            "cycles_per_s": sig(sum(p["cycles"] for p in parts_out) / window),
            "expected_cycles_per_s": sig(n / think_s),
            **{kind: summary(kind) for kind in KINDS},
            "errors": errors, "rate_limited_429": sum(status[k].get("429", 0) for k in KINDS),
            "no_work_204": status["lease"].get("204", 0), "pull_without_sha": sum(p["no_sha"] for p in parts_out),
            "error_samples": [e for p in parts_out for e in p["errors"]][:10],
            "client_cpu": [sig(p["cpu_s"] / window, 3) for p in parts_out],
            "client_start_late_s": sig(max(p["late_s"] for p in parts_out), 3),
            "loop_lag_p99_ms": pct(lag, 99), "loop_lag_max_ms": sig(max(lag)) if lag else None,
            "body_encodes": sum(p["encodes"] for p in parts_out),
            "body_encode_ms_mean": sig(statistics.fmean([p["encode_ms_mean"] for p in parts_out
                                                          if p["encode_ms_mean"] is not None]))
            if any(p["encode_ms_mean"] is not None for p in parts_out) else None,
            "coordinator_cpu": sig((c1 - c0) / window, 3),
            "postgres_cpu": sig(pg_s / window, 3) if (pg_s := postgres_cpu_s(p0, p1)) is not None else None,
            "machine_busy": sig(busy / total, 3) if total else None, "load_average_1m": [l0[0], load[0]],
            "pg_sessions": activity.get("summary"),
            "version_start": before["version"], "version_end": after.get("version"),
            "merged_in_step": after["merged_deltas"] - before["merged_deltas"] if after else None,
            "merge_queue_start": before["pending_deltas"], "merge_queue_end": after.get("pending_deltas"),
            "drain_s": round(drain_s, 1)}
