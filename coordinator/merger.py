"""The one merger: applies acknowledged deltas in arrival order, evaluates, checkpoints.

It runs as a background thread of the coordinator process. Requests never wait for it: an
upload returns once its delta is durably queued, and the merger catches up on its own.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from sqlalchemy import delete, select, update

from coordinator.models import DeltaRecord, Lease, ModelVersion, Run, utcnow
from coordinator.runtime import MergeOutcome, RunRuntime
from coordinator.service import Coordinator

log = logging.getLogger(__name__)


# Told of every processed delta: (run, outcome, seconds its merge and commit took); /metrics listens.
MergeObserver = Callable[[RunRuntime, MergeOutcome, float], None]


class Merger:
    def __init__(self, coord: Coordinator, *, on_merged: MergeObserver | None = None) -> None:
        self.coord = coord
        self.on_merged = on_merged
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.last_error: str | None = None

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="idletrain-merger", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0, *, checkpoint: bool = True) -> None:
        """Stop merging; checkpoint each run (not when this process lost the merger lock: another
        process merges now, and the database, not this memory, is what counts)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        if checkpoint and self.coord.still_leading():
            for rt in self.coord.runtime_list():
                with rt.lock:
                    rt.write_checkpoint()

    def _loop(self) -> None:
        last_expiry = 0.0
        while not self._stop.is_set():
            worked = False
            try:
                for rt in self.coord.runtime_list():
                    worked |= self.step(rt) > 0
                if time.monotonic() - last_expiry > 1.0:
                    self.coord.expire_leases()
                    last_expiry = time.monotonic()
            except Exception as exc:  # keep merging other runs; the error is visible in logs
                log.exception("merger error")
                self.last_error = repr(exc)
                self._stop.wait(1.0)
            if not worked:
                try:
                    for rt in self.coord.runtime_list():
                        self.catch_up_snapshot(rt)
                except Exception as exc:
                    log.exception("snapshot error")
                    self.last_error = repr(exc)
                self._stop.wait(self.coord.settings.merge_idle_s)

    def catch_up_snapshot(self, rt: RunRuntime) -> bool:
        """Idle: write the snapshot of the newest version if merging held it back (snapshot_duty)
        and the duty allows it now. True if one was written."""
        if rt.snapshot_version is None:
            with self.coord.sessions() as s:
                rt.snapshot_version = self.coord._newest_snapshot(s, rt.run_id)
        if rt.version <= rt.snapshot_version or not rt.snapshot_allowed(self.coord.settings.snapshot_duty):
            return False
        if not self.coord.snapshot_newest(rt):
            return False
        log.debug("run %s: snapshot of version %d written at idle (%.2f s)", rt.config.name, rt.version,
                  rt.snapshot_cost_s)
        return True

    def drain(self) -> int:
        """Merge everything queued now, synchronously (tests and shutdown use it)."""
        n = 0
        for rt in self.coord.runtime_list():
            while done := self.step(rt):
                n += done
        return n

    BATCH = 16  # deltas merged under one hold of the run's lock and committed in one transaction

    def step(self, rt: RunRuntime) -> int:
        """Merge the next queued deltas of one run (up to BATCH, one transaction). Returns how many
        were processed (0: none queued)."""
        settings, cfg = self.coord.settings, rt.config
        with self.coord.sessions() as s:
            rows = s.execute(select(DeltaRecord.seq, DeltaRecord.base_version, DeltaRecord.lease_id,
                                    DeltaRecord.sha256).where(
                DeltaRecord.run_id == rt.run_id, DeltaRecord.seq > rt.version,
                DeltaRecord.seq <= rt.version + self.BATCH + 1).order_by(DeltaRecord.seq)).all()
        items: list[tuple[int, int]] = []
        for seq, base, lease_id, sha in rows[:self.BATCH]:
            if seq != rt.version + 1 + len(items):
                break  # a gap: the row of the next sequence number is not committed yet
            rt.storage.adopt_delta(rt.run_id, seq, lease_id, sha)  # staged by the upload: now named by seq
            items.append((seq, base))
            # a batch ends where a snapshot, an evaluation or a checkpoint is due
            if any(seq % every == 0 for every in (settings.snapshot_every, cfg.eval_every, settings.checkpoint_every)):
                break
        if not items:
            return 0
        last = items[-1][0]
        # a snapshot every snapshot_every versions, and when the batch empties the queue, within the
        # snapshots' share of the merger's time (settings.snapshot_duty; the idle loop catches up)
        snapshot = ((last % settings.snapshot_every == 0 or not any(row[0] == last + 1 for row in rows))
                    and rt.snapshot_allowed(settings.snapshot_duty))
        t0 = time.perf_counter()
        # The version is committed before the lock is released: an exchange that follows this
        # merge (and records after_version = this version) can never be ahead of the database.
        with rt.lock:
            outs = rt.merge_batch(items, write_snapshot=snapshot)
            try:
                self._commit(rt, outs)
            except Exception:
                # The weights moved but the database did not: rebuild this run from disk, retry later.
                self.coord.reload_run(rt.run_id)
                raise
        merge_s = (time.perf_counter() - t0) / len(outs)
        for out in outs:
            if self.on_merged is not None:
                self.on_merged(rt, out, merge_s)
            if not out.merged:
                log.warning("run %s: delta %d rejected at merge: %s", cfg.name, out.version, out.reason)
            elif out.clipped:
                log.warning("run %s: delta %d %s", cfg.name, out.version, out.reason)
        if last % cfg.eval_every == 0:
            self.coord.evaluate(rt)
        if last % settings.checkpoint_every == 0:
            with rt.lock:  # exchanges (sparta) may be changing the weights meanwhile
                rt.write_checkpoint()
            self._gc_snapshots(rt)
            self.coord.prune_history(rt)
        log.debug("merged seq %d..%d in %.1f ms", items[0][0], last, 1000 * (time.perf_counter() - t0))
        return len(outs)

    def _commit(self, rt: RunRuntime, outs: list[MergeOutcome]) -> None:
        first, last = outs[0].version, outs[-1].version
        with self.coord.sessions() as s:
            recs = {r.seq: r for r in s.scalars(select(DeltaRecord).where(
                DeltaRecord.run_id == rt.run_id, DeltaRecord.seq >= first, DeltaRecord.seq <= last))}
            for out in outs:
                rec = recs[out.version]
                rec.outcome = "merged" if out.merged else "rejected"
                rec.staleness, rec.weight, rec.reason, rec.merged_at = out.staleness, out.weight, out.reason, utcnow()
                rec.norm, rec.cosine = out.norm, out.cosine
                if out.snapshot_sha256:  # versions between snapshots exist only in the merger's memory
                    s.add(ModelVersion(run_id=rt.run_id, version=out.version, sha256=out.snapshot_sha256,
                                       size_bytes=out.snapshot_size))
            # Fenced: the version moves only from the one this batch followed. A process that lost the
            # merger lock without knowing it yet cannot merge a delta twice.
            moved = s.execute(update(Run).where(Run.id == rt.run_id, Run.version == first - 1)
                              .values(version=last)).rowcount
            if not moved:
                raise RuntimeError(f"run {rt.config.name}: version {first - 1} is no longer the newest; "
                                   "another coordinator process merged it")
            s.flush()
            for out in outs:  # in order: each worker's standing sees its deltas one by one
                self.coord.record_merge(s, recs[out.version], rt.config)
                s.flush()
            s.commit()

    def _gc_snapshots(self, rt: RunRuntime) -> None:
        """Keep the newest versions and any a live lease still points at; older files go."""
        settings = self.coord.settings  # keep about snapshot_keep snapshots, however far apart they are
        keep_from = rt.version - settings.snapshot_keep * settings.snapshot_every + 1
        with self.coord.sessions() as s:
            leased = set(s.scalars(select(Lease.base_version).where(Lease.run_id == rt.run_id,
                                                                     Lease.state == "active")))
            old = s.scalars(select(ModelVersion.version).where(ModelVersion.run_id == rt.run_id,
                                                               ModelVersion.version < keep_from)).all()
            doomed = [v for v in old if v not in leased and v != 0]
            for v in doomed:
                rt.storage.snapshot(rt.run_id, v).unlink(missing_ok=True)
            for path in rt.storage.update(rt.run_id, 0, 0).parent.glob("*.delta"):
                start, _, _ = path.stem.partition("-")  # updates from a version that is gone go too
                if start.isdigit() and int(start) < keep_from and int(start) not in leased:
                    path.unlink(missing_ok=True)
            if doomed:
                s.execute(delete(ModelVersion).where(ModelVersion.run_id == rt.run_id,
                                                     ModelVersion.version.in_(doomed)))
            s.commit()
