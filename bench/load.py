"""`idletrain bench load`: N simulated workers against a real coordinator over loopback HTTP.

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

import asyncio
import concurrent.futures
import dataclasses
import datetime
import json
import logging
import math
import multiprocessing
import os
import random
import resource
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import numpy as np

from coordinator import timing
from shared import codec, protocol

log = logging.getLogger(__name__)

API = protocol.API_PREFIX
RUN = "load"
GOAL_P99_MS = 100.0
GOAL_WORKERS = 1000
VARIANTS = 4  # distinct delta bodies per base version
WORKERS_PER_CLIENT = 500
SHARD_TOKENS = 2048  # > the 124M context (1024); a shard is ~1 KB compressed
EVAL_TOKENS = 2048
DELTA_SCALE = 1e-2
REQUEST_TIMEOUT_S = 30.0
DRAIN_LIMIT_S = 120.0  # how long to wait after a step for the coordinator to answer again
PULL_MODES = ("304", "update")
DEFAULT_PG_URL = os.environ.get("IDLETRAIN_TEST_POSTGRES", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
KINDS = ("lease", "shard", "snapshot_304", "update", "upload")
TIMED_KINDS = ("lease", "upload")  # broken down by the coordinator's Server-Timing phases


def model_configs():
    from bench.merge import PARAM_MODELS

    return {"gpt2-124m": PARAM_MODELS["gpt2-124m"], "small": PARAM_MODELS["small"]}


# -- deltas --------------------------------------------------------------------------------------

def build_entries(schema: dict[str, tuple[int, ...]], *, fraction: float, seed: int) -> tuple[codec.Entry, ...]:
    """One delta's entries as a worker sends them: seeded indices at `fraction` of each tensor,
    values N(0, DELTA_SCALE) on the int8 grid (what quantised() gives)."""
    from shared.algorithms.compress import k_for, quantised, tensor_seed

    rng = np.random.default_rng(seed)
    entries = []
    for name, shape in schema.items():
        numel = math.prod(shape)
        k = k_for(numel, fraction)
        tseed = tensor_seed(seed, name)
        idx = codec.seeded_indices(tseed, numel, k)
        vals = (rng.standard_normal(k) * DELTA_SCALE).astype(np.float32)
        entries.append(codec.Entry(name, numel, codec.IndexKind.SEEDED, codec.ValueKind.INT8, vals, idx, tseed))
    return quantised(codec.Delta(base_version=0, entries=tuple(entries))).entries


def encode_costs(schema: dict[str, tuple[int, ...]], entries: tuple[codec.Entry, ...], *,
                 fraction: float, reps: int = 5) -> dict:
    """What building a body costs: codec.encode with the entries reused (what the benchmark does per
    upload, with the lease's seeds), and the whole worker path compress() + quantise + encode from a dense
    pseudo-gradient (what it would cost per upload without the reuse)."""
    import torch

    from shared.algorithms.compress import compress, quantised
    from shared.config import CompressionConfig

    t_enc = []
    size = 0
    for i in range(reps):
        t0 = time.perf_counter()
        size = len(codec.encode(codec.Delta(base_version=i, entries=entries)))
        t_enc.append(time.perf_counter() - t0)
    g = torch.Generator().manual_seed(1)
    pg = {n: torch.randn(shape, generator=g) * DELTA_SCALE for n, shape in schema.items()}
    cfg = CompressionConfig(index="random", fraction=fraction, values="int8", error_feedback=False)
    t_full = []
    for i in range(2):
        t0 = time.perf_counter()
        codec.encode(quantised(compress(pg, cfg, base_version=i, round_seed=100 + i)))
        t_full.append(time.perf_counter() - t0)
    return {"delta_bytes": size, "k": sum(e.k for e in entries),
            "encode_reused_entries_ms": _sig(1000 * statistics.median(t_enc)),
            "compress_and_encode_ms": _sig(1000 * statistics.median(t_full))}


# -- one client process --------------------------------------------------------------------------

@dataclasses.dataclass
class ClientJob:
    index: int
    url: str
    tokens: list[str]
    worker_ids: list[int]
    entries: list[tuple[codec.Entry, ...]]  # one per variant
    database_url: str
    run_id: int
    think_s: float
    pull: str
    t_begin: float  # time.monotonic(): workers start (spread over one think time)
    t_measure: float  # warm-up ends
    t_end: float  # no request starts after this


class _Bodies:
    """Encoded delta bodies, one per upload, built off the event loop: a variant's values at the
    seeded indices of the lease's own seed (the coordinator takes random indices only where the
    lease's seed draws them, and the same bytes only once per run), so each lease's body differs.
    Only the seeds change (8 bytes per tensor: a SEEDED entry's indices are its seed), the values
    are the variant's."""

    def __init__(self, entries: list[tuple[codec.Entry, ...]]) -> None:
        self.entries = entries
        self.encode_s: list[float] = []

    def _encode(self, variant: int, base: int, lease_seed: int) -> bytes:
        from shared.algorithms.compress import tensor_seed

        t0 = time.perf_counter()
        entries = tuple(codec.Entry(e.name, e.numel, e.index_kind, e.value_kind, e.values, None,
                                    tensor_seed(lease_seed, e.name)) for e in self.entries[variant])
        body = codec.encode(codec.Delta(base_version=base, entries=entries))
        self.encode_s.append(time.perf_counter() - t0)
        return body

    async def get(self, variant: int, base: int, lease_seed: int) -> bytes:
        return await asyncio.to_thread(self._encode, variant, base, lease_seed)


class _Shas:
    """version -> snapshot sha256 (the ETag a worker holding that version sends), read from the
    coordinator's database: the simulated workers never downloaded the snapshots they 'hold'."""

    def __init__(self, database_url: str, run_id: int) -> None:
        from sqlalchemy import create_engine

        self.engine = create_engine(database_url, pool_size=1, max_overflow=0)
        self.run_id = run_id
        self.shas: dict[int, str] = {}
        self._refresh: asyncio.Future | None = None

    def _read(self) -> dict[int, str]:
        from sqlalchemy import select

        from coordinator.models import ModelVersion

        with self.engine.connect() as conn:
            rows = conn.execute(select(ModelVersion.version, ModelVersion.sha256)
                                .where(ModelVersion.run_id == self.run_id)).all()
        return {int(v): s for v, s in rows}

    async def get(self, version: int) -> str | None:
        """The sha of `version`; None if a few fresh reads do not find it (no snapshot row)."""
        for attempt in range(4):
            if version in self.shas:
                break
            if self._refresh is None or self._refresh.done():  # one read at a time, shared by all waiters
                if attempt:
                    await asyncio.sleep(0.1)
                if self._refresh is None or self._refresh.done():
                    self._refresh = asyncio.ensure_future(asyncio.to_thread(self._read))
            self.shas.update(await self._refresh)
        return self.shas.get(version)


class _Recorder:
    def __init__(self, t_measure: float, t_end: float) -> None:
        self.t_measure, self.t_end = t_measure, t_end
        self.lat: dict[str, list[float]] = {k: [] for k in KINDS}
        # (client ms, the answer's Server-Timing phases in ms), leases and uploads
        self.timed: dict[str, list[tuple[float, dict[str, float]]]] = {k: [] for k in TIMED_KINDS}
        self.status: dict[str, dict[str, int]] = {k: {} for k in KINDS}
        self.errors: list[str] = []
        self.cycles = 0
        self.no_sha = 0

    def measuring(self, t_start: float) -> bool:
        return self.t_measure <= t_start < self.t_end

    def add(self, kind: str, t_start: float, seconds: float, status: str, error: str | None = None) -> None:
        if not self.measuring(t_start):
            return
        self.lat[kind].append(1000 * seconds)
        self.status[kind][status] = self.status[kind].get(status, 0) + 1
        if error and len(self.errors) < 20:
            self.errors.append(f"{kind} {status}: {error}"[:300])


async def _request(http: httpx.AsyncClient, rec: _Recorder, kind: str, method: str, url: str,
                   ok: tuple[int, ...], **kw) -> httpx.Response | None:
    """One timed request; the answer, or None on a transport error (recorded as an error)."""
    t_start = time.monotonic()
    t0 = time.perf_counter()
    try:
        resp = await http.request(method, url, **kw)
    except httpx.HTTPError as exc:
        rec.add(kind, t_start, time.perf_counter() - t0, f"ERR:{type(exc).__name__}", repr(exc))
        return None
    dt = time.perf_counter() - t0
    status = str(resp.status_code)
    bad = resp.status_code not in ok and resp.status_code not in (204, 429)
    rec.add(kind, t_start, dt, status, resp.text[:200] if bad else None)
    if kind in rec.timed and rec.measuring(t_start) and resp.status_code in ok:
        rec.timed[kind].append((1000 * dt, timing.parse(resp.headers.get(timing.HEADER))))
    return resp


def phase_breakdown(timed: list[tuple[float, dict[str, float]]], above_pct: float | None = None) -> dict | None:
    """Mean client latency of the requests (those at or above the `above_pct` percentile of latency, if
    given), split into the coordinator's Server-Timing phases (means, ms) and `outside`: client latency
    minus the server's total (the network, the event loops, the client itself)."""
    if above_pct is not None and timed:
        cut = _pct([ms for ms, _ in timed], above_pct)
        timed = [t for t in timed if t[0] >= cut]
    timed = [t for t in timed if "total" in t[1]]  # answers without the header (an older coordinator)
    if not timed:
        return None
    names = sorted({name for _, ph in timed for name in ph if name != "total"})
    mean = {name: statistics.fmean(ph.get(name, 0.0) for _, ph in timed) for name in names}
    server = statistics.fmean(ph["total"] for _, ph in timed)
    return {"n": len(timed), "client_ms": _sig(statistics.fmean(ms for ms, _ in timed)), "server_ms": _sig(server),
            "outside_ms": _sig(statistics.fmean(ms - ph["total"] for ms, ph in timed)),
            "unnamed_ms": _sig(server - sum(mean.values())),  # in the server, outside every phase
            "phases_ms": {name: _sig(v) for name, v in sorted(mean.items(), key=lambda kv: -kv[1])}}


def _retry_after(resp: httpx.Response, default: float = 1.0) -> float:
    try:
        return float(resp.headers.get("Retry-After", default))
    except ValueError:
        return default


async def _sleep_until(t: float, seconds: float) -> bool:
    """Sleep `seconds` but not past monotonic time `t`; whether there is time left after."""
    await asyncio.sleep(max(0.0, min(seconds, t - time.monotonic())))
    return time.monotonic() < t


async def _worker(i: int, token: str, job: ClientJob, http: httpx.AsyncClient, rec: _Recorder,
                  bodies: _Bodies, shas: _Shas) -> None:
    rng = random.Random(job.worker_ids[i])
    auth = {"Authorization": f"Bearer {token}"}
    variant = job.worker_ids[i] % len(job.entries)
    held: int | None = None  # the model version this worker holds
    if not await _sleep_until(job.t_end, job.t_begin + rng.uniform(0, job.think_s) - time.monotonic()):
        return
    while time.monotonic() < job.t_end:
        resp = await _request(http, rec, "lease", "POST", f"{API}/runs/{RUN}/leases", (200,), headers=auth)
        if resp is None or resp.status_code not in (200,):
            wait = _retry_after(resp) if resp is not None and resp.status_code in (204, 429) else 1.0
            await _sleep_until(job.t_end, wait * rng.uniform(1.0, 1.1))
            continue
        lease = resp.json()
        lease_id, base, shard = lease["lease_id"], lease["base_version"], lease["shard_id"]
        # pull: the shard, and the model when the lease's version is not the one held
        resp = await _request(http, rec, "shard", "GET", f"{API}/runs/{RUN}/shards/{shard}", (200,), headers=auth)
        if resp is None or resp.status_code != 200:
            await _sleep_until(job.t_end, 1.0)
            continue
        if held != base:
            resp = None
            if job.pull == "update" and held is not None and held < base:
                resp = await _request(http, rec, "update", "GET", f"{API}/runs/{RUN}/updates/{held}/{base}",
                                      (200, 404, 410))
                if resp is not None and resp.status_code in (404, 410):  # version no longer kept: the snapshot
                    resp = None
            if resp is None:
                sha = await shas.get(base)
                if sha is None:  # no snapshot row for the version: nothing to revalidate against
                    rec.no_sha += rec.measuring(time.monotonic())
                    resp = None
                else:
                    resp = await _request(http, rec, "snapshot_304", "GET", f"{API}/runs/{RUN}/snapshots/{base}",
                                          (304,), headers={"If-None-Match": f'"{sha}"'})
            if resp is not None and resp.status_code in (200, 304):
                held = base
        # think: the local round the lease stands for
        if not await _sleep_until(job.t_end, job.think_s * rng.uniform(0.5, 1.5)):
            return
        body = await bodies.get(variant, base, lease["seed"])
        while True:
            resp = await _request(http, rec, "upload", "POST", f"{API}/leases/{lease_id}/delta", (202,),
                                  content=body, headers={**auth, "Content-Type": "application/octet-stream"})
            if resp is not None and resp.status_code == 429 and time.monotonic() < job.t_end:
                await _sleep_until(job.t_end, _retry_after(resp) * rng.uniform(1.0, 1.1))
                continue
            break
        if resp is not None and resp.status_code == 202:
            rec.cycles += rec.measuring(time.monotonic())
        else:
            await _sleep_until(job.t_end, 1.0)


async def _lag_probe(rec: _Recorder, out: list[float], period: float = 0.1) -> None:
    while time.monotonic() < rec.t_end:
        t0 = time.perf_counter()
        await asyncio.sleep(period)
        if rec.measuring(time.monotonic()):
            out.append(1000 * (time.perf_counter() - t0 - period))


async def _client(job: ClientJob) -> dict:
    rec = _Recorder(job.t_measure, job.t_end)
    bodies = _Bodies(job.entries)
    shas = _Shas(job.database_url, job.run_id)
    n = len(job.tokens)
    limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=n + 8)
    lag: list[float] = []
    cpu: dict[str, float] = {}

    async def cpu_window() -> None:
        await asyncio.sleep(max(0.0, job.t_measure - time.monotonic()))
        cpu["start"] = _cpu_s()
        await asyncio.sleep(max(0.0, job.t_end - time.monotonic()))
        cpu["end"] = _cpu_s()

    late = max(0.0, time.monotonic() - job.t_begin)
    async with httpx.AsyncClient(base_url=job.url, limits=limits, timeout=REQUEST_TIMEOUT_S) as http:
        tasks = [asyncio.create_task(_worker(i, t, job, http, rec, bodies, shas)) for i, t in enumerate(job.tokens)]
        extra = [asyncio.create_task(_lag_probe(rec, lag)), asyncio.create_task(cpu_window())]
        results = await asyncio.gather(*tasks, *extra, return_exceptions=True)
    shas.engine.dispose()
    crashed = [repr(r) for r in results if isinstance(r, BaseException)]
    return {"index": job.index, "workers": n, "lat": rec.lat, "timed": rec.timed, "status": rec.status,
            "errors": rec.errors + crashed,
            "cycles": rec.cycles, "no_sha": rec.no_sha, "late_s": late,
            "cpu_s": cpu.get("end", 0.0) - cpu.get("start", 0.0),
            "window_s": job.t_end - job.t_measure, "lag_ms": lag,
            "encodes": len(bodies.encode_s), "encode_ms_mean": 1000 * statistics.fmean(bodies.encode_s)
            if bodies.encode_s else None}


def _cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def client_main(job: ClientJob) -> dict:
    """Entry point of a client process."""
    return asyncio.run(_client(job))


# -- the coordinator and its database ------------------------------------------------------------

def _proc_cpu_s(pid: int) -> float:
    """utime + stime of a process (all its threads), seconds; 0 when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _tree_cpu_s(pid: int) -> float:
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


def _postgres_cpu() -> dict[int, float]:
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


def _postgres_cpu_s(before: dict[int, float], after: dict[int, float]) -> float | None:
    """CPU seconds postgres used between two samples: per process, so backends that come and go do
    not count negative (a backend that exits in between loses its last stretch: a lower bound)."""
    if not before and not after:
        return None
    return sum(max(0.0, cpu - before.get(pid, 0.0)) for pid, cpu in after.items())


def _machine_cpu() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]
    return sum(fields) - idle, sum(fields)


class Database:
    """--database-url: a fresh schema in that PostgreSQL database (dropped after); --sqlite: None."""

    def __init__(self, url: str | None) -> None:
        self.base, self.schema, self.url = url, None, None

    def __enter__(self) -> Database:
        if self.base is None:
            return self
        from sqlalchemy import create_engine, text

        self.schema = f"bench_load_{uuid.uuid4().hex[:12]}"
        admin = create_engine(self.base)
        with admin.begin() as conn:
            conn.execute(text(f'CREATE SCHEMA "{self.schema}"'))
        admin.dispose()
        sep = "&" if "?" in self.base else "?"
        self.url = f"{self.base}{sep}options=-csearch_path%3D{self.schema}"
        return self

    def __exit__(self, *exc) -> None:
        if self.schema is None:
            return
        from sqlalchemy import create_engine, text

        admin = create_engine(self.base)
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA "{self.schema}" CASCADE'))
        admin.dispose()


COORDINATOR_ENV = {
    "IDLETRAIN_REGISTER_RATE": "0",  # every simulated worker registers from 127.0.0.1
    "IDLETRAIN_MAX_LEASES_PER_ADDRESS": "100000",  # ... and leases from it: up to 1000 at once
    "IDLETRAIN_SNAPSHOT_KEEP": "4",  # disk: a 124M snapshot is ~460 MB
    # what an operator of a 124M run sets (README, settings.snapshot_every): a snapshot takes seconds
    # of CPU and a 460 MB fsync, so one per merge batch would starve the uploads' fsyncs
    "IDLETRAIN_SNAPSHOT_EVERY": "50",
    # likewise: a 124M checkpoint is weights + outer state, ~1.5 GB written and fsynced; replaying 500
    # deltas after a crash takes seconds
    "IDLETRAIN_CHECKPOINT_EVERY": "500",
}


PASSED_ENV = ("IDLETRAIN_NUMBA",)  # IDLETRAIN_NUMBA=0: the coordinator without its compiled kernels (A/B runs)


def _coordinator_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("IDLETRAIN_") or k in PASSED_ENV}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               **COORDINATOR_ENV)
    return env


def write_corpus(path: Path, n_bytes: int, *, seed: int = 0) -> None:
    words = np.array(("the coordinator hands out leases while volunteers train one shared model and send "
                      "back small sparse deltas over plain http").split())
    rng = np.random.default_rng(seed)
    chunks, size = [], 0
    while size < n_bytes:
        part = " ".join(rng.choice(words, 20_000)) + " "
        chunks.append(part)
        size += len(part)
    path.write_text("".join(chunks)[:n_bytes])


# -- the run -------------------------------------------------------------------------------------

def _pct(xs: list[float], q: float) -> float | None:
    return _sig(float(np.percentile(xs, q))) if xs else None


def _sig(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else float(f"{x:.{digits}g}")


def _status(url: str, http: httpx.Client, *, patience_s: float = DRAIN_LIMIT_S) -> tuple[dict | None, float]:
    """(the run's status, seconds until the coordinator answered it); (None, ...) if it did not
    answer within `patience_s`. A saturated coordinator keeps working through requests whose
    clients gave up, so after a step this is also how long it took to drain."""
    t0 = time.perf_counter()
    while True:
        try:
            resp = http.get(f"{url}{API}/runs/{RUN}/status", timeout=10)
            if resp.status_code == 200:
                return resp.json(), time.perf_counter() - t0
        except httpx.HTTPError:
            pass
        if time.perf_counter() - t0 > patience_s:
            return None, time.perf_counter() - t0
        time.sleep(1.0)


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
    from idletrain.demo import free_port, wait_healthy
    from shared.model import build_model, param_schema

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    data_dir = tmp / "data"
    corpus = tmp / "corpus.txt"
    # load_corpus holds out the file's last 1/20 and cuts the rest into whole shards: `shards` of them
    corpus_bytes = max(math.ceil((shards * SHARD_TOKENS + SHARD_TOKENS // 2) / 0.95), 20 * EVAL_TOKENS + 4096)
    write_corpus(corpus, corpus_bytes)
    log_path = tmp / "coordinator.log"
    serve = [sys.executable, "-m", "idletrain", "--log-level", "WARNING", "coordinator", "serve",
             "--port", str(port), "--data-dir", str(data_dir), "--processes", str(processes),
             "--corpus-dir", str(tmp)]  # corpus.txt's folder: a run's corpus must be in an allowed one
    admin = {"Authorization": f"Bearer {(token := secrets.token_urlsafe(32))}"}  # through the environment
    if db.url:
        serve += ["--database-url", db.url]
    log.info("starting the coordinator on %s (%s)", url, "PostgreSQL schema " + db.schema if db.url else "SQLite")
    with log_path.open("ab") as logf:
        proc = subprocess.Popen(serve, stdout=logf, stderr=subprocess.STDOUT,
                                env={**_coordinator_env(), "IDLETRAIN_ADMIN_TOKEN": token})
    http = httpx.Client(base_url=url, timeout=600)
    try:
        wait_healthy(http, proc, 120)
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
        db_url = db.url or f"sqlite:///{(data_dir / 'idletrain.sqlite3').resolve()}"
        run_id = _run_id(db_url)

        # deltas: entries once per variant, and what encoding costs
        schema = param_schema(build_model(mcfg, seed=0))
        variants = [build_entries(schema, fraction=fraction, seed=1000 + v) for v in range(VARIANTS)]
        costs = encode_costs(schema, variants[0], fraction=fraction)
        del schema
        log.info("delta: %s bytes, k = %s; encode with entries reused %.3g ms, compress + encode %.3g ms",
                 f"{costs['delta_bytes']:,}", f"{costs['k']:,}", costs["encode_reused_entries_ms"],
                 costs["compress_and_encode_ms"])

        tokens, ids = _register(url, max(workers))
        scan = _shard_scan_ms(db_url, run_id)
        meta = {"model": model, "model_config": mcfg.to_dict(), "n_params": created["n_params"],
                "fraction": fraction, "delta": costs, "database": "postgresql" if db.url else "sqlite", "pull": pull,
                "think_s": think_s, "warmup_s": warmup_s, "duration_s": duration_s, "shards": created["n_shards"],
                "shard_tokens": SHARD_TOKENS, "shard_scan_ms": scan, "run_create_s": round(create_s, 1),
                "request_timeout_s": REQUEST_TIMEOUT_S,
                "coordinator_env": {**COORDINATOR_ENV, **{k: os.environ[k] for k in PASSED_ENV if k in os.environ}},
                "processes": processes, "cpus": os.cpu_count(), "python": sys.version.split()[0],
                "httpx": httpx.__version__,
                "date": datetime.date.today().isoformat(), "workers_asked": workers, "not_run": [],
                "final_status": None, "update_probe": None, "total_wall_s": None}
        rows: list[dict] = []
        for j, n in enumerate(workers):
            row = _step(n, url=url, http=http, proc=proc, tokens=tokens[:n], ids=ids[:n], variants=variants,
                        db_url=db_url, pg=bool(db.url), run_id=run_id, think_s=think_s, warmup_s=warmup_s,
                        duration_s=duration_s, pull=pull, clients=clients)
            rows.append(row)
            log.info("N = %d: lease p99 %s ms, upload p99 %s ms, errors %d, 429 %d, queue %s, answered again "
                     "after %.1f s", n, row["lease"]["p99_ms"], row["upload"]["p99_ms"], row["errors"],
                     row["rate_limited_429"], row["merge_queue_end"], row["drain_s"])
            meta["total_wall_s"] = round(time.perf_counter() - t_start, 1)
            _write(out, meta, rows)  # a step's numbers survive whatever happens later
            if proc.poll() is not None or row["merge_queue_end"] is None:
                meta["not_run"] = workers[j + 1:]
                log.warning("the coordinator %s; not running N = %s", "exited" if proc.poll() is not None else
                            f"did not answer within {DRAIN_LIMIT_S:g} s", meta["not_run"])
                break
        responsive = proc.poll() is None and rows[-1]["merge_queue_end"] is not None
        if update_probe and responsive:
            meta["update_probe"] = _update_probe(url, http, db_url, run_id)
        final, _ = _status(url, http, patience_s=60) if responsive else (None, 0)
        if final:
            meta["final_status"] = {k: final.get(k) for k in ("version", "merged_deltas", "pending_deltas",
                                                               "rejected_deltas")}
    except BaseException:
        sys.stderr.write(_tail(log_path))
        raise
    finally:
        http.close()
        _stop(proc)
    meta["total_wall_s"] = round(time.perf_counter() - t_start, 1)
    return _write(out, meta, rows)


def _write(out: Path, meta: dict, rows: list[dict]) -> dict:
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


def _run_id(db_url: str) -> int:
    from sqlalchemy import create_engine, select

    from coordinator.models import Run

    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            return int(conn.execute(select(Run.id).where(Run.name == RUN)).scalar_one())
    finally:
        engine.dispose()


def _shard_scan_ms(db_url: str, run_id: int, reps: int = 20) -> dict:
    """grant_lease's shard pick, timed from another connection: the first pending shard by
    (times_trained, index), FOR UPDATE SKIP LOCKED on PostgreSQL (rolled back), over `rows` shards."""
    from sqlalchemy import create_engine, func, select

    from coordinator.models import Shard

    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            rows = conn.scalar(select(func.count()).select_from(Shard).where(Shard.run_id == run_id))
            q = (select(Shard.id, Shard.index, Shard.state, Shard.times_trained)
                 .where(Shard.run_id == run_id, Shard.state == "pending")
                 .order_by(Shard.times_trained, Shard.index).limit(1))
            if engine.dialect.name == "postgresql":
                q = q.with_for_update(skip_locked=True, of=Shard)
            t = []
            for _ in range(reps):
                t0 = time.perf_counter()
                conn.execute(q).all()
                t.append(time.perf_counter() - t0)
                conn.rollback()
        return {"rows": int(rows), "median_ms": _sig(1000 * statistics.median(t))}
    finally:
        engine.dispose()


def _register(url: str, n: int) -> tuple[list[str], list[int]]:
    async def go() -> list[dict]:
        sem = asyncio.Semaphore(16)
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            async def one(i: int) -> dict:
                async with sem:
                    resp = await http.post(f"{API}/runs/{RUN}/workers", json={"name": f"load-{i}"})
                    if resp.status_code != 201:
                        raise RuntimeError(f"registering worker {i}: {resp.status_code} {resp.text}")
                    return resp.json()
            return await asyncio.gather(*(one(i) for i in range(n)))

    t0 = time.perf_counter()
    regs = asyncio.run(go())
    log.info("registered %d workers in %.1f s", n, time.perf_counter() - t0)
    return [r["token"] for r in regs], [r["worker_id"] for r in regs]


def _step(n: int, *, url: str, http: httpx.Client, proc: subprocess.Popen, tokens: list[str], ids: list[int],
          variants, db_url: str, pg: bool, run_id: int, think_s: float, warmup_s: float, duration_s: float,
          pull: str, clients: int | None) -> dict:
    k = clients or max(1, math.ceil(n / WORKERS_PER_CLIENT))
    k = min(k, n)
    before, _ = _status(url, http)
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
        c0, p0, m0, l0 = _tree_cpu_s(proc.pid), _postgres_cpu(), _machine_cpu(), os.getloadavg()
        activity = _pg_activity(db_url, t_end) if pg else {}
        time.sleep(max(0.0, t_end - time.monotonic()))
        c1, p1, m1 = _tree_cpu_s(proc.pid), _postgres_cpu(), _machine_cpu()
        load = os.getloadavg()
        parts_out = [f.result(timeout=REQUEST_TIMEOUT_S * 3 + 60) for f in futs]
    t_clients_done = time.monotonic()
    if activity:
        activity["thread"].join(10)
    after, _ = _status(url, http)
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
        return {"n": len(xs), "per_s": _sig(len(xs) / window), "p50_ms": _pct(xs, 50), "p95_ms": _pct(xs, 95),
                "p99_ms": _pct(xs, 99), "max_ms": _sig(max(xs)) if xs else None, "status": status[kind]}

    busy, total = m1[0] - m0[0], m1[1] - m0[1]
    timed = {kind: [x for p in parts_out for x in p["timed"][kind]] for kind in TIMED_KINDS}
    return {"workers": n, "clients": k, "requests_per_s": _sig(requests / window),
            "phases": {kind: {"all": phase_breakdown(timed[kind]), "slowest_1pct": phase_breakdown(timed[kind], 99)}
                       for kind in TIMED_KINDS},
            "cycles_per_s": _sig(sum(p["cycles"] for p in parts_out) / window),
            "expected_cycles_per_s": _sig(n / think_s),
            **{kind: summary(kind) for kind in KINDS},
            "errors": errors, "rate_limited_429": sum(status[k].get("429", 0) for k in KINDS),
            "no_work_204": status["lease"].get("204", 0), "pull_without_sha": sum(p["no_sha"] for p in parts_out),
            "error_samples": [e for p in parts_out for e in p["errors"]][:10],
            "client_cpu": [_sig(p["cpu_s"] / window, 3) for p in parts_out],
            "client_start_late_s": _sig(max(p["late_s"] for p in parts_out), 3),
            "loop_lag_p99_ms": _pct(lag, 99), "loop_lag_max_ms": _sig(max(lag)) if lag else None,
            "body_encodes": sum(p["encodes"] for p in parts_out),
            "body_encode_ms_mean": _sig(statistics.fmean([p["encode_ms_mean"] for p in parts_out
                                                          if p["encode_ms_mean"] is not None]))
            if any(p["encode_ms_mean"] is not None for p in parts_out) else None,
            "coordinator_cpu": _sig((c1 - c0) / window, 3),
            "postgres_cpu": _sig(pg_s / window, 3) if (pg_s := _postgres_cpu_s(p0, p1)) is not None else None,
            "machine_busy": _sig(busy / total, 3) if total else None, "load_average_1m": [l0[0], load[0]],
            "pg_sessions": activity.get("summary"),
            "version_start": before["version"], "version_end": after.get("version"),
            "merged_in_step": after["merged_deltas"] - before["merged_deltas"] if after else None,
            "merge_queue_start": before["pending_deltas"], "merge_queue_end": after.get("pending_deltas"),
            "drain_s": round(drain_s, 1)}


def _pg_activity(db_url: str, t_end: float, period: float = 0.5) -> dict:
    """Sample pg_stat_activity of this database every `period` s until `t_end`, in a thread: how many
    of the coordinator's sessions run, wait for a lock, or sit idle inside a transaction, and which
    statements wait. Filled in as the thread goes; read it after t_end."""
    import threading

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
        out["summary"] = {"samples": n, **{f"mean_{k}": _sig(statistics.fmean(v), 3) if v else None
                                            for k, v in counts.items()},
                          **{f"max_{k}": max(v) if v else None for k, v in counts.items()},
                          "lock_waits_by_statement": dict(sorted(waiting.items(), key=lambda kv: -kv[1])[:4])}

    out["thread"] = threading.Thread(target=sample, name="pg-activity", daemon=True)
    out["thread"].start()
    return out


def _update_probe(url: str, http: httpx.Client, db_url: str, run_id: int) -> dict | None:
    """One incremental update at the benchmark's model: GET updates/{a}/{b} twice between the two
    newest versions that have a snapshot (the first builds it from them, the second reads it back)."""
    from sqlalchemy import create_engine, select

    from coordinator.models import ModelVersion

    st, _ = _status(url, http)
    if st is None:
        return None
    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            kept = conn.execute(select(ModelVersion.version).where(ModelVersion.run_id == run_id)
                                .order_by(ModelVersion.version.desc()).limit(2)).scalars().all()
    finally:
        engine.dispose()
    if len(kept) < 2:
        return None
    b, a = kept
    out: dict = {"from": a, "to": b}
    for label in ("first_s", "again_s"):
        t0 = time.perf_counter()
        try:
            resp = http.get(f"{API}/runs/{RUN}/updates/{a}/{b}", timeout=300)
        except httpx.HTTPError as exc:
            out["detail"] = repr(exc)
            return out
        out[label] = round(time.perf_counter() - t0, 3)
        out["status"] = resp.status_code
        if resp.status_code != 200:
            out["detail"] = resp.text[:200]
            return out
        out["bytes"] = len(resp.content)
    return out


def _tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return "(no coordinator log)\n"


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=90)  # the merger finishes its merge and writes a checkpoint
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


# -- output --------------------------------------------------------------------------------------

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
    ax.set_title(f"idletrain bench load: {meta['model']}, {meta['database']}, think {meta['think_s']:g} s",
                 fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
