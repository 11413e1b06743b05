"""The coordinator under `python -m bench load` and its database: a fresh PostgreSQL schema (or
SQLite), the coordinator's environment, the corpus, its status (and how long it took to answer
again after a step), the rows the benchmark reads from the database beside the coordinator, one
incremental update GET, and stopping it."""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import time
import uuid
from pathlib import Path

import httpx
import numpy as np

from bench.load_client import API, RUN
from bench.numbers import sig

DRAIN_LIMIT_S = 120.0  # how long to wait after a step for the coordinator to answer again


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
    "IDLETRAIN_MAX_CONNECTIONS_PER_ADDRESS": "100000",  # ... and connects from it: one connection each
    "IDLETRAIN_SNAPSHOT_KEEP": "4",  # disk: a 124M snapshot is ~460 MB
    # what an operator of a 124M run sets (docs/operations.md, settings.snapshot_every): a snapshot takes seconds
    # of CPU and a 460 MB fsync, so one per merge batch would starve the uploads' fsyncs
    "IDLETRAIN_SNAPSHOT_EVERY": "50",
    # likewise: a 124M checkpoint is weights + outer state, ~1.5 GB written and fsynced; replaying 500
    # deltas after a crash takes seconds
    "IDLETRAIN_CHECKPOINT_EVERY": "500",
}


PASSED_ENV = ("IDLETRAIN_NUMBA",)  # IDLETRAIN_NUMBA=0: the coordinator without its compiled kernels (A/B runs)


def coordinator_env() -> dict[str, str]:
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


def wait_status(url: str, http: httpx.Client, *, patience_s: float = DRAIN_LIMIT_S) -> tuple[dict | None, float]:
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


def run_id_of(db_url: str) -> int:
    from sqlalchemy import create_engine, select

    from coordinator.models import Run

    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            return int(conn.execute(select(Run.id).where(Run.name == RUN)).scalar_one())
    finally:
        engine.dispose()


def shard_scan_ms(db_url: str, run_id: int, reps: int = 20) -> dict:
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
        return {"rows": int(rows), "median_ms": sig(1000 * statistics.median(t))}
    finally:
        engine.dispose()


def probe_update(url: str, http: httpx.Client, db_url: str, run_id: int) -> dict | None:
    """One incremental update at the benchmark's model: GET updates/{a}/{b} twice between the two
    newest versions that have a snapshot (the first builds it from them, the second reads it back)."""
    from sqlalchemy import create_engine, select

    from coordinator.models import ModelVersion

    st, _ = wait_status(url, http)
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


def log_tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return "(no coordinator log)\n"


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=90)  # the merger finishes its merge and writes a checkpoint
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
