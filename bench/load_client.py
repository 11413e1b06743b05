"""The simulated workers of `python -m bench load` (bench/load.py): the delta entries they send,
registering them, and one client process (`client_main`): an asyncio loop of workers, each doing
lease -> pull -> think -> push against the coordinator, every request timed into a _Recorder."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import random
import resource
import statistics
import time

import httpx
import numpy as np

from bench.numbers import sig
from coordinator import timing
from shared import codec, protocol

log = logging.getLogger(__name__)

API = protocol.API_PREFIX
RUN = "load"
DELTA_SCALE = 1e-2
REQUEST_TIMEOUT_S = 30.0
KINDS = ("lease", "shard", "snapshot_304", "update", "upload")
TIMED_KINDS = ("lease", "upload")  # broken down by the coordinator's Server-Timing phases


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
            "encode_reused_entries_ms": sig(1000 * statistics.median(t_enc)),
            "compress_and_encode_ms": sig(1000 * statistics.median(t_full))}


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


def register(url: str, n: int) -> tuple[list[str], list[int]]:
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
