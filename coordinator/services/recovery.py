"""Recovery: each run's live model rebuilt from its newest good checkpoint and a replay, in their
original order, of the deltas processed and the exchanges answered after it; the run's reference
round (calibrate); the newest snapshot written when it is missing; and the history every kept
checkpoint already holds pruned."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import torch
import zstandard
from sqlalchemy import Row
from sqlalchemy.exc import SQLAlchemyError

from coordinator import checkpoints
from coordinator.db import Database
from coordinator.errors import NotFound, RunUnrecoverable, Unavailable
from coordinator.queries import compensations as compensation_rows
from coordinator.queries import deltas as delta_rows
from coordinator.queries import exchanges as exchange_rows
from coordinator.queries import runs as run_rows
from coordinator.queries import versions as version_rows
from coordinator.runtime import RunRuntime
from coordinator.services.live import LiveRuns
from coordinator.settings import CoordinatorSettings
from coordinator.storage import Storage
from shared import codec
from shared.algorithms.registry import ALGORITHMS
from shared.config import RunConfig
from shared.data import tokens_from_bytes

log = logging.getLogger(__name__)


def _write_at_load(run_name: str, what: str, write: Callable[[], object]) -> None:
    """A write loading a run can do without: a full disk (or a database refusing writes) is logged,
    not fatal."""
    try:
        write()
    except (OSError, SQLAlchemyError) as exc:
        log.error("run %s: %s was not written (%s); the merger writes it once the disk has room",
                  run_name, what, exc)


class RecoveryService:
    CALIBRATION_TOKENS = 1 << 20  # training tokens the reference round draws its batches from, at most
    STAGED_KEEP_S = 3600.0  # a staged delta this old is a leftover unless its delta still waits for it

    def __init__(self, db: Database, storage: Storage, settings: CoordinatorSettings, *, live: LiveRuns) -> None:
        self.db, self.storage, self.settings, self.live = db, storage, settings, live

    def load_runs(self) -> None:
        """Rebuild every run's live state: the newest good checkpoint, then a replay of the deltas
        processed and the exchanges answered after it, in their original order."""
        with self.db.read() as c:
            runs = run_rows.created(c)
        for run in runs:
            self._load_run(run)

    def sync_runs(self) -> int:
        """Load the runs created since (by another coordinator process); returns how many."""
        with self.db.read() as c:
            runs = run_rows.created(c, besides=list(self.live.runtimes))
        for run in runs:
            self._load_run(run)
        return len(runs)

    def reload_run(self, run_id: int) -> None:
        """Rebuild one run's live state from what is stored (the merger's way back after a failed commit)."""
        with self.db.read() as c:
            run = run_rows.by_id(c, run_id)
        self._load_run(run)

    def live_model(self, run_id: int, run_name: str) -> RunRuntime:
        """The run's live model; 503 in a process that does not lead (the routes relay to the leader)."""
        rt = self.live.get(run_id)
        if rt is None and self.live.leads and self.sync_runs():  # created a moment ago by another process
            rt = self.live.get(run_id)
        if rt is not None:
            return rt
        if not self.live.leads:
            raise Unavailable("this coordinator process does not hold the live model and the leading one "
                              "could not be reached; retry")
        raise NotFound(f"run {run_name!r} is not loaded")

    def _load_run(self, run: Row) -> None:
        cfg = RunConfig.model_validate_json(run.config_json)
        rt = checkpoints.load_newest(run_id=run.id, config=cfg, storage=self.storage, max_version=run.version)
        if rt is None and (pruned := self.storage.pruned_through(run.id)):
            msg = (f"run {run.name}: no checkpoint in {self.storage.checkpoints(run.id)} loads (each fails its "
                   f"hash, or is ahead of the database's version {run.version}), and the deltas up to version "
                   f"{pruned} were deleted once checkpoints held them (keep_deltas is off), so the model cannot be "
                   "rebuilt from version 0. Put back a good checkpoint file (from a backup of the data dir) or the "
                   "database that matches the checkpoints, then start again")
            log.error("%s", msg)
            raise RunUnrecoverable(msg)
        fresh = rt is None
        if fresh:
            log.warning("run %s: no usable checkpoint; replaying from version 0", run.name)
            rt = RunRuntime.fresh(run_id=run.id, config=cfg, storage=self.storage)
            self.calibrate(rt)  # as creating the run did: the replay takes the same decisions
        deltas, exchanges = self._replay(rt, run.version)
        # a checkpoint from before the reference round: the replay had none (a fresh one tried already)
        calibrated = not fresh and rt.reference_norm is None
        if calibrated:
            self.calibrate(rt)
        elif ALGORITHMS[cfg.algorithm].exchanges and rt.guard_tokens is None:  # the descent guard's, as calibrate set
            if (tokens := self.first_tokens(rt)).numel() > cfg.model.context:
                rt.guard_tokens = tokens
        # Loading needs no writes: a coordinator restarted on a full disk comes up (reads served, writes
        # answered 503) and the merger writes these once there is room (Merger.catch_up_checkpoint,
        # catch_up_snapshot). Until then a restart replays the same deltas again: nothing is lost.
        if deltas or exchanges or calibrated:
            _write_at_load(run.name, "the checkpoint after the replay",
                           lambda: (checkpoints.write(rt), self.prune_history(rt)))
        # the crash came between snapshots: write the newest now, so leases hand it out
        _write_at_load(run.name, f"the snapshot of version {rt.version}", lambda: self.snapshot_newest(rt))
        log.info("run %s resumed at version %d (%d deltas replayed, %d exchanges)", run.name, rt.version,
                 deltas, exchanges)
        self.live.put(rt)

    def first_tokens(self, rt: RunRuntime) -> torch.Tensor:
        """The run's first training tokens, from its first shards in index order (the same tokens
        whenever they are read): the reference round's, and the descent guard's."""
        dctx = zstandard.ZstdDecompressor()
        parts, n, i = [], 0, 0
        while n < self.CALIBRATION_TOKENS and self.storage.exists(name := self.storage.shard(rt.run_id, i)):
            raw = dctx.stream_reader(self.storage.read(name)).read()
            parts.append(raw)
            n, i = n + len(raw), i + 1
        dtype = rt.config.tokens.dtype
        return tokens_from_bytes(b"".join(parts)[:self.CALIBRATION_TOKENS * np.dtype(dtype).itemsize], dtype)

    def calibrate(self, rt: RunRuntime) -> None:
        """The run's reference round (RunRuntime.calibrate) on its first training tokens."""
        tokens = self.first_tokens(rt)
        if tokens.numel() <= rt.config.model.context:
            log.warning("run %s: too few training tokens for a reference round; deltas are screened without one",
                        rt.config.name)
            return
        t0 = time.perf_counter()
        ref = rt.calibrate(tokens)
        log.info("run %s: reference round norm %.4g (%.1f s)", rt.config.name, ref, time.perf_counter() - t0)

    def _replay(self, rt: RunRuntime, up_to: int) -> tuple[int, int]:
        """Bring `rt` from its checkpoint to version `up_to`: after each version, the exchanges
        that followed it (by id), then the next delta. Snapshots are already stored."""
        with self.db.read() as c:
            todo = delta_rows.queued(c, rt.run_id, after=rt.version, through=up_to)
            undo = compensation_rows.at(c, rt.run_id, rt.version + 1, up_to)
        n_exchanges = 0

        def exchanges_after(version: int) -> None:
            nonlocal n_exchanges
            with self.db.read() as c:
                rows = exchange_rows.after(c, rt.run_id, version, after_id=rt.last_exchange_id)
            for ex_id, body, worker_id, step, scale in rows:
                rt.exchange(codec.decode(body, schema=rt.schema), step=step, exchange_id=ex_id, worker=worker_id,
                            scale=1.0 if scale is None else scale)
                n_exchanges += 1

        exchanges_after(rt.version)
        for seq, base_version, lease_id, sha, worker_id, voice in todo:
            self.storage.adopt_delta(rt.run_id, seq, lease_id, sha)  # acknowledged, not merged before the crash
            for false_seq, applied in undo.get(seq, []):  # taken back where the merger took it back
                rt.compensate(false_seq, applied)
            rt.merge(seq=seq, base_version=base_version, write_snapshot=False, worker=worker_id, voice=voice)
            exchanges_after(seq)
        return len(todo), n_exchanges

    def snapshot_newest(self, rt: RunRuntime) -> bool:
        """Write and record the snapshot of the run's newest version unless it has one already, or the
        database has moved past it (another process merges now). True if one was written."""
        with self.db.read() as c:
            if run_rows.version(c, rt.run_id) != rt.version:
                return False
            if version_rows.has(c, rt.run_id, rt.version):
                rt.snapshot_version = rt.version
                return False
        with rt.lock:  # exchanges (sparta) may be changing the weights meanwhile
            if rt.removed:  # deleted meanwhile (its files are gone: write none back)
                return False
            version = rt.version
            sha, size = rt.write_snapshot()
        try:
            with self.db.begin() as c:
                version_rows.record(c, run_id=rt.run_id, version=version, sha256=sha, size=size)
        except BaseException:
            rt.snapshot_version = None  # the blob is there, its row is not: the merger's catch-up asks again
            raise
        return True

    def prune_history(self, rt: RunRuntime) -> int:
        """Delete what every kept checkpoint already holds, once there are checkpoints.KEPT of them: the
        received deltas up to the oldest one's version, and the bodies of the exchanges that came
        before it (their rows stay: they are counted, and keep a retried exchange from being applied
        twice). A restart from any kept checkpoint replays only what comes after it. Nothing goes with
        keep_deltas. Staged deltas no delta will adopt go either way (drop_stale_staged). Returns the
        number of deltas deleted."""
        self.drop_stale_staged(rt.run_id)
        if self.settings.keep_deltas:
            return 0
        kept = self.storage.list_checkpoints(rt.run_id)
        if len(kept) < checkpoints.KEPT:
            return 0
        through, done = kept[-1][0], self.storage.pruned_through(rt.run_id)
        if through <= done:
            return 0
        gone = self.storage.prune_deltas(rt.run_id, through)
        with self.db.begin() as c:
            exchange_rows.drop_bodies(c, rt.run_id, from_version=done, before_version=through)
            held = compensation_rows.held_since(c, rt.run_id, done, through)
        for seq in held:  # every kept checkpoint holds these compensations: their bytes go too
            self.storage.delete(self.storage.compensation(rt.run_id, seq))
        log.debug("run %s: deltas up to version %d deleted (%d blobs): every kept checkpoint holds them",
                  rt.config.name, through, gone)
        return gone

    def drop_stale_staged(self, run_id: int, now: float | None = None) -> int:
        """Delete staged deltas (Storage.staged_delta) older than STAGED_KEEP_S that no queued delta
        will adopt: an upload that died before its row was committed (never acknowledged), or a retry's
        second copy of a delta already renamed to its sequence number; and the partial bodies of
        uploads a crash cut off (Storage.receiving). Returns how many went."""
        now = time.time() if now is None else now
        gone = 0
        for name, lease_id, sha_part in self.storage.staged_deltas(run_id):
            try:
                if now - self.storage.modified_at(name) < self.STAGED_KEEP_S:
                    continue
            except OSError:  # gone meanwhile (renamed by the merger)
                continue
            with self.db.read() as c:
                rec = delta_rows.seq_of_lease(c, lease_id)
            waits = (rec is not None and rec.sha256.startswith(sha_part)
                     and not self.storage.exists(self.storage.delta(run_id, rec.seq)))
            if not waits:
                self.storage.delete(name)
                gone += 1
        for name in self.storage.partial_uploads(run_id):  # a body still arriving was written to moments ago
            try:
                if now - self.storage.modified_at(name) >= self.STAGED_KEEP_S:
                    self.storage.delete(name)
                    gone += 1
            except OSError:
                continue
        return gone
