"""The coordinator's operations, one method each; routes call these and nothing else.

Every method validates first and changes nothing on a refusal. Deltas are acknowledged only
after their bytes are fsynced and their row committed.

Sparse exchanges (algorithms "sparta" and "sparta+diloco", see `Coordinator.exchange`) change
the global model between versions; the next merged version's snapshot contains them. Each one is
committed with its body and the version it followed, so a restart replays deltas and exchanges
in their original order.
"""

from __future__ import annotations

import hashlib
import logging
import math
import secrets
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path

import torch
import zstandard
from sqlalchemy import Connection, Row, and_, case, func, or_, select, update
from sqlalchemy.exc import IntegrityError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from coordinator import corpora, credit, limits, queries, scheduler, timing, trust
from coordinator.db import init_db, make_engine, make_sessionmaker
from coordinator.errors import (DISK_FULL_RETRY_S, Conflict, Forbidden, Gone, NotFound, RunUnrecoverable, ServiceError,
                                TooManyRequests, Unauthorized, Unavailable, Unprocessable)
from coordinator.leader import Leadership
from coordinator.models import (DeltaRecord, EvalResult, Exchange, Lease, ModelVersion, Refusal, Run, Shard, Worker,
                                utcnow)
from coordinator.ratelimit import RateLimiter, client_key
from coordinator.runtime import RunRuntime
from coordinator.settings import CoordinatorSettings
from coordinator.storage import ReceivedBody, Storage
from coordinator.traffic import TrafficCounter
from shared import codec, kernels, protocol
from shared.algorithms import sparta, sync
from shared.algorithms.compress import k_for, shape_mismatch, tensor_seed
from shared.algorithms.inner import scheduled_lr
from shared.config import RunConfig
from shared.data import cut_shards, load_corpus
from shared.errors import DeltaFormatError
from shared.model import ModelConfig, TransformerLM, build_model, count_params, param_schema
from shared.snapshot import decode_snapshot

log = logging.getLogger(__name__)


def _hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def _aware(dt: datetime) -> datetime:
    """SQLite hands datetimes back naive; they were stored as UTC."""
    return dt if dt.tzinfo else dt.replace(tzinfo=timezone.utc)


def _end_lease(s: Session, lease: Lease, state: str) -> None:
    """Mark a live lease expired or abandoned; its shard goes back to the queue if nobody else holds it."""
    lease.state = state
    s.flush()
    s.execute(queries.FREE_SHARD, {"shard": lease.shard_id})


def _judged_outcomes(s: Session | Connection, worker_id: int, cfg: RunConfig) -> list[tuple[str, str | None]]:
    """(outcome, reason) of the worker's last trust.RECENT judged events, oldest first: its deltas
    judged at merge that speak about the worker (trust.judged) and the requests refused for its own
    doing (Refusal rows, outcome "rejected"), interleaved by time."""
    rows = s.execute(select(DeltaRecord.outcome, DeltaRecord.reason, DeltaRecord.staleness,
                            DeltaRecord.received_at).where(
        DeltaRecord.worker_id == worker_id, DeltaRecord.outcome != "queued")
        .order_by(DeltaRecord.seq.desc()).limit(trust.RECENT)).all()
    refused = s.execute(select(Refusal.reason, Refusal.at).where(Refusal.worker_id == worker_id)
                        .order_by(Refusal.id.desc()).limit(trust.RECENT)).all()
    events = [(_aware(at), 0, (outcome, reason, staleness)) for outcome, reason, staleness, at in rows]
    events += [(_aware(at), 1, ("rejected", reason, None)) for reason, at in refused]
    events.sort(key=lambda e: (e[0], e[1]))
    return trust.judged([row for _, _, row in events[-trust.RECENT:]], max_staleness=cfg.outer.max_staleness)


def _aware_or_none(dt: datetime | None) -> datetime | None:
    return None if dt is None else _aware(dt)


def _thin(points: list, limit: int) -> list:
    """At most `limit` (>= 2) of `points`, evenly spread, the first and the last always among them."""
    if len(points) <= limit:
        return points
    step = (len(points) - 1) / (limit - 1)
    return [points[round(i * step)] for i in range(limit)]


class _Refused(Exception):
    """An upload refused inside the acknowledgement's transaction (Coordinator._ack): `error` to
    raise once the refusal is counted, `reason` when it counts against the worker's standing."""

    def __init__(self, error: ServiceError, reason: str | None) -> None:
        super().__init__(error.detail)
        self.error, self.reason = error, reason


class Coordinator:
    """Owns the database, the blob storage and each run's live state."""

    SEEN_EVERY_S = 5.0  # a worker's last_seen is written at most this often
    EXPIRE_EVERY_S = 0.5  # a lease request sweeps expired leases at most this often (per process)

    def __init__(self, settings: CoordinatorSettings) -> None:
        self.settings = settings
        self.storage = Storage(settings.data_dir)
        self.engine = make_engine(settings.resolved_database_url)
        init_db(self.engine)
        self.sessions: sessionmaker[Session] = make_sessionmaker(self.engine)
        # single statements, each its own transaction: no BEGIN or ROLLBACK round trip around a read
        self.reads = self.engine.execution_options(isolation_level="AUTOCOMMIT")
        self._claim_shard = queries.claim_shard(skip_locked=self.engine.dialect.name == "postgresql")
        self.runtimes: dict[int, RunRuntime] = {}  # live models: only in the leading process (coordinator/leader.py)
        self._runtimes_lock = threading.Lock()
        self.leads = True  # whether this process holds the live models (the app sets it from the merger lock)
        self._schemas: dict[int, dict[str, tuple[int, ...]]] = {}
        self.leadership: Leadership | None = None  # the merger lock, when the app took one
        self._expired_at = float("-inf")  # monotonic time of the last expiry sweep in this process
        self.traffic = TrafficCounter()  # bytes moved, written by flush_traffic (coordinator/traffic.py)
        self._flush_lock = threading.Lock()
        self._ack_lock = threading.Lock()  # one delta at a time takes the next sequence number
        # one model update built at a time in this process: a build holds two decoded snapshots (~1 GB
        # at 124M parameters) and seconds of CPU, and the workers that held the same version ask for
        # the same update at once; those waiting read the file the first one built
        self._update_build_lock = threading.Lock()
        self.updates_built = 0  # builds in this process (tests and operators: misses, not requests)
        self.limiter = RateLimiter({"lease": (settings.lease_rate, settings.lease_burst),
                                    "upload": (settings.upload_rate, settings.upload_burst),
                                    "exchange": (settings.exchange_rate, settings.exchange_burst),
                                    "register": (settings.register_rate, settings.register_burst)})
        # HTTP-layer bounds (coordinator/limits.py), per process: the routes hold an upload's or an
        # exchange's slot from before its body is read; decoding a body holds a validation slot
        self.uploads_in_flight = limits.InFlight(settings.max_concurrent_uploads, what="delta uploads")
        self.exchanges_in_flight = limits.InFlight(settings.max_concurrent_exchanges, what="exchanges")
        self.validations = limits.Slots(settings.max_validations, wait_s=settings.validation_wait_s,
                                        what="checking other uploads")

    # -- runs ---------------------------------------------------------------------------------

    def create_run(self, cfg: RunConfig) -> protocol.RunCreated:
        source = corpora.confine(cfg.corpus, self.settings.allowed_corpus_dirs)  # before reading a byte of it
        with self.sessions() as s:
            if s.scalar(select(Run.id).where(Run.name == cfg.name)) is not None:
                raise Conflict(f"a run named {cfg.name!r} exists already; pick another name")
        try:
            corpus = load_corpus(source, max_bytes=cfg.corpus_max_bytes)
            shards = cut_shards(corpus.train, cfg.shard_tokens, shuffle_seed=cfg.seed if cfg.shuffle_shards else None)
        except ValueError as exc:
            raise Unprocessable(str(exc)) from None
        eval_used = min(corpus.eval.size, cfg.eval_tokens)  # what evaluation reads (RunRuntime.eval_tokens)
        if eval_used < cfg.model.context + 1:
            raise Unprocessable(f"evaluation would read {eval_used} held-out bytes (the corpus holds out "
                                f"{corpus.eval.size}, eval_tokens is {cfg.eval_tokens}): fewer than one context "
                                f"of {cfg.model.context} + 1")
        n_params = count_params(build_model(cfg.model, seed=cfg.seed))
        with self.sessions() as s:
            run = Run(name=cfg.name, config_json=cfg.model_dump_json(), n_params=n_params,
                      train_tokens=int(sum(x.size for x in shards)), eval_tokens=int(corpus.eval.size),
                      join_key_hash=_hash_secret(cfg.join_key) if cfg.join_key else None, state="creating")
            s.add(run)
            s.commit()
            run_id = run.id
        cctx = zstandard.ZstdCompressor(level=3)
        shard_rows = []
        for i, tokens in enumerate(shards):
            self.storage.write(self.storage.shard(run_id, i), cctx.compress(tokens.tobytes()))
            shard_rows.append(Shard(run_id=run_id, index=i, n_tokens=int(tokens.size),
                                    sha256=hashlib.sha256(tokens.tobytes()).hexdigest()))
        self.storage.write(self.storage.eval_tokens(run_id), corpus.eval.tobytes())
        rt = RunRuntime.fresh(run_id=run_id, config=cfg, storage=self.storage)
        self._calibrate(rt)
        sha, size = rt.write_snapshot()
        rt.write_checkpoint()
        loss = rt.evaluate()
        with self.sessions() as s:
            s.add_all(shard_rows)
            s.add(ModelVersion(run_id=run_id, version=0, sha256=sha, size_bytes=size))
            s.add(EvalResult(run_id=run_id, version=0, loss=loss, tokens_trained=0))
            s.execute(update(Run).where(Run.id == run_id).values(state="active"))
            s.commit()
        if self.leads:  # otherwise the leader loads it from its checkpoint (sync_runs)
            with self._runtimes_lock:
                self.runtimes[run_id] = rt
        log.info("run %s created: %d shards, %d params, eval loss %.3f", cfg.name, len(shards), n_params, loss)
        return protocol.RunCreated(name=cfg.name, n_shards=len(shards), n_params=n_params,
                                   train_tokens=int(sum(x.size for x in shards)), eval_tokens=int(corpus.eval.size))

    def load_runs(self) -> None:
        """Rebuild every run's live state: the newest good checkpoint, then a replay of the deltas
        processed and the exchanges answered after it, in their original order."""
        with self.sessions() as s:
            runs = s.scalars(select(Run).where(Run.state != "creating")).all()
        for run in runs:
            self._load_run(run)

    def sync_runs(self) -> int:
        """Load the runs created since (by another coordinator process); returns how many."""
        with self.sessions() as s:
            runs = s.scalars(select(Run).where(Run.state != "creating", Run.id.not_in(list(self.runtimes)))).all()
        for run in runs:
            self._load_run(run)
        return len(runs)

    def drop_runs(self) -> None:
        """Forget every live model (this process stopped leading)."""
        with self._runtimes_lock:
            self.runtimes.clear()

    def schema_of(self, run_id: int) -> dict[str, tuple[int, ...]]:
        """Name -> shape of a run's tensors, in any process: what decoding a delta needs (no weights)."""
        rt = self.runtimes.get(run_id)
        if rt is not None:
            return rt.schema
        if run_id not in self._schemas:
            with self.sessions() as s:
                run = s.get(Run, run_id)
                if run is None:
                    raise NotFound(f"no run {run_id}")
                cfg = RunConfig.model_validate_json(run.config_json)
            with torch.device("meta"):  # shapes only: nothing allocated, nothing initialised
                self._schemas[run_id] = param_schema(TransformerLM(cfg.model))
        return self._schemas[run_id]

    def warm_up(self) -> None:
        """Do before the first requests what they would otherwise wait for: torch's first model build
        in a process (~0.8 s, even on the meta device), each run's schema, which every upload is
        checked against (a process's first upload took 0.9 s in `bench load`), and the compiled
        kernels that checking and merging use (shared/kernels.py: ~2 s to compile, less from cache)."""
        kernels.ready()  # compiles (or loads from numba's cache) the kernels now
        with self.sessions() as s:
            run_ids = s.scalars(select(Run.id).where(Run.state != "creating")).all()
        for run_id in run_ids:
            self.schema_of(run_id)
        if not run_ids:  # a run created later finds torch initialised: ~20 ms for its schema
            with torch.device("meta"):
                param_schema(TransformerLM(ModelConfig()))

    def flush_traffic(self) -> None:
        """Write the bytes counted in this process since the last flush (one transaction). One flush at a
        time: a reader that flushes first then sees every count taken before it, written."""
        with self._flush_lock:
            self._flush_traffic()

    def _flush_traffic(self) -> None:
        runs, workers = self.traffic.take()
        if not runs and not workers:
            return
        try:
            with self.sessions() as s:
                for run_id, (up, down_model, down_data) in runs.items():
                    s.execute(update(Run).where(Run.id == run_id).values(
                        bytes_up=Run.bytes_up + up, bytes_down_model=Run.bytes_down_model + down_model,
                        bytes_down_data=Run.bytes_down_data + down_data))
                for worker_id, (up, down) in workers.items():
                    s.execute(update(Worker).where(Worker.id == worker_id).values(
                        bytes_up=Worker.bytes_up + up, bytes_down=Worker.bytes_down + down))
                s.commit()
        except BaseException:
            self.traffic.put_back(runs, workers)
            raise

    def still_leading(self) -> bool:
        """Whether this process still holds the merger lock (always, without one: SQLite, tests)."""
        return self.leadership is None or self.leadership.still_held()

    def live(self, run_id: int, run_name: str) -> RunRuntime:
        """The run's live model; 503 in a process that does not lead (the routes relay to the leader)."""
        rt = self.runtimes.get(run_id)
        if rt is None and self.leads and self.sync_runs():  # created a moment ago by another process
            rt = self.runtimes.get(run_id)
        if rt is not None:
            return rt
        if not self.leads:
            raise Unavailable("this coordinator process does not hold the live model and the leading one "
                              "could not be reached; retry")
        raise NotFound(f"run {run_name!r} is not loaded")

    def reload_run(self, run_id: int) -> None:
        """Rebuild one run's live state from disk (the merger's way back after a failed commit)."""
        with self.sessions() as s:
            run = s.get(Run, run_id)
        self._load_run(run)

    def snapshot_newest(self, rt: RunRuntime) -> bool:
        """Write and record the snapshot of the run's newest version unless it has one already, or the
        database has moved past it (another process merges now). True if one was written."""
        with self.sessions() as s:
            if s.scalar(select(Run.version).where(Run.id == rt.run_id)) != rt.version:
                return False
            if s.scalar(select(ModelVersion.id).where(ModelVersion.run_id == rt.run_id,
                                                      ModelVersion.version == rt.version)) is not None:
                rt.snapshot_version = rt.version
                return False
        with rt.lock:  # exchanges (sparta) may be changing the weights meanwhile
            version = rt.version
            sha, size = rt.write_snapshot()
        try:
            with self.sessions() as s:
                s.add(ModelVersion(run_id=rt.run_id, version=version, sha256=sha, size_bytes=size))
                s.commit()
        except BaseException:
            rt.snapshot_version = None  # the file is there, its row is not: the merger's catch-up asks again
            raise
        return True

    def _load_run(self, run: Run) -> None:
        cfg = RunConfig.model_validate_json(run.config_json)
        rt = RunRuntime.from_checkpoint(run_id=run.id, config=cfg, storage=self.storage, max_version=run.version)
        if rt is None and (pruned := self.storage.pruned_through(run.id)):
            ckpts = self.storage.checkpoints(run.id)
            msg = (f"run {run.name}: no checkpoint in {ckpts} loads (each fails its hash, or is ahead of the "
                   f"database's version {run.version}), and the deltas up to version {pruned} were deleted once "
                   "checkpoints held them (keep_deltas is off), so the model cannot be rebuilt from version 0. "
                   "Put back a good checkpoint file (from a backup of the data dir) or the database that matches "
                   "the checkpoints, then start again")
            log.error("%s", msg)
            raise RunUnrecoverable(msg)
        fresh = rt is None
        if fresh:
            log.warning("run %s: no usable checkpoint; replaying from version 0", run.name)
            rt = RunRuntime.fresh(run_id=run.id, config=cfg, storage=self.storage)
            self._calibrate(rt)  # as create_run did: the replay takes the same decisions
        deltas, exchanges = self._replay(rt, run.version)
        # a checkpoint from before the reference round: the replay had none (a fresh one tried already)
        calibrated = not fresh and rt.reference_norm is None
        if calibrated:
            self._calibrate(rt)
        # Loading needs no writes: a coordinator restarted on a full disk comes up (reads served, writes
        # answered 503) and the merger writes these once there is room (Merger.catch_up_checkpoint,
        # catch_up_snapshot). Until then a restart replays the same deltas again: nothing is lost.
        if deltas or exchanges or calibrated:
            self._write_at_load(run.name, "the checkpoint after the replay",
                                lambda: (rt.write_checkpoint(), self.prune_history(rt)))
        # the crash came between snapshots: write the newest now, so leases hand it out
        self._write_at_load(run.name, f"the snapshot of version {rt.version}", lambda: self.snapshot_newest(rt))
        log.info("run %s resumed at version %d (%d deltas replayed, %d exchanges)", run.name, rt.version,
                 deltas, exchanges)
        with self._runtimes_lock:
            self.runtimes[run.id] = rt

    @staticmethod
    def _write_at_load(run_name: str, what: str, write: Callable[[], object]) -> None:
        """A write loading a run can do without: a full disk (or a database refusing writes) is logged,
        not fatal."""
        try:
            write()
        except (OSError, SQLAlchemyError) as exc:
            log.error("run %s: %s was not written (%s); the merger writes it once the disk has room",
                      run_name, what, exc)

    CALIBRATION_TOKENS = 1 << 20  # training tokens the reference round draws its batches from, at most

    def _calibrate(self, rt: RunRuntime) -> None:
        """The run's reference round (RunRuntime.calibrate) on its first shards, in index order (the
        same tokens whenever it is computed)."""
        dctx = zstandard.ZstdDecompressor()
        parts, n, i = [], 0, 0
        while n < self.CALIBRATION_TOKENS and (path := self.storage.shard(rt.run_id, i)).exists():
            raw = dctx.stream_reader(path.read_bytes()).read()
            parts.append(raw)
            n, i = n + len(raw), i + 1
        tokens = torch.frombuffer(bytearray(b"".join(parts)[:self.CALIBRATION_TOKENS]), dtype=torch.uint8)
        if tokens.numel() <= rt.config.model.context:
            log.warning("run %s: too few training tokens for a reference round; deltas are screened without one",
                        rt.config.name)
            return
        t0 = time.perf_counter()
        ref = rt.calibrate(tokens)
        log.info("run %s: reference round norm %.4g (%.1f s)", rt.config.name, ref, time.perf_counter() - t0)

    def prune_history(self, rt: RunRuntime) -> int:
        """Delete what every kept checkpoint already holds, once there are RunRuntime.CHECKPOINTS_KEPT of
        them: the received delta files up to the oldest one's version, and the bodies of the exchanges
        that came before it (their rows stay: they are counted, and keep a retried exchange from being
        applied twice). A restart from any kept checkpoint replays only what comes after it. Nothing
        goes with keep_deltas. Staged files no delta will adopt go either way (_drop_stale_staged).
        Returns the number of delta files deleted."""
        self._drop_stale_staged(rt.run_id)
        if self.settings.keep_deltas:
            return 0
        kept = self.storage.list_checkpoints(rt.run_id)
        if len(kept) < RunRuntime.CHECKPOINTS_KEPT:
            return 0
        through, done = kept[-1][0], self.storage.pruned_through(rt.run_id)
        if through <= done:
            return 0
        gone = self.storage.prune_deltas(rt.run_id, through)
        with self.sessions() as s:
            s.execute(update(Exchange).where(Exchange.run_id == rt.run_id, Exchange.after_version >= done,
                                             Exchange.after_version < through).values(body=b""))
            s.commit()
        log.debug("run %s: deltas up to version %d deleted (%d files): every kept checkpoint holds them",
                  rt.config.name, through, gone)
        return gone

    STAGED_KEEP_S = 3600.0  # a staged delta file this old is a leftover unless its delta still waits for it

    def _drop_stale_staged(self, run_id: int, now: float | None = None) -> int:
        """Delete staged delta files (storage.staged_delta) older than STAGED_KEEP_S that no queued delta
        will adopt: an upload that died before its row was committed (never acknowledged), or a retry's
        second copy of a delta already renamed to its sequence number; and the partial files of
        uploads a crash cut off (storage.receiving). Returns how many went."""
        now = time.time() if now is None else now
        gone = 0
        for path, lease_id, sha_part in self.storage.staged_deltas(run_id):
            try:
                if now - path.stat().st_mtime < self.STAGED_KEEP_S:
                    continue
            except OSError:  # gone meanwhile (renamed by the merger)
                continue
            with self.sessions() as s:
                rec = s.execute(select(DeltaRecord.seq, DeltaRecord.sha256).where(
                    DeltaRecord.lease_id == lease_id)).first()
            waits = (rec is not None and rec.sha256.startswith(sha_part)
                     and not self.storage.delta(run_id, rec.seq).exists())
            if not waits:
                path.unlink(missing_ok=True)
                gone += 1
        for path in self.storage.partial_uploads(run_id):  # a body still arriving was written to moments ago
            try:
                if now - path.stat().st_mtime >= self.STAGED_KEEP_S:
                    path.unlink(missing_ok=True)
                    gone += 1
            except OSError:
                continue
        return gone

    def _replay(self, rt: RunRuntime, up_to: int) -> tuple[int, int]:
        """Bring `rt` from its checkpoint to version `up_to`: after each version, the exchanges
        that followed it (by id), then the next delta. Snapshots are already on disk."""
        with self.sessions() as s:
            todo = s.execute(select(DeltaRecord.seq, DeltaRecord.base_version, DeltaRecord.lease_id,
                                    DeltaRecord.sha256, DeltaRecord.worker_id).where(
                DeltaRecord.run_id == rt.run_id, DeltaRecord.seq > rt.version,
                DeltaRecord.seq <= up_to).order_by(DeltaRecord.seq)).all()
        n_exchanges = 0

        def exchanges_after(version: int) -> None:
            nonlocal n_exchanges
            with self.sessions() as s:
                rows = s.execute(select(Exchange.id, Exchange.body, Exchange.worker_id).where(
                    Exchange.run_id == rt.run_id, Exchange.after_version == version,
                    Exchange.id > rt.last_exchange_id).order_by(Exchange.id)).all()
            for ex_id, body, worker_id in rows:
                rt.exchange(codec.decode(body, schema=rt.schema), exchange_id=ex_id, worker=worker_id)
                n_exchanges += 1

        exchanges_after(rt.version)
        for seq, base_version, lease_id, sha, worker_id in todo:
            self.storage.adopt_delta(rt.run_id, seq, lease_id, sha)  # acknowledged, not merged before the crash
            rt.merge(seq=seq, base_version=base_version, write_snapshot=False, worker=worker_id)
            exchanges_after(seq)
        return len(todo), n_exchanges

    def runtime_list(self) -> list[RunRuntime]:
        with self._runtimes_lock:
            return list(self.runtimes.values())

    def _run(self, s: Session, name: str) -> Run:
        return self._named_run(s.scalar(select(Run).where(Run.name == name)), name)

    @staticmethod
    def _named_run(run, name: str):
        """`run` (a Run or a row with its state), if it exists and is created: else 404."""
        if run is None or run.state == "creating":
            raise NotFound(f"no run named {name!r}")
        return run

    def list_runs(self) -> list[protocol.RunSummary]:
        with self.sessions() as s:
            return [protocol.RunSummary(name=r.name, state=r.state, version=r.version, created_at=_aware(r.created_at))
                    for r in s.scalars(select(Run).order_by(Run.id))]

    def run_config(self, name: str) -> RunConfig:
        with self.sessions() as s:
            return RunConfig.model_validate_json(self._run(s, name).config_json)

    def set_run_state(self, run_name: str, state: str) -> protocol.RunSummary:
        """Pause (no new leases; deltas and exchanges of live leases still count) or resume a run."""
        if state not in ("active", "paused"):
            raise Unprocessable(f"a run can be set active or paused, not {state!r}")
        with self.sessions() as s:
            run = self._run(s, run_name)
            run.state = state
            s.commit()
            log.info("run %s is now %s", run.name, state)
            return protocol.RunSummary(name=run.name, state=run.state, version=run.version,
                                       created_at=_aware(run.created_at))

    # -- workers ------------------------------------------------------------------------------

    @staticmethod
    def _worker_info(w: Worker) -> protocol.WorkerInfo:
        return protocol.WorkerInfo(
            worker_id=w.id, name=w.name, team=w.team, device=w.device, standing=w.standing,
            standing_reason=w.standing_reason, revoked=w.revoked, created_at=_aware(w.created_at),
            last_seen=_aware(w.last_seen), tokens_trained=w.tokens_trained, deltas_accepted=w.deltas_accepted,
            deltas_rejected=w.deltas_rejected, bytes_up=w.bytes_up, bytes_down=w.bytes_down, credit=w.credit or 0.0)

    def list_workers(self, run_name: str) -> list[protocol.WorkerInfo]:
        self.flush_traffic()
        with self.sessions() as s:
            run = self._run(s, run_name)
            return [self._worker_info(w) for w in s.scalars(select(Worker).where(Worker.run_id == run.id)
                                                             .order_by(Worker.id))]

    def _run_worker(self, s: Session, run_name: str, worker_id: int) -> Worker:
        run = self._run(s, run_name)
        w = s.get(Worker, worker_id)
        if w is None or w.run_id != run.id:
            raise NotFound(f"run {run_name!r} has no worker {worker_id}")
        return w

    def revoke_worker(self, run_name: str, worker_id: int) -> protocol.WorkerInfo:
        """Revoke a worker's token: every later request with it gets 403. Its active lease returns to the queue."""
        with self.sessions() as s:
            w = self._run_worker(s, run_name, worker_id)
            w.revoked = True
            for lease in s.scalars(select(Lease).where(Lease.worker_id == w.id, Lease.state == "active")):
                _end_lease(s, lease, "abandoned")
            s.commit()
            log.warning("run %s: worker %d revoked by the operator", run_name, worker_id)
            return self._worker_info(w)

    def readmit_worker(self, run_name: str, worker_id: int) -> protocol.WorkerInfo:
        """Lift a ban or throttle (robust merging's verdict); a revoked token stays revoked."""
        with self.sessions() as s:
            w = self._run_worker(s, run_name, worker_id)
            w.standing, w.standing_reason = "ok", None
            s.commit()
            log.warning("run %s: worker %d re-admitted by the operator", run_name, worker_id)
            return self._worker_info(w)

    def record_merge(self, s: Session, rec: DeltaRecord, cfg: RunConfig) -> None:
        """After the merger judged `rec`: count a rejection or award the credit of a merged delta
        (coordinator/credit.py), and update the worker's standing."""
        w = s.get(Worker, rec.worker_id)
        if w is None:
            return
        if rec.outcome == "rejected":
            w.deltas_rejected += 1
        elif rec.outcome == "merged":
            lease = s.get(Lease, rec.lease_id)
            return_s = (_aware(rec.received_at) - _aware(lease.created_at)).total_seconds()
            w.credit = (w.credit or 0.0) + credit.delta_credit(rec.tokens, return_s=return_s,
                                                               lease_ttl_s=cfg.lease_ttl_s)
        self._judge(s, w, cfg)

    @staticmethod
    def _judge(s: Session, w: Worker, cfg: RunConfig) -> None:
        """Update `w`'s standing from its recent judged events (coordinator/trust.py)."""
        verdict = trust.standing(_judged_outcomes(s, w.id, cfg), current=w.standing, cfg=cfg.robust)
        if verdict.state != w.standing:
            log.warning("run %s: worker %d is now %s: %s", cfg.name, w.id, verdict.state, verdict.reason)
            w.standing = verdict.state
            w.standing_reason = verdict.reason

    def register_worker(self, run_name: str, req: protocol.RegisterRequest, *,
                        client: str | None = None) -> protocol.RegisterResponse:
        key = client_key(client)  # an IPv6 client by its /64: its single addresses cost nothing
        wait = self.limiter.take("register", key)
        if wait > 0:
            raise TooManyRequests(f"too many registrations from {key}; retry in {wait:.1f} s", retry_after=wait)
        with self.sessions() as s:
            run = self._run(s, run_name)
            if run.join_key_hash is not None:
                if req.join_key is None:
                    raise Unauthorized(f"run {run_name!r} requires a join key (--join-key)")
                if not secrets.compare_digest(_hash_secret(req.join_key), run.join_key_hash):
                    raise Forbidden("wrong join key")
            token = secrets.token_urlsafe(32)
            worker = Worker(run_id=run.id, token_hash=_hash_secret(token), name=req.name, team=req.team,
                            device=req.device)
            s.add(worker)
            s.commit()
            return protocol.RegisterResponse(worker_id=worker.id, token=token)

    def authenticate(self, token: str | None) -> Worker:
        if not token:
            raise Unauthorized("missing bearer token: register with POST /api/v1/runs/{run}/workers",
                               headers={"WWW-Authenticate": "Bearer"})
        with timing.phase("auth"), self.reads.connect() as c:
            row = c.execute(queries.WORKER_BY_TOKEN, {"token": _hash_secret(token)}).first()
            if row is None:
                raise Unauthorized("unknown token", headers={"WWW-Authenticate": "Bearer"})
            worker = Worker(**row._mapping)  # detached: the request reads it, nothing writes through it
            if worker.revoked:
                raise Forbidden("this worker's token was revoked by the operator")
            if worker.standing == "banned":
                raise Forbidden(f"this worker is banned: {worker.standing_reason}; ask the operator")
            now = utcnow()
            # last_seen feeds the dashboard's five-minute "live" window: a write every few seconds per
            # worker is plenty, not one per request
            if (now - _aware(worker.last_seen)).total_seconds() >= self.SEEN_EVERY_S:
                c.execute(queries.WORKER_SEEN, {"worker": worker.id, "now": now})
                worker.last_seen = now
            return worker

    # -- leases -------------------------------------------------------------------------------

    def expire_leases(self, now: datetime | None = None) -> int:
        """Return the shards of leases past their deadline to the queue."""
        self._expired_at = time.monotonic()
        now = now or utcnow()
        with self.sessions() as s:
            dead = s.scalars(select(Lease).where(Lease.state == "active", Lease.deadline <= now)).all()
            for lease in dead:
                log.info("lease %d of worker %d expired; its shard goes back to the queue", lease.id,
                         lease.worker_id)
                _end_lease(s, lease, "expired")
            s.commit()
            return len(dead)

    def _rate_limit(self, action: str, worker: Worker) -> None:
        """429 when this worker is over its `action` budget (settings: <action>_rate, <action>_burst)."""
        wait = self.limiter.take(action, worker.id)
        if wait > 0:
            raise TooManyRequests(f"too many {action} requests from this worker; retry in {wait:.1f} s",
                                  retry_after=wait)

    @staticmethod
    def _check_throttle(s: Session | Connection, worker: Worker, cfg: RunConfig) -> None:
        """429 while a throttled worker's next lease is not due yet."""
        if worker.standing != "throttled":
            return
        recent = _judged_outcomes(s, worker.id, cfg)
        wait = trust.throttle_wait(rejections=sum(outcome == "rejected" for outcome, _ in recent),
                                   last_lease_at=_aware_or_none(worker.last_lease_at), now=utcnow(), cfg=cfg.robust)
        if wait > 0:
            raise TooManyRequests(f"this worker is throttled ({worker.standing_reason}); "
                                  f"next lease in {wait:.0f} s", retry_after=wait)

    def grant_lease(self, run_name: str, worker: Worker, *, keep: int | None = None,
                    client: str | None = None) -> protocol.Lease | None:
        """A new lease for `worker`. Its earlier live leases are given up (it restarted or lost them),
        except `keep`: the one whose delta it is still uploading while it trains the next round.
        `client`: the requester's address (ratelimit.client_key): one address holds at most
        settings.max_leases_per_address live leases of a run (429 past it), so tokens minted from
        one address cannot take every shard."""
        self._rate_limit("lease", worker)
        if time.monotonic() - self._expired_at >= self.EXPIRE_EVERY_S:  # the merger sweeps too, every second
            with timing.phase("expire"):
                self.expire_leases()
        with timing.phase("lease"):
            return self._grant_lease(run_name, worker, keep, client)

    ADDRESS_RETRY_S = 30.0  # Retry-After for an address at its lease cap: a round's length is unknown here

    def _grant_lease(self, run_name: str, worker: Worker, keep: int | None,
                     client: str | None = None) -> protocol.Lease | None:
        # One transaction: give up the worker's earlier leases, claim a shard (queries.claim_shard:
        # picked and claimed in one UPDATE, concurrent requests take different rows), insert the
        # lease. Only when no pending shard was free does it look further: a new epoch when every
        # shard is done, another try when pending shards were only being claimed that instant.
        cfg: RunConfig | None = None
        for _ in range(16):
            with self.engine.connect() as c:
                run = self._named_run(c.execute(queries.RUN_FOR_LEASE, {"name": run_name}).first(), run_name)
                if cfg is None:  # the first attempt checks the request
                    if worker.run_id != run.id:
                        raise Forbidden(f"this worker is registered with another run, not {run_name!r}")
                    if run.state != "active":
                        return None
                    cfg = RunConfig.model_validate_json(run.config_json)
                    self._check_throttle(c, worker, cfg)
                    if keep is not None:
                        self._own_lease_row(c, keep, worker)
                # A worker asking again has given up its previous lease (it restarted, or lost it), unless it
                # says the lease's delta is on its way.
                for _old, shard_id in c.execute(queries.ABANDON_OTHERS, {
                        "worker": worker.id, "keep": -1 if keep is None else keep}).all():
                    c.execute(queries.FREE_SHARD, {"shard": shard_id})
                if client is not None:  # counted after the worker's own earlier leases were given up
                    held = c.execute(queries.LEASES_OF_CLIENT, {"run": run.id, "client": client,
                                                                "now": utcnow()}).scalar_one()
                    if held >= self.settings.max_leases_per_address:
                        c.rollback()  # nothing changes: the earlier leases stay live
                        raise TooManyRequests(
                            f"address {client} holds {held} live leases of run {run_name!r}, the most one address "
                            f"may hold (max_leases_per_address); ask again when one of them is delivered",
                            retry_after=self.ADDRESS_RETRY_S)
                claimed = c.execute(self._claim_shard, {"run": run.id}).first()
                if claimed is None:
                    undone = dict(c.execute(queries.SHARDS_UNDONE, {"run": run.id}).all())
                    if undone.get("pending"):  # pending rows exist but others hold them this instant
                        c.commit()
                        continue
                    pick = scheduler.pick_shard([] if undone else [scheduler.ShardView(0, 0, "done", 0)])
                    if pick.shard_id is None:  # the rest are all out on lease
                        c.commit()
                        return None
                    # every shard done: one request opens the next epoch, all then pick again
                    opened = c.execute(update(Run).where(Run.id == run.id, Run.epoch == run.epoch)
                                       .values(epoch=Run.epoch + 1)).rowcount
                    if opened:
                        c.execute(update(Shard).where(Shard.run_id == run.id, Shard.state == "done")
                                  .values(state="pending"))
                    c.commit()
                    continue
                now = utcnow()
                c.execute(queries.WORKER_LEASED, {"worker": worker.id, "now": now})
                lr = scheduled_lr(cfg.inner, tokens_done=run.tokens_trained, schedule_tokens=cfg.schedule_tokens)
                deadline = scheduler.lease_deadline(now, cfg.lease_ttl_s)
                lease_id, base_version = c.execute(queries.INSERT_LEASE, {
                    "run": run.id, "worker": worker.id, "shard": claimed.id, "lease_lr": lr,
                    "until": deadline, "now": now, "client": client}).one()
                seed = scheduler.lease_seed(cfg.seed, lease_id)
                c.execute(queries.LEASE_SEED, {"lease": lease_id, "lease_seed": seed})
                c.commit()
                return protocol.Lease(
                    lease_id=lease_id, run=run.name, shard_id=claimed.index, shard_sha256=claimed.sha256,
                    base_version=base_version, seed=seed, lr=lr, inner=cfg.inner,
                    compression=cfg.compression, model=cfg.model.to_dict(), deadline=deadline,
                    algorithm=cfg.algorithm, sparta=cfg.sparta, init_seed=cfg.seed)
        return None  # lost every race this time; the worker asks again after Retry-After

    # -- blobs --------------------------------------------------------------------------------

    @staticmethod
    def _newest_snapshot(s: Session, run_id: int) -> int:
        """The newest version with a snapshot on disk (what leases hand out and `latest` serves)."""
        return s.scalar(select(queries.newest_snapshot(run_id)))

    def snapshot(self, run_name: str, version: str | int, *,
                 if_none_match: str | None = None) -> tuple[bytes | None, int, str]:
        """(blob, version, sha256); blob is None when `if_none_match` is the current ETag (nothing sent or counted)."""
        latest = version == "latest"
        with self.reads.connect() as c:
            row = self._named_run(c.execute(
                queries.SNAPSHOT_LATEST if latest else queries.SNAPSHOT_AT,
                {"name": run_name} if latest else {"name": run_name, "version": int(version)}).first(), run_name)
        v = row.version
        if row.sha256 is None:
            if 0 <= v <= row.run_version:
                raise Gone(f"version {v} is no longer kept; fetch snapshots/latest")
            raise NotFound(f"run {run_name!r} has no version {v} (latest is {row.run_version})")
        if if_none_match == f'"{row.sha256}"':
            return None, v, row.sha256
        try:
            blob = self.storage.snapshot(row.run_id, v).read_bytes()
        except FileNotFoundError:
            raise Gone(f"version {v} is no longer kept; fetch snapshots/latest") from None
        self.traffic.add(row.run_id, down_model=len(blob))
        return blob, v, row.sha256

    def model_update(self, run_name: str, from_version: int, to_version: int) -> tuple[bytes, str]:
        """(blob, sha256): the change from one kept version to a later one, int8 or int4 by the run's
        update_values (shared/algorithms/sync.py).

        Built once per (from, to) and kept beside the snapshots, so the workers that hold the same
        version share it: one build at a time per process, and requests arriving during a build of
        their pair wait for its file instead of building it again. A version that is no longer kept
        answers 410 (fetch the full snapshot)."""
        if to_version <= from_version:
            raise Unprocessable(f"an update goes forward: {from_version} -> {to_version} does not")
        with self.sessions() as s:
            run = self._run(s, run_name)
            if to_version > run.version:
                raise NotFound(f"run {run_name!r} has no version {to_version} (latest is {run.version})")
            config_json = run.config_json
            rows = {r.version: r for r in s.scalars(select(ModelVersion).where(
                ModelVersion.run_id == run.id, ModelVersion.version.in_([from_version, to_version])))}
            run_id = run.id
        if len(rows) < 2:
            missing = from_version if from_version not in rows else to_version
            raise Gone(f"version {missing} is no longer kept; fetch snapshots/{to_version} instead")
        path = self.storage.update(run_id, from_version, to_version)
        try:
            blob = path.read_bytes()
        except FileNotFoundError:
            with self._update_build_lock:
                try:  # built by another request while this one waited
                    blob = path.read_bytes()
                except FileNotFoundError:
                    blob = self._build_update(run_id, config_json, from_version, to_version)
                    self.storage.write(path, blob)
                    self.updates_built += 1
        self.traffic.add(run_id, down_model=len(blob))
        return blob, hashlib.sha256(blob).hexdigest()

    def _build_update(self, run_id: int, config_json: str, from_version: int, to_version: int) -> bytes:
        schema = self.schema_of(run_id)
        try:
            old, _ = decode_snapshot(self.storage.snapshot(run_id, from_version).read_bytes(), schema=schema)
            new, _ = decode_snapshot(self.storage.snapshot(run_id, to_version).read_bytes(), schema=schema)
        except FileNotFoundError:
            raise Gone(f"a snapshot between {from_version} and {to_version} is no longer kept; "
                       f"fetch snapshots/{to_version} instead") from None
        values = RunConfig.model_validate_json(config_json).update_values  # built once: only on a miss
        return codec.encode(sync.model_update(old, new, from_version=from_version, values=values))

    def shard(self, run_name: str, shard_index: int, worker: Worker) -> tuple[bytes, str]:
        with self.reads.connect() as c:
            row = self._named_run(c.execute(queries.SHARD_OF, {"name": run_name, "index": shard_index}).first(),
                                  run_name)
        if worker.run_id != row.run_id:
            raise Forbidden(f"this worker is registered with another run, not {run_name!r}")
        if row.sha256 is None:
            raise NotFound(f"run {run_name!r} has no shard {shard_index}")
        blob = self.storage.shard(row.run_id, row.index).read_bytes()
        self.traffic.add(row.run_id, worker.id, down_data=len(blob))
        return blob, row.sha256

    # -- deltas -------------------------------------------------------------------------------

    def precheck_upload(self, lease_id: int, worker: Worker) -> int:
        """What refuses an upload before a byte of its body is read (then accept_delta(prechecked=True)):
        the upload rate limit (its token is taken here), a lease that does not exist (404), is another
        worker's (403) or was given up (410). A lease already delivered passes: whether the body is a
        retry of the same bytes (the same answer) or other content (409) takes its hash. Returns the
        lease's run id (where the body is streamed to: Storage.receiving)."""
        self._rate_limit("upload", worker)
        with timing.phase("check"), self.reads.connect() as c:
            lease = self._owned(c.execute(queries.UPLOAD_CHECK, {"lease": lease_id}).first(), lease_id, worker)
        if lease.delta_id is None and lease.state == "abandoned":
            raise Gone(f"lease {lease_id} was given up when this worker took a newer lease")
        return lease.run_id

    def precheck_exchange(self, lease_id: int, worker: Worker) -> None:
        """An exchange's checks before its body is read: the lease exists and is this worker's (404/403).
        The rest (rate limit, state, step) is exchange()'s."""
        with timing.phase("check"), self.reads.connect() as c:
            self._owned(c.execute(queries.LEASE_OF, {"lease": lease_id}).first(), lease_id, worker)

    def accept_delta(self, lease_id: int, worker: Worker, body: bytes | ReceivedBody, *,
                     prechecked: bool = False) -> protocol.DeltaAccepted:
        """Validate and acknowledge a lease's delta: 202's answer once its bytes are fsynced and its row
        committed. `body`: its bytes, or the file the route streamed it to (storage.ReceivedBody, hashed
        as it arrived; renamed to its staged name once it passes). `prechecked`: precheck_upload ran
        before the body was read (and took the rate limit's token)."""
        if not prechecked:
            self._rate_limit("upload", worker)
        with timing.phase("hash"):
            digest = body.sha256 if isinstance(body, ReceivedBody) else hashlib.sha256(body).hexdigest()
        with timing.phase("check"), self.reads.connect() as c:
            lease = self._owned(c.execute(queries.UPLOAD_CHECK, {"lease": lease_id}).first(), lease_id, worker)
        if lease.delta_id is not None:
            if lease.delta_sha256 == digest:  # a retry after a lost answer: same answer, merged once
                return protocol.DeltaAccepted(lease_id=lease_id, delta_id=lease.delta_id,
                                              will_merge_into=lease.delta_seq, duplicate=True)
            raise Conflict(f"lease {lease_id} already delivered a different delta")
        if lease.state == "abandoned":
            raise Gone(f"lease {lease_id} was given up when this worker took a newer lease")
        cfg = RunConfig.model_validate_json(lease.config_json)

        def refuse(error: type[ServiceError], message: str, *, judged: bool = True) -> ServiceError:
            """Count the refusal (against the worker's standing when it was its own doing) and
            return the error to raise."""
            self._count_rejection(worker.id, lease.run_id, len(body), reason=message if judged else None)
            return error(message)

        try:
            # the codec's every check (decode_flat's), without building the delta: the merger decodes it.
            # A few at a time per process (settings.max_validations: each holds its decompressed
            # body), and a frame may not expand more than an honest one can (codec.MAX_UPLOAD_RATIO).
            with self.validations.hold(), timing.phase("validate"):
                delta = codec.check_flat(body.read() if isinstance(body, ReceivedBody) else body,
                                         schema=self.schema_of(lease.run_id), max_ratio=codec.MAX_UPLOAD_RATIO)
        except DeltaFormatError as exc:
            raise refuse(Unprocessable, f"delta refused: {exc}") from None
        if delta.base_version != lease.base_version:
            raise refuse(Unprocessable, f"delta says base version {delta.base_version}, "
                                        f"but lease {lease_id} handed out version {lease.base_version}")
        if cfg.algorithm != "sparta" and not delta.n_entries:
            raise refuse(Unprocessable, f"run {lease.run_name!r} uses {cfg.algorithm}: a round ends with its "
                                        "pseudo-gradient, not an empty delta")
        if cfg.algorithm == "sparta" and delta.n_entries:
            raise refuse(Unprocessable, f"run {lease.run_name!r} uses sparta: a round ends with an empty delta (its "
                                        f"progress travels through exchanges), not one of {delta.n_entries} entries")
        if cfg.algorithm != "sparta":  # what the lease's compression makes of a whole round, nothing less
            wrong = shape_mismatch(delta.entries, self.schema_of(lease.run_id), cfg.compression,
                                   round_seed=lease.seed)
            if wrong is not None:
                raise refuse(Unprocessable, f"delta refused: {wrong}")
        if lease.run_version - lease.base_version > cfg.outer.max_staleness:
            # the coordinator's queue, not the worker's doing: counted, but not against its standing
            raise refuse(Gone, f"lease {lease_id} is {lease.run_version - lease.base_version} versions stale, "
                               f"above the run's limit of {cfg.outer.max_staleness}; take a new lease", judged=False)
        tokens = scheduler.round_tokens(steps=cfg.inner.steps, batch_size=cfg.inner.batch_size,
                                        context=cfg.model.context)
        steps = cfg.inner.steps
        if cfg.algorithm == "sparta":  # the empty delta is evidence of nothing: the exchanges made are
            with self.reads.connect() as c:
                made = c.execute(queries.EXCHANGES_OF, {"lease": lease_id}).scalar_one()
            expected = cfg.inner.steps // cfg.sparta.every
            tokens = credit.sparta_tokens(tokens, exchanges_made=made, exchanges_expected=expected)
            steps = credit.sparta_tokens(steps, exchanges_made=made, exchanges_expected=expected)
        # Bytes first, durably, under a name of their lease and content, before the serial section:
        # only the row then makes the delta real, and the merger renames the file to its sequence number.
        staged = self.storage.staged_delta(lease.run_id, lease_id, digest)
        with timing.phase("write"):
            if isinstance(body, ReceivedBody):
                self.storage.stage_received(body, staged)
            else:
                self.storage.write(staged, body)
        with timing.phase("ack_wait"):
            self._ack_lock.acquire()
        try:
            with self.engine.connect() as c:
                return self._ack(c, lease_id, lease, worker, body, digest, tokens, cfg, staged, steps=steps)
        except _Refused as refused:  # after the rollback: counted in a transaction of its own
            self._count_rejection(worker.id, lease.run_id, len(body), reason=refused.reason)
            raise refused.error from None
        finally:
            self._ack_lock.release()

    def _ack(self, c: Connection, lease_id: int, lease: Row, worker: Worker, body: bytes, digest: str, tokens: int,
             cfg: RunConfig, staged: Path, *, steps: int | None = None) -> protocol.DeltaAccepted:
        """The acknowledgement itself, under the process's _ack_lock: the delta's sequence number, its
        row and every count, in one transaction (its bytes are on disk already, at `staged`). Rows
        are locked in queries' order (lease, shard, run, worker): the run's row, which serialises the
        acknowledgements, is held for the last three statements only.

        Refused here, under those locks so that no two processes both pass (raises _Refused, after
        the rollback, its file removed): an expired lease whose shard was re-issued since (410), and
        bytes another lease of the run delivered already (409: identical content merges once)."""
        steps = cfg.inner.steps if steps is None else steps
        with timing.phase("lock"):
            delivered = c.execute(queries.LEASE_DELIVERED, {"lease": lease_id}).first()
            if delivered is None:
                c.rollback()  # the same upload raced itself and the first one won, or the lease was given up
                prior = c.execute(queries.DELIVERED_OF, {"lease": lease_id}).first()
                c.rollback()
                if prior is None:  # given up since the upload's checks (the worker took a newer lease)
                    staged.unlink(missing_ok=True)
                    raise _Refused(Gone(f"lease {lease_id} was given up when this worker took a newer lease"), None)
                if prior.sha256 != digest:
                    staged.unlink(missing_ok=True)  # ours alone: the delivered delta's file has another name
                    raise Conflict(f"lease {lease_id} already delivered a different delta")
                return protocol.DeltaAccepted(lease_id=lease_id, delta_id=prior.id,
                                              will_merge_into=prior.seq, duplicate=True)
            c.execute(queries.SHARD_TRAINED, {"shard": lease.shard_id})  # the shard's row is ours now
            # Past its deadline (swept or not), a lease delivers only while its shard was not
            # re-issued: otherwise the shard is trained twice and a hoarder keeps its leases' credit.
            if ((lease.state == "expired" or _aware(delivered.deadline) <= utcnow())
                    and c.execute(queries.SHARD_REISSUED, {"shard": lease.shard_id, "lease": lease_id}).first()):
                c.rollback()
                staged.unlink(missing_ok=True)
                raise _Refused(Gone(f"lease {lease_id} expired and its shard was leased again since; its delta "
                                    "is not taken (the shard's new holder trains it): take a new lease"), None)
            seq = c.execute(queries.RUN_DELIVERED, {"run": lease.run_id, "tokens": tokens,
                                                    "steps": steps, "size": len(body)}).scalar_one() - 1
            # the run's row is ours: every earlier acknowledgement of the run is committed and seen.
            # Not for sparta, whose every round of a version ends with the same empty delta.
            copied = None if cfg.algorithm == "sparta" else c.execute(queries.SAME_CONTENT, {
                "run": lease.run_id, "digest": digest, "lease": lease_id}).first()
            if copied is not None:
                c.rollback()
                staged.unlink(missing_ok=True)
                reason = (f"delta refused: lease {copied.lease_id} of this run delivered these exact bytes "
                          "already; identical content is merged once")
                raise _Refused(Conflict(reason), reason)
        with timing.phase("commit"):
            c.execute(queries.WORKER_DELIVERED, {"worker": worker.id, "tokens": tokens, "size": len(body)})
            delta_id = c.execute(queries.INSERT_DELTA, {
                "run": lease.run_id, "lease": lease_id, "worker": worker.id, "seq_no": seq,
                "base": lease.base_version, "size": len(body), "digest": digest, "round_tokens": tokens,
                "round_steps": steps, "now": utcnow()}).scalar_one()
            c.commit()
        return protocol.DeltaAccepted(lease_id=lease_id, delta_id=delta_id, will_merge_into=seq)

    # -- sparse exchanges (sparta) -------------------------------------------------------------

    def exchange(self, lease_id: int, step: int, worker: Worker, body: bytes) -> bytes:
        """One sparse exchange after local step `step` of a lease; returns the encoded correction.

        `body` is what shared.algorithms.sparta.select encodes: the worker's values at the indices
        drawn from exchange_seed(lease.seed, step), every tensor once, k = k_for(numel, sparta.p).
        The centre is pulled toward them (mix_into_centre) under the run's lock and the answer is
        the correction d the worker subtracts. Each (lease, step) counts once (409 after that).

        The exchange is committed (with its body and the version it followed) before the answer
        leaves, so after a crash the restart replays it in its place (see load_runs).
        """
        self._rate_limit("exchange", worker)
        with self.sessions() as s:
            lease = self._own_lease(s, lease_id, worker)
            run = s.get(Run, lease.run_id)
            cfg = RunConfig.model_validate_json(run.config_json)
            if "sparta" not in cfg.algorithm:
                raise Conflict(f"run {run.name!r} uses {cfg.algorithm!r}, which has no exchanges")
            if lease.state != "active" or _aware(lease.deadline) <= utcnow():
                state = "expired" if lease.state == "active" else lease.state
                raise Gone(f"lease {lease_id} is {state}; exchanges need an active lease")
            every, steps = cfg.sparta.every, cfg.inner.steps
            if not 1 <= step <= steps or step % every:
                raise Unprocessable(f"step {step} is not an exchange step of this run: exchanges follow local "
                                    f"steps {every}, {2 * every}, ... up to {steps}")
            if s.scalar(select(Exchange.id).where(Exchange.lease_id == lease_id, Exchange.step == step)) is not None:
                raise Conflict(f"lease {lease_id} already exchanged after step {step}")
            lease_seed, base_version, run_id, run_name = lease.seed, lease.base_version, run.id, run.name
            # AdamW steps trained in the run so far, plus those of every live lease (in flight, this
            # one's included): how far apart honest replicas and the centre can have moved, per element
            in_flight = s.scalar(select(func.count()).select_from(Lease).where(
                Lease.run_id == run_id, Lease.state == "active")) or 0
            run_steps = run.worker_steps + steps * max(1, in_flight)
        rt = self.live(run_id, run_name)
        try:
            # a bounded pool and ratio as for uploads (accept_delta); a malformed body is the worker's doing
            with self.validations.hold(), timing.phase("validate"):
                sent = codec.decode(body, schema=rt.schema, max_ratio=codec.MAX_UPLOAD_RATIO)
        except DeltaFormatError as exc:
            reason = f"exchange refused: {exc}"
            self._count_rejection(worker.id, run_id, len(body), reason=reason, kind="exchange")
            raise Unprocessable(reason) from None
        self._check_exchange(sent, rt.schema, seed=sparta.exchange_seed(lease_seed, step), p=cfg.sparta.p,
                             base_version=base_version, lease_id=lease_id)
        with rt.lock:
            verdict = rt.screen_exchange(sent, steps=run_steps)
        if not verdict.merged:  # the worker's own doing: counts toward throttle and ban, changes nothing else
            message = f"exchange refused: {verdict.reason}"
            self._count_rejection(worker.id, run_id, len(body), reason=message, kind="exchange")
            raise Unprocessable(message)
        with rt.lock:
            # Keep the centre's values at the exchanged indices and the screen's exchange norms, so a
            # failure below can put them back: a refused exchange changes nothing. (An exchange of
            # another worker between the screen and here moved the centre by a bounded step only.)
            if rt.ahead:  # a failed merge step left it ahead of the database; the merger reloads the run
                raise Unavailable("the coordinator is recovering from a failed merge (its disk may be full); retry",
                                  retry_after=DISK_FULL_RETRY_S)
            before, norms_before = rt.centre_at(sent), rt.exchange_norms.copy()
            try:
                answer = codec.encode(rt.exchange(sent, worker=worker.id))
                if not self.still_leading():  # fence: a process that lost the merger lock answers nothing more
                    raise Unavailable("the merger is changing hands between coordinator processes; retry")
                with self.sessions() as s:
                    row = Exchange(run_id=run_id, lease_id=lease_id, worker_id=worker.id, step=step,
                                   after_version=rt.version, body=body, bytes_in=len(body), bytes_out=len(answer))
                    s.add(row)
                    s.commit()
                    rt.last_exchange_id = row.id
                self.traffic.add(run_id, worker.id, up=len(body), down_model=len(answer))
            except BaseException as exc:
                rt.undo_exchange(sent, before)
                rt.exchange_norms = norms_before
                if isinstance(exc, IntegrityError):  # the same exchange raced itself; the first one won
                    raise Conflict(f"lease {lease_id} already exchanged after step {step}") from None
                if isinstance(exc, ValueError):  # the correction does not fit its value codec
                    raise Unprocessable(f"exchange refused: its correction cannot be encoded: {exc}") from None
                raise
        return answer

    @staticmethod
    def _check_exchange(sent: codec.Delta, schema: dict[str, tuple[int, ...]], *, seed: int, p: float,
                        base_version: int, lease_id: int) -> None:
        """Every tensor once, at the indices the exchange's seed draws: a worker never picks its own."""
        if sent.base_version != base_version:
            raise Unprocessable(f"exchange says base version {sent.base_version}, "
                                f"but lease {lease_id} handed out version {base_version}")
        missing = sorted(set(schema) - {e.name for e in sent.entries})
        if missing:
            raise Unprocessable(f"exchange refused: it must carry every tensor; missing {missing[:5]}")
        for e in sent.entries:
            want_seed, want_k = tensor_seed(seed, e.name), k_for(e.numel, p)
            if e.index_kind != codec.IndexKind.SEEDED or e.seed != want_seed:
                raise Unprocessable(f"exchange refused: {e.name} must use the seeded indices of this exchange "
                                    f"(seed {want_seed}), not {e.index_kind.name.lower()} ones of its own")
            if e.k != want_k:
                raise Unprocessable(f"exchange refused: {e.name} carries {e.k} values; this run exchanges "
                                    f"{want_k} of its {e.numel}")

    def renew_lease(self, lease_id: int, worker: Worker, *, step: int | None = None,
                    now: datetime | None = None) -> protocol.LeaseRenewed:
        """Push a live lease's deadline to now + lease_ttl_s while its round progresses (a slow machine
        still training keeps its shard): `step`, the round's local step, must be past the one the last
        renewal reported (409 otherwise), and the deadline never passes the lease's lifetime
        (scheduler.lease_lifetime_s: a few of the run's expected rounds, at most max_lease_lifetime_s;
        409 once there), so no one holds a shard for ever. 410 once it expired or was given up (its
        shard may be someone else's by now)."""
        self._rate_limit("lease", worker)
        now = now or utcnow()
        with self.sessions() as s:
            lease = self._own_lease(s, lease_id, worker)
            if lease.state != "active" or _aware(lease.deadline) <= now:
                state = "expired" if lease.state == "active" else lease.state
                raise Gone(f"lease {lease_id} is {state}; it can no longer be renewed")
            cfg = RunConfig.model_validate_json(s.get(Run, lease.run_id).config_json)
            if step is None:
                raise Unprocessable(f"renewing lease {lease_id} needs the round's local step (?step=N): a lease "
                                    "is renewed only while its round progresses; update the worker")
            if step > cfg.inner.steps:
                reason = (f"renewal of lease {lease_id} reports local step {step}, but the run's rounds have "
                          f"{cfg.inner.steps} steps")
                self._count_rejection(worker.id, lease.run_id, 0, reason=reason, kind="renew")
                raise Unprocessable(reason)
            if step <= lease.progress_step:
                raise Conflict(f"lease {lease_id}: no progress since its last renewal (step {step}; that one "
                               f"reported step {lease.progress_step}); a lease is renewed only while its round moves")
            round_times = [(_aware(received) - _aware(created)).total_seconds()
                           for received, created in s.execute(queries.RECENT_ROUNDS, {"run": lease.run_id})]
            lifetime_s = scheduler.lease_lifetime_s(round_times, lease_ttl_s=cfg.lease_ttl_s,
                                                    rounds=self.settings.lease_lifetime_rounds,
                                                    cap_s=self.settings.max_lease_lifetime_s)
            deadline = scheduler.renewed_deadline(now, created_at=_aware(lease.created_at), ttl_s=cfg.lease_ttl_s,
                                                  lifetime_s=lifetime_s)
            if deadline <= _aware(lease.deadline):
                raise Conflict(f"lease {lease_id} has lived its lifetime of {lifetime_s:.0f} s (a few of this run's "
                               f"expected rounds) and is not renewed again: deliver by its deadline "
                               f"{_aware(lease.deadline).isoformat()}, after which its shard goes to another worker")
            renewed = s.execute(update(Lease).where(Lease.id == lease_id, Lease.state == "active")
                                .values(deadline=deadline, progress_step=step)).rowcount
            if not renewed:  # expired by the sweep a moment ago
                raise Gone(f"lease {lease_id} expired; it can no longer be renewed")
            s.commit()
            return protocol.LeaseRenewed(lease_id=lease_id, deadline=deadline)

    def release_lease(self, lease_id: int, worker: Worker) -> None:
        """The worker gives a live lease up (it stops before training it): its shard goes back to the
        queue now instead of at the deadline. Giving up a lease already given up or expired changes
        nothing; 409 for one whose delta was delivered."""
        self._rate_limit("lease", worker)
        with self.sessions() as s:
            lease = self._own_lease(s, lease_id, worker)
            if lease.state == "delivered":
                raise Conflict(f"lease {lease_id} delivered its delta; there is nothing to give up")
            if lease.state == "active":
                _end_lease(s, lease, "abandoned")
                s.commit()

    @staticmethod
    def _owned(lease, lease_id: int, worker: Worker):
        """`lease` (a Lease or a row with its worker_id), if it exists and is `worker`'s: else 404 / 403."""
        if lease is None:
            raise NotFound(f"no lease {lease_id}")
        if lease.worker_id != worker.id:
            raise Forbidden(f"lease {lease_id} belongs to another worker")
        return lease

    def _own_lease(self, s: Session, lease_id: int, worker: Worker) -> Lease:
        return self._owned(s.get(Lease, lease_id), lease_id, worker)

    def _own_lease_row(self, c: Connection, lease_id: int, worker: Worker) -> Row:
        """_own_lease on a Core connection: the lease's row (queries.LEASE_OF's columns)."""
        return self._owned(c.execute(queries.LEASE_OF, {"lease": lease_id}).first(), lease_id, worker)

    def _count_rejection(self, worker_id: int, run_id: int, size: int, *, reason: str | None = None,
                         kind: str = "delta") -> None:
        """Count a refused request of `worker_id`: a refused delta in its deltas_rejected, and, given a
        `reason` (the refusal was the worker's own doing, not e.g. the coordinator's queue), a Refusal
        row that counts toward throttle and ban like a delta rejected at merge (its standing is
        judged again here). Its bytes are counted as traffic all the same."""
        with self.sessions() as s:
            w = s.get(Worker, worker_id)
            if w is not None:
                if kind == "delta":
                    w.deltas_rejected += 1
                if reason is not None:
                    s.add(Refusal(run_id=run_id, worker_id=worker_id, kind=kind, reason=reason[:1000]))
                    s.flush()
                    self._judge(s, w, RunConfig.model_validate_json(s.get(Run, run_id).config_json))
                s.commit()
        if size:
            self.traffic.add(run_id, worker_id, up=size)  # the bytes came all the same (coordinator/traffic.py)

    # -- evaluation ---------------------------------------------------------------------------

    def evaluate(self, rt: RunRuntime) -> protocol.EvalPoint | None:
        """Evaluate the run's current model on its held-out split and record it (once per version).
        None when the loss is not finite (the model diverged): logged as an error, never recorded
        (a NaN would not survive JSON, and no loss curve can plot it)."""
        with rt.lock:
            version, loss = rt.version, rt.evaluate()
        if not math.isfinite(loss):
            log.error("run %s version %d: eval loss is %s: the global model diverged; not recorded",
                      rt.config.name, version, loss)
            return None
        with self.sessions() as s:
            prior = s.scalar(select(EvalResult).where(EvalResult.run_id == rt.run_id, EvalResult.version == version))
            if prior is not None:
                return protocol.EvalPoint(version=version, loss=prior.loss, tokens_trained=prior.tokens_trained,
                                          at=_aware(prior.at))
            # Tokens in the deltas this version holds (merged ones, up to this version).
            tokens = s.scalar(select(func.coalesce(func.sum(DeltaRecord.tokens), 0)).where(
                DeltaRecord.run_id == rt.run_id, DeltaRecord.seq <= version, DeltaRecord.outcome == "merged"))
            row = EvalResult(run_id=rt.run_id, version=version, loss=loss, tokens_trained=int(tokens))
            s.add(row)
            try:
                s.commit()
            except IntegrityError:  # evaluated concurrently by the merger and an operator: same result
                s.rollback()
        log.info("run %s version %d: eval loss %.4f", rt.config.name, version, loss)
        return protocol.EvalPoint(version=version, loss=loss, tokens_trained=int(tokens), at=_aware(row.at))

    def evaluate_now(self, run_name: str) -> protocol.EvalPoint:
        with self.sessions() as s:
            run_id = self._run(s, run_name).id
        point = self.evaluate(self.live(run_id, run_name))
        if point is None:
            raise Conflict(f"run {run_name!r}: the eval loss is not finite: the global model diverged "
                           "(see the coordinator's log); nothing was recorded")
        return point

    # -- status -------------------------------------------------------------------------------

    def status(self, run_name: str) -> protocol.RunStatus:
        self.flush_traffic()
        now = utcnow()
        with self.sessions() as s:
            run = self._run(s, run_name)
            counts = dict(s.execute(select(DeltaRecord.outcome, func.count()).where(DeltaRecord.run_id == run.id)
                                    .group_by(DeltaRecord.outcome)).all())
            exchanges = s.scalar(select(func.count()).select_from(Exchange).where(Exchange.run_id == run.id))
            evals = s.scalars(select(EvalResult).where(EvalResult.run_id == run.id)
                              .order_by(EvalResult.version)).all()
            active = s.scalar(select(func.count(func.distinct(Lease.worker_id))).where(
                Lease.run_id == run.id, Lease.state == "active", Lease.deadline > now))
            total_workers = s.scalar(select(func.count()).select_from(Worker).where(Worker.run_id == run.id))
            shard_counts = dict(s.execute(select(Shard.state, func.count()).where(Shard.run_id == run.id)
                                          .group_by(Shard.state)).all())
            dense = scheduler.dense_equivalent_bytes(worker_steps=run.worker_steps, n_params=run.n_params)
            clipped = s.scalar(select(func.count()).select_from(DeltaRecord).where(
                DeltaRecord.run_id == run.id, DeltaRecord.outcome == "merged", DeltaRecord.reason.is_not(None)))
            standings = dict(s.execute(select(Worker.standing, func.count()).where(Worker.run_id == run.id)
                                       .group_by(Worker.standing)).all())
            moved = run.bytes_up + run.bytes_down_model + run.bytes_down_data
            return protocol.RunStatus(
                name=run.name, state=run.state, algorithm=RunConfig.model_validate_json(run.config_json).algorithm,
                version=run.version, merged_deltas=counts.get("merged", 0), pending_deltas=counts.get("queued", 0),
                rejected_deltas=counts.get("rejected", 0), eval_loss=evals[-1].loss if evals else None,
                eval_history=[protocol.EvalPoint(version=e.version, loss=e.loss, tokens_trained=e.tokens_trained,
                                                 at=_aware(e.at)) for e in evals],
                workers_active=active or 0, workers_total=total_workers or 0, tokens_trained=run.tokens_trained,
                worker_steps=run.worker_steps, bytes_up=run.bytes_up,
                bytes_down=run.bytes_down_model + run.bytes_down_data, bytes_down_model=run.bytes_down_model,
                bytes_down_data=run.bytes_down_data, exchanges=exchanges or 0, dense_equivalent_bytes=dense,
                traffic_ratio_vs_dense=(dense / moved) if moved else None, n_params=run.n_params,
                shards_total=sum(shard_counts.values()), shards_done=shard_counts.get("done", 0), epoch=run.epoch,
                clipped_deltas=clipped or 0, workers_throttled=standings.get("throttled", 0),
                workers_banned=standings.get("banned", 0))

    # -- dashboard and metrics (public: names, teams and devices; never tokens or reasons) ---------

    LIVE_WINDOW_S = 300.0  # seen this recently (or holding a live lease): a live worker
    RATE_DELTAS = 4000  # the run's newest deltas tokens/s looks at: bounded work whatever the history
    DASHBOARD_EVALS, DASHBOARD_LIVE, DASHBOARD_LEADERS, DASHBOARD_TEAMS = 500, 200, 100, 50

    def dashboard(self, run_name: str, *, now: datetime | None = None) -> protocol.Dashboard:
        """Every number of the public dashboard, aggregated in SQL and capped in rows, so it stays a
        few milliseconds with hundreds of workers and a long history."""
        self.flush_traffic()
        now = now or utcnow()
        live_since = now - timedelta(seconds=self.LIVE_WINDOW_S)
        with self.sessions() as s:
            run = self._run(s, run_name)
            cfg = RunConfig.model_validate_json(run.config_json)
            rejected_at_merge = s.scalar(select(func.count()).select_from(DeltaRecord).where(
                DeltaRecord.run_id == run.id, DeltaRecord.outcome == "rejected")) or 0
            n_workers, rejected, credit_total = s.execute(select(
                func.count(), func.coalesce(func.sum(Worker.deltas_rejected), 0),
                func.coalesce(func.sum(Worker.credit), 0.0)).where(Worker.run_id == run.id)).one()
            evals = [protocol.EvalPoint(version=v, loss=loss, tokens_trained=t, at=_aware(at))
                     for v, loss, t, at in s.execute(select(
                         EvalResult.version, EvalResult.loss, EvalResult.tokens_trained, EvalResult.at)
                         .where(EvalResult.run_id == run.id).order_by(EvalResult.version))]
            leasing = select(Lease.worker_id).where(Lease.run_id == run.id, Lease.state == "active",
                                                    Lease.deadline > now)
            holding = set(s.scalars(leasing))
            live = s.execute(select(Worker.id, Worker.name, Worker.team, Worker.device, Worker.last_seen,
                                    Worker.standing).where(
                Worker.run_id == run.id, Worker.revoked.is_(False),
                or_(Worker.last_seen >= live_since, Worker.id.in_(leasing)))).all()
            # tokens/s: tokens over seconds from lease to upload, over each worker's recent deltas
            rate_since = now - timedelta(seconds=max(900.0, 2 * cfg.lease_ttl_s))
            spent: dict[int, list[float]] = {}
            for worker_id, tokens, received, leased in s.execute(
                    select(DeltaRecord.worker_id, DeltaRecord.tokens, DeltaRecord.received_at, Lease.created_at)
                    .join(Lease, Lease.id == DeltaRecord.lease_id)
                    .where(DeltaRecord.run_id == run.id, DeltaRecord.seq >= run.next_seq - self.RATE_DELTAS,
                           DeltaRecord.received_at >= rate_since)):
                acc = spent.setdefault(worker_id, [0.0, 0.0])
                acc[0] += tokens
                acc[1] += max(1e-3, (_aware(received) - _aware(leased)).total_seconds())
            leaders = s.execute(select(Worker.id, Worker.name, Worker.team, Worker.tokens_trained,
                                       Worker.deltas_accepted, Worker.credit, Worker.standing, Worker.revoked)
                                .where(Worker.run_id == run.id, Worker.deltas_accepted > 0)
                                .order_by(Worker.credit.desc(), Worker.tokens_trained.desc(), Worker.id)
                                .limit(self.DASHBOARD_LEADERS)).all()
            team_credit = func.coalesce(func.sum(Worker.credit), 0.0)
            teams = s.execute(select(Worker.team, func.count(), func.coalesce(func.sum(Worker.tokens_trained), 0),
                                     func.coalesce(func.sum(Worker.deltas_accepted), 0), team_credit)
                              .where(Worker.run_id == run.id, Worker.team.is_not(None), Worker.team != "")
                              .group_by(Worker.team).order_by(team_credit.desc(), Worker.team)
                              .limit(self.DASHBOARD_TEAMS)).all()
        live_workers = [protocol.LiveWorker(
            worker_id=wid, name=name, team=team, device=device, last_seen=_aware(seen), leasing=wid in holding,
            standing=standing, tokens_per_s=spent[wid][0] / spent[wid][1] if wid in spent else None)
            for wid, name, team, device, seen, standing in live]
        live_workers.sort(key=lambda w: (w.tokens_per_s is None, -(w.tokens_per_s or 0.0), w.worker_id))
        dense = scheduler.dense_equivalent_bytes(worker_steps=run.worker_steps, n_params=run.n_params)
        moved = run.bytes_up + run.bytes_down_model + run.bytes_down_data
        return protocol.Dashboard(
            name=run.name, state=run.state, algorithm=cfg.algorithm, version=run.version, n_params=run.n_params,
            tokens_trained=run.tokens_trained, merged_deltas=run.version - rejected_at_merge,
            rejected_deltas=int(rejected), eval_loss=evals[-1].loss if evals else None,
            evals=_thin(evals, self.DASHBOARD_EVALS), workers_total=n_workers, workers_live=len(live_workers),
            live_window_s=self.LIVE_WINDOW_S, bytes_moved=moved, dense_equivalent_bytes=dense,
            bytes_saved=dense - moved, traffic_ratio_vs_dense=(dense / moved) if moved else None,
            credit_total=float(credit_total), credit_formula=credit.FORMULA,
            live_workers=live_workers[:self.DASHBOARD_LIVE],
            leaderboard=[protocol.LeaderboardEntry(
                rank=i, worker_id=wid, name=name, team=team, tokens_trained=tokens, deltas_accepted=accepted,
                credit=credit_ or 0.0, standing="revoked" if revoked else standing)
                for i, (wid, name, team, tokens, accepted, credit_, standing, revoked) in enumerate(leaders, 1)],
            teams=[protocol.TeamEntry(rank=i, team=team, workers=n, tokens_trained=int(tokens),
                                      deltas_accepted=int(accepted), credit=float(credit_))
                   for i, (team, n, tokens, accepted, credit_) in enumerate(teams, 1)],
            generated_at=now)

    def metrics_sample(self, *, now: datetime | None = None) -> list[protocol.RunMetrics]:
        """Each run's numbers for a /metrics scrape: a handful of grouped queries over all runs."""
        self.flush_traffic()
        now = now or utcnow()
        with self.sessions() as s:
            runs = s.scalars(select(Run).where(Run.state != "creating").order_by(Run.id)).all()
            outcomes: dict[tuple[int, str], int] = {
                (run_id, outcome): n for run_id, outcome, n in s.execute(
                    select(DeltaRecord.run_id, DeltaRecord.outcome, func.count())
                    .where(DeltaRecord.outcome.in_(("queued", "rejected")))
                    .group_by(DeltaRecord.run_id, DeltaRecord.outcome))}
            # an active lease past its deadline is expired, whether or not the merger has marked it yet
            state = case((and_(Lease.state == "active", Lease.deadline <= now), "expired"), else_=Lease.state)
            leases: dict[int, dict[str, int]] = {}
            for run_id, lease_state, n in s.execute(select(Lease.run_id, state, func.count())
                                                    .group_by(Lease.run_id, state)):
                leases.setdefault(run_id, {})[lease_state] = n
            live = or_(Worker.last_seen >= now - timedelta(seconds=self.LIVE_WINDOW_S), Worker.id.in_(
                select(Lease.worker_id).where(Lease.state == "active", Lease.deadline > now)))
            workers = {run_id: (n, int(n_live or 0), int(rejected), float(credit_))
                       for run_id, n, n_live, rejected, credit_ in s.execute(
                           select(Worker.run_id, func.count(),
                                  func.sum(case((and_(live, Worker.revoked.is_(False)), 1), else_=0)),
                                  func.coalesce(func.sum(Worker.deltas_rejected), 0),
                                  func.coalesce(func.sum(Worker.credit), 0.0)).group_by(Worker.run_id))}
            newest = select(EvalResult.run_id, func.max(EvalResult.version).label("version")) \
                .group_by(EvalResult.run_id).subquery()
            losses = dict(s.execute(select(EvalResult.run_id, EvalResult.loss).join(
                newest, and_(EvalResult.run_id == newest.c.run_id, EvalResult.version == newest.c.version))).all())
        out = []
        for run in runs:
            rejected_at_merge = outcomes.get((run.id, "rejected"), 0)
            n, n_live, rejected, credit_ = workers.get(run.id, (0, 0, 0, 0.0))
            out.append(protocol.RunMetrics(
                name=run.name, version=run.version, tokens_trained=run.tokens_trained,
                merged_deltas=run.version - rejected_at_merge, rejected_at_merge=rejected_at_merge,
                refused_at_upload=max(0, rejected - rejected_at_merge),
                queued_deltas=outcomes.get((run.id, "queued"), 0), leases=leases.get(run.id, {}),
                eval_loss=losses.get(run.id), bytes_up=run.bytes_up, bytes_down_model=run.bytes_down_model,
                bytes_down_data=run.bytes_down_data,
                dense_equivalent_bytes=scheduler.dense_equivalent_bytes(worker_steps=run.worker_steps,
                                                                        n_params=run.n_params),
                workers_total=n, workers_live=n_live, credit_total=credit_))
        return out

    def close(self) -> None:
        try:
            self.flush_traffic()
        except Exception:  # the database is gone: these counts are statistics, not acknowledged work
            log.exception("could not write the last traffic counts")
        self.engine.dispose()

