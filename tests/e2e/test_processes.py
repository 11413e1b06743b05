"""Several coordinator processes on one PostgreSQL and one data directory (`serve --processes 3`).

Over real sockets: workers upload through whichever process the kernel hands their connection to;
exactly one process holds the merger lock; it is SIGKILLed mid-run and another takes over; every
delta that got a 202 is merged exactly once and the final weights equal an independent replay.
Concurrent lease requests never get the same shard, and sparse exchanges that land on a process
without the live model are relayed to the one that has it.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from sqlalchemy import create_engine, func, select, text
from sqlalchemy.orm import Session

from coordinator import leader
from coordinator.models import Exchange, Lease
from idletrain.harness import free_port
from shared import codec, protocol
from shared.algorithms.sparta import exchange_seed, select as sparta_select
from shared.config import RunConfig
from shared.model import build_model, get_params, param_schema
from tests.conftest import fresh_database
from tests.e2e.test_crash import UploadingWorker, assert_merged_exactly_once
from tests import procs

OWN_DB_BACKENDS = True  # PostgreSQL only: SQLite serves one process
API = protocol.API_PREFIX
PROCESSES = 3
WORKERS = 4


def _leader(data_dir: Path, not_pid: int | None = None, timeout_s: float = 30.0) -> int:
    """The pid the leader published (a different one than `not_pid`), once it is alive."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = leader.read(data_dir)
        if found and found["pid"] != not_pid:
            try:
                os.kill(found["pid"], 0)
                return found["pid"]
            except ProcessLookupError:
                pass
        time.sleep(0.1)
    raise AssertionError(f"no coordinator process took the merger lock within {timeout_s} s")


def _lock_holders(db_url: str) -> int:
    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            return conn.execute(text("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted "
                                     "AND classid = :cls AND objid = hashtext(current_database() || '/' || "
                                     "current_schema())::oid"), {"cls": leader.LOCK_CLASS}).scalar()
    finally:
        engine.dispose()


def _wait_acks(acks: dict, n: int, stop: threading.Event, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while len(acks) < n and not stop.is_set() and time.monotonic() < deadline:
        time.sleep(0.05)


@pytest.mark.slow
def test_processes_share_one_merger_and_take_over_when_it_dies(tmp_path: Path, corpus_dir: Path):
    with fresh_database("postgresql") as db_url:
        port, data_dir, log = free_port(), tmp_path / "coord", tmp_path / "coordinator.log"
        url = f"http://127.0.0.1:{port}"
        proc = procs.popen([sys.executable, "-m", "idletrain", "coordinator", "serve", "--port", str(port),
                                 "--data-dir", str(data_dir), "--database-url", db_url,
                                 "--processes", str(PROCESSES), "--corpus-dir", str(corpus_dir)],
                                stdout=log.open("ab"), stderr=subprocess.STDOUT,
                                # 24 workers register from one address at once: above the default burst
                                env={**procs.env(), "IDLETRAIN_REGISTER_BURST": "32"})
        http = httpx.Client(base_url=url, timeout=30)
        workers: list[UploadingWorker] = []
        try:
            # three server processes each import torch and the app: on a loaded 2-core machine that once took
            # over the default 60 s (alone: a few seconds)
            procs.wait_healthy(http, proc, log)
            cfg = RunConfig.model_validate({
                "name": "crash", "corpus": str(corpus_dir), "corpus_max_bytes": 1 << 18, "shard_tokens": 1024,
                "eval_tokens": 4096, "eval_every": 3,
                "model": {"n_layer": 1, "n_head": 2, "d_model": 32, "context": 32},
                "inner": {"steps": 3, "batch_size": 2}, "outer": {"group": 3},
                "compression": {"index": "dense", "values": "int8", "error_feedback": False},
                # merged exactly once is checked against a replay of the merge rule alone (test_crash's
                # check): no ramp for new workers, and random deltas are not refused for their direction
                "robust": {"ramp": 1, "min_agreement": -1.0}})
            admin = procs.admin_headers(data_dir)
            assert http.post(f"{API}/runs", json=cfg.model_dump(mode="json"), headers=admin).status_code == 201
            first = _leader(data_dir)
            assert _lock_holders(db_url) == 1

            # leases: 24 workers ask at once, through all the processes; no shard goes out twice
            tokens = [http.post(f"{API}/runs/crash/workers", json={}).json()["token"] for _ in range(24)]
            with concurrent.futures.ThreadPoolExecutor(24) as pool:
                answers = list(pool.map(lambda t: httpx.post(f"{url}{API}/runs/crash/leases", timeout=30,
                                                             headers={"Authorization": f"Bearer {t}"}), tokens))
            assert [a.status_code for a in answers] == [200] * 24, [a.text for a in answers if a.status_code != 200]
            shards = [a.json()["shard_id"] for a in answers]
            assert len(set(shards)) == 24, sorted(shards)

            # uploads through every process; the leader is killed among them
            acks: dict[int, tuple[bytes, int, int]] = {}
            lock, stop = threading.Lock(), threading.Event()
            workers = [UploadingWorker(url, t, i, acks, lock, stop) for i, t in enumerate(tokens[:WORKERS])]
            for w in workers:
                w.start()
            _wait_acks(acks, 8, stop)
            os.kill(first, signal.SIGKILL)
            with lock:
                at_kill = len(acks)
            second = _leader(data_dir, not_pid=first)
            assert second != first and proc.poll() is None
            _wait_acks(acks, at_kill + 8, stop)
            stop.set()
            for w in workers:
                w.join(timeout=60)
            assert not [e for w in workers for e in w.errors], [e for w in workers for e in w.errors]
            assert 0 < at_kill < len(acks), (at_kill, len(acks))
            assert _lock_holders(db_url) == 1  # the new leader alone; the dead one's session is gone

            assert_merged_exactly_once(http, "crash", acks, cfg, db_url)
            engine = create_engine(db_url)
            with Session(engine) as s:
                doubled = s.scalar(select(func.count()).select_from(
                    select(Lease.shard_id).where(Lease.state == "active").group_by(Lease.shard_id)
                    .having(func.count() > 1).subquery()))
            engine.dispose()
            assert doubled == 0

            # sparse exchanges: whichever process a request lands on, the leader answers
            sp = cfg.model_copy(update={"name": "sp", "algorithm": "sparta", "compression": cfg.compression})
            assert http.post(f"{API}/runs", json=sp.model_dump(mode="json"), headers=admin).status_code == 201
            token = http.post(f"{API}/runs/sp/workers", json={}).json()["token"]
            auth = {"Authorization": f"Bearer {token}"}
            lease = protocol.Lease.model_validate(http.post(f"{API}/runs/sp/leases", headers=auth).json())
            local = get_params(build_model(sp.model, seed=sp.seed))
            for step in range(sp.sparta.every, sp.inner.steps + 1, sp.sparta.every):
                sent = sparta_select(local, p=sp.sparta.p, seed=exchange_seed(lease.seed, step),
                                     values=sp.sparta.values, base_version=lease.base_version)
                for _ in range(3):  # fresh connections: they spread over the processes
                    with httpx.Client(base_url=url, timeout=30) as c:
                        r = c.post(f"{API}/leases/{lease.lease_id}/exchange", params={"step": step},
                                   content=codec.encode(sent), headers={**auth,
                                                                        "Content-Type": "application/octet-stream"})
                    if r.status_code != 409:  # the same step twice: refused by the leader, wherever it landed
                        assert r.status_code == 200, r.text
                        codec.decode(r.content, schema=param_schema(build_model(sp.model)))
            engine = create_engine(db_url)
            with Session(engine) as s:
                n_exchanges = s.scalar(select(func.count()).select_from(Exchange))
            engine.dispose()
            assert n_exchanges == sp.inner.steps // sp.sparta.every
        except BaseException:
            print(procs.tail(log, 8000))
            raise
        finally:
            for w in workers:
                w.stop.set()
            http.close()
            procs.stop(proc, signal.SIGTERM)
