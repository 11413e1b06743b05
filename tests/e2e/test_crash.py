"""Durability over real sockets: the coordinator is SIGKILLed at random moments while workers
upload, and restarted each time. In the end every delta that got a 202 is merged exactly once,
and the final weights equal an independent replay of those deltas in their recorded order."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from sqlalchemy import create_engine, select
from sqlalchemy.orm import Session

from coordinator.models import DeltaRecord
from idletrain.harness import free_port
from shared import codec, protocol
from shared.algorithms.compress import compress
from shared.config import RunConfig
from shared.model import build_model, param_schema
from shared.snapshot import decode_snapshot
from tests.coordinator.test_merger import assert_same, replay
from tests import procs
from worker.client import CoordinatorClient, CoordinatorError

KILLS = 4
WORKERS = 4
AFTER_LAST = 8  # deltas acknowledged after the last restart before the workers stop


class UploadingWorker(threading.Thread):
    """Lease -> seeded random delta -> upload, over and over, through the real client. Every 202
    is remembered with the exact bytes; an upload without an answer is retried with the same bytes."""

    def __init__(self, url: str, token: str, idx: int, acks: dict, lock: threading.Lock, stop: threading.Event):
        super().__init__(daemon=True)
        self.client = CoordinatorClient(url, token=token, timeout_s=5.0, max_retries=2)
        self.idx, self.acks, self.lock, self.stop = idx, acks, lock, stop
        self.errors: list[str] = []

    def _retrying(self, fn):
        while not self.stop.is_set():
            try:
                return fn()
            except (httpx.HTTPError, OSError):
                time.sleep(0.2)
            except CoordinatorError as exc:
                if exc.status == 0 or exc.status >= 500 or exc.status == 429:
                    time.sleep(0.2)
                    continue
                raise
        return None

    def run(self) -> None:
        n = 0
        try:
            while not self.stop.is_set():
                got = self._retrying(lambda: self.client.lease("crash"))
                if got is None:
                    return
                lease, wait_s = got
                if lease is None:
                    time.sleep(wait_s)
                    continue
                n += 1
                gen = torch.Generator().manual_seed(1000 * self.idx + n)
                schema = param_schema(build_model(lease.model))
                grads = {name: torch.randn(shape, generator=gen) * 1e-3 for name, shape in schema.items()}
                body = codec.encode(compress(grads, lease.compression, base_version=lease.base_version,
                                             round_seed=lease.seed))
                ack = self._retrying(lambda: self.client.upload_delta(lease.lease_id, body))
                if ack is None:
                    return
                with self.lock:
                    prior = self.acks.get(lease.lease_id)
                    assert prior is None or prior[1] == ack.will_merge_into, "one lease, two answers"
                    self.acks[lease.lease_id] = (body, ack.will_merge_into, lease.base_version)
                time.sleep(0.05)  # think time, so the kills land among uploads
        except Exception as exc:  # surfaced by the test
            self.errors.append(repr(exc))
            self.stop.set()
        finally:
            self.client.close()


def _serve(data_dir: Path, port: int, log: Path, db_url: str | None, corpus_dir: Path) -> subprocess.Popen:
    db = ["--database-url", db_url] if db_url else []
    return procs.popen([sys.executable, "-m", "idletrain", "coordinator", "serve", "--port", str(port),
                             "--data-dir", str(data_dir), "--corpus-dir", str(corpus_dir), *db],
                            stdout=log.open("ab"), stderr=subprocess.STDOUT, env=procs.env())


@pytest.mark.slow
def test_sigkill_at_random_moments_loses_and_doubles_nothing(tmp_path: Path, corpus_dir: Path, db_url: str | None):
    rng = random.Random(1234)
    port, data_dir, log = free_port(), tmp_path / "coord", tmp_path / "coordinator.log"
    url = f"http://127.0.0.1:{port}"
    cfg = RunConfig.model_validate({
        "name": "crash", "corpus": str(corpus_dir), "corpus_max_bytes": 1 << 18, "shard_tokens": 1024,
        "eval_tokens": 4096, "eval_every": 3, "model": {"n_layer": 1, "n_head": 2, "d_model": 32, "context": 32},
        "inner": {"steps": 3, "batch_size": 2}, "outer": {"group": 3}, "epochs": 0,  # until stopped
        "compression": {"index": "dense", "values": "int8", "error_feedback": False},
        # the replay below is the merge rule alone: no ramp for new workers, and these random deltas
        # agree with no consensus, so none is refused for it
        "robust": {"ramp": 1, "min_agreement": -1.0}})
    proc = _serve(data_dir, port, log, db_url, corpus_dir)
    http = httpx.Client(base_url=url, timeout=30)
    workers: list[UploadingWorker] = []
    try:
        procs.wait_healthy(http, proc, log)
        assert http.post(f"{protocol.API_PREFIX}/runs", json=cfg.model_dump(mode="json"),
                         headers=procs.admin_headers(data_dir)).status_code == 201
        tokens = [http.post(f"{protocol.API_PREFIX}/runs/crash/workers", json={}).json()["token"]
                  for _ in range(WORKERS)]
        acks: dict[int, tuple[bytes, int, int]] = {}
        lock, stop = threading.Lock(), threading.Event()
        workers = [UploadingWorker(url, t, i, acks, lock, stop) for i, t in enumerate(tokens)]
        for w in workers:
            w.start()
        acked_at_kill = []
        for _ in range(KILLS):
            # once uploads flow again, kill at a random moment among them
            before = acked_at_kill[-1] if acked_at_kill else 0
            deadline = time.monotonic() + 60
            while len(acks) <= before and not stop.is_set() and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(rng.uniform(0.0, 1.0))
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)
            with lock:
                acked_at_kill.append(len(acks))
            proc = _serve(data_dir, port, log, db_url, corpus_dir)
            procs.wait_healthy(http, proc, log)
        deadline = time.monotonic() + 120
        while len(acks) < acked_at_kill[-1] + AFTER_LAST and not stop.is_set() and time.monotonic() < deadline:
            time.sleep(0.05)
        stop.set()
        for w in workers:
            w.join(timeout=60)
        assert not [e for w in workers for e in w.errors], [e for w in workers for e in w.errors]
        # every kill landed while uploads were going on: deltas were acknowledged between any two
        assert 0 < acked_at_kill[0] and all(a < b for a, b in zip(acked_at_kill, acked_at_kill[1:])), acked_at_kill
        assert len(acks) >= acked_at_kill[-1] + AFTER_LAST, (len(acks), acked_at_kill)
        assert log.read_text().count("resumed at version") >= KILLS

        assert_merged_exactly_once(http, "crash", acks, cfg, db_url or f"sqlite:///{data_dir / 'idletrain.sqlite3'}")
    except BaseException:
        print(procs.tail(log, 6000))
        raise
    finally:
        for w in workers:
            w.stop.set()
        http.close()
        procs.stop(proc, signal.SIGTERM)


def assert_merged_exactly_once(http: httpx.Client, run: str, acks: dict[int, tuple[bytes, int, int]], cfg: RunConfig,
                               db_url: str) -> None:
    """Every delta that got a 202 (acks: lease -> (body, seq, base)) is merged, once, under the
    sequence number its answer gave, and the run's weights equal an independent replay of those
    bytes in that order."""
    deadline = time.monotonic() + 60
    while True:
        st = http.get(f"{protocol.API_PREFIX}/runs/{run}/status").json()
        if st["pending_deltas"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    seqs = sorted(seq for _, seq, _ in acks.values())
    assert seqs == list(range(1, len(acks) + 1)), "sequence numbers are dense and each lease has one"
    assert st["merged_deltas"] == len(acks) and st["rejected_deltas"] == 0 and st["pending_deltas"] == 0, st
    assert st["version"] == len(acks)

    # the database recorded exactly what the workers were told, byte for byte
    engine = create_engine(db_url)
    with Session(engine) as s:
        rows = s.execute(select(DeltaRecord.lease_id, DeltaRecord.seq, DeltaRecord.outcome, DeltaRecord.reason)
                         .order_by(DeltaRecord.seq)).all()
    engine.dispose()
    assert {lease: seq for lease, seq, _, _ in rows} == {lease: a[1] for lease, a in acks.items()}
    assert all(outcome == "merged" and reason is None for _, _, outcome, reason in rows)

    # final weights == an independent replay of the acknowledged bytes in seq order
    snap = _snapshot_of_version(http, run, len(acks))
    params, _ = decode_snapshot(snap, schema=param_schema(build_model(cfg.model)))
    in_order = [(body, base) for body, _, base in sorted(acks.values(), key=lambda a: a[1])]
    assert_same(params, replay(cfg, in_order))


def _snapshot_of_version(http: httpx.Client, run: str, version: int, timeout_s: float = 60.0) -> bytes:
    """The run's newest snapshot once it is of `version`. A merged version need not have its snapshot
    yet: one that took over 0.25 s (a loaded disk) holds the next ones back (settings.snapshot_duty)
    until the idle merger catches up, so snapshots/latest may lag the run's version meanwhile."""
    deadline = time.monotonic() + timeout_s
    while True:
        snap = http.get(f"{protocol.API_PREFIX}/runs/{run}/snapshots/latest")
        assert snap.status_code == 200, snap.text
        got = int(snap.headers[protocol.H_VERSION])
        if got == version:
            return snap.content
        assert got < version and time.monotonic() < deadline, f"the newest snapshot is of version {got}, not {version}"
        time.sleep(0.2)
