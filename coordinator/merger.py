"""The one merger: applies acknowledged deltas in arrival order, evaluates, checkpoints.

It runs as a background thread of the coordinator process. Requests never wait for it: an
upload returns once its delta is durably queued, and the merger catches up on its own.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from coordinator import checkpoints
from coordinator.models import utcnow
from coordinator.queries import compensations as compensation_rows
from coordinator.queries import deltas as delta_rows
from coordinator.queries import leases as lease_rows
from coordinator.queries import runs as run_rows
from coordinator.queries import spotchecks as check_rows
from coordinator.queries import versions as version_rows
from coordinator.runtime import MergeOutcome, RunRuntime
from coordinator.services.coordinator import Coordinator

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
        # runs whose live model may be ahead of the database (a merge step moved the weights, then its
        # snapshot or its commit failed: a full disk) and whose reload failed too: reloaded before merging
        self._behind: set[int] = set()
        self._errors = 0  # loop iterations in a row that failed: its backoff

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="idletrain-merger", daemon=True)
        self._thread.start()
        self.coord.spotchecks.start()  # the replay spot-checks run where the merging does

    def _settle(self, rt: RunRuntime) -> None:
        """One run's lifecycle step; its failure (a full disk under the final export) is logged and
        tried again a second later, and holds back neither merging nor the other runs."""
        try:
            self.coord.lifecycle.settle(rt)
        except Exception:
            log.exception("run %s: finishing failed; trying again", rt.config.name)

    def stop(self, timeout: float = 30.0, *, checkpoint: bool = True) -> None:
        """Stop merging; checkpoint each run (not when this process lost the merger lock: another
        process merges now, and the database, not this memory, is what counts)."""
        self._stop.set()
        self.coord.spotchecks.stop(timeout)
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        if checkpoint and self.coord.live.still_leading():
            for rt in self.coord.live.runtime_list():
                if rt.run_id in self._behind:
                    continue  # ahead of the database: the restart rebuilds it from what was committed
                try:
                    with rt.lock:
                        checkpoints.write(rt)
                except OSError:  # a full disk: the restart replays from the last checkpoint, nothing is lost
                    log.exception("run %s: no checkpoint at shutdown", rt.config.name)

    def _loop(self) -> None:
        last_expiry = 0.0
        while not self._stop.is_set():
            worked = False
            try:
                for rt in self.coord.live.runtime_list():
                    worked |= self.step(rt) > 0
                if time.monotonic() - last_expiry > 1.0:
                    self.coord.leases.expire()
                    for rt in self.coord.live.runtime_list():  # a run done training finishes (lifecycle.py)
                        self._settle(rt)
                    last_expiry = time.monotonic()
                if not worked:  # idle: what merging held back, or a full disk kept from being written
                    for rt in self.coord.live.runtime_list():
                        self.catch_up_snapshot(rt)
                        self.catch_up_checkpoint(rt)
            except Exception as exc:  # the error is visible in logs; try again after a backoff
                self._errors += 1
                # 1, 2, 4 ... RETRY_MAX_S seconds: a full disk stays full for minutes, and each try
                # may cost a reload (checkpoint + replay) and a log line
                wait = min(self.RETRY_MAX_S, 2.0 ** (self._errors - 1))
                log.exception("merger error (%d in a row); next try in %.0f s", self._errors, wait)
                self.last_error = repr(exc)
                self._stop.wait(wait)
                continue
            self._errors = 0
            if not worked:
                self._stop.wait(self.coord.settings.merge_idle_s)

    def catch_up_snapshot(self, rt: RunRuntime) -> bool:
        """Idle: write the snapshot of the newest version if merging held it back (snapshot_duty)
        and the duty allows it now. True if one was written."""
        if rt.snapshot_version is None:
            with self.coord.db.read() as c:
                rt.snapshot_version = version_rows.newest(c, rt.run_id)
        if rt.version <= rt.snapshot_version or not rt.snapshot_allowed(self.coord.settings.snapshot_duty):
            return False
        if not self.coord.recovery.snapshot_newest(rt):
            return False
        log.debug("run %s: snapshot of version %d written at idle (%.2f s)", rt.config.name, rt.version,
                  rt.snapshot_cost_s)
        return True

    def catch_up_checkpoint(self, rt: RunRuntime) -> bool:
        """Idle: write the checkpoint that a full disk kept from being written (at its checkpoint_every
        version, or after a restart's replay), once one is overdue. True if one was written."""
        if rt.run_id in self._behind:
            return False
        kept = self.coord.storage.list_checkpoints(rt.run_id)
        if kept and rt.version < kept[0][0] + self.coord.settings.checkpoint_every:
            return False
        with rt.lock:  # exchanges (sparta) may be changing the weights meanwhile
            if rt.removed:  # deleted meanwhile (its files are gone: write none back)
                return False
            checkpoints.write(rt)
        self.coord.recovery.prune_history(rt)
        log.info("run %s: overdue checkpoint of version %d written", rt.config.name, rt.version)
        return True

    def drain(self) -> int:
        """Merge everything queued now, synchronously (tests and shutdown use it)."""
        n = 0
        for rt in self.coord.live.runtime_list():
            while done := self.step(rt):
                n += done
        return n

    BATCH = 16  # deltas merged under one hold of the run's lock and committed in one transaction
    RETRY_MAX_S = 30.0  # the longest wait between the loop's tries after errors in a row

    def step(self, rt: RunRuntime) -> int:
        """Merge the next queued deltas of one run (up to BATCH, one transaction). Returns how many
        were processed (0: none queued). A run the last step left ahead of the database is reloaded
        first (raises while that still fails)."""
        rt = self._current(rt)
        if rt.removed:  # deleted (or finished) since the caller listed it
            return 0
        settings, cfg = self.coord.settings, rt.config
        with self.coord.db.read() as c:
            rows = delta_rows.queued(c, rt.run_id, after=rt.version, through=rt.version + self.BATCH + 1)
            undo = [row for row in compensation_rows.pending(c, rt.run_id) if row.seq <= rt.version]
        # (seq, base version, worker, voice): the screen judges each voice's own record
        items: list[tuple[int, int, int]] = []
        for seq, base, lease_id, sha, worker_id, voice in rows[:self.BATCH]:
            if seq != rt.version + 1 + len(items):
                break  # a gap: the row of the next sequence number is not committed yet
            rt.storage.adopt_delta(rt.run_id, seq, lease_id, sha)  # staged by the upload: now named by seq
            items.append((seq, base, worker_id, voice))
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
            if rt.removed:  # deleted since this step began: nothing of it is merged or written
                return 0
            try:
                undone = self._compensate(rt, undo)
                outs = rt.merge_batch(items, write_snapshot=snapshot)
                self._commit(rt, outs, undone)
            except Exception:
                # The weights moved (merge_batch moves them before it writes the snapshot) but the
                # database did not: rebuild this run from its checkpoint and a replay of what was
                # committed. Should that fail too, every later step tries again before it merges, so
                # merging resumes on its own once the disk has room; the fence in _commit keeps any
                # delta from being merged twice.
                self._behind.add(rt.run_id)
                rt.ahead = True  # exchanges refuse this object from now on (a reload replaces it)
                try:
                    self._reload(rt.run_id)
                except Exception:
                    log.exception("run %s: reload after a failed merge step failed; retrying before the "
                                  "next merge", cfg.name)
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
            self.coord.reports.evaluate(rt)
        if last % settings.checkpoint_every == 0:
            with rt.lock:  # exchanges (sparta) may be changing the weights meanwhile
                if rt.removed:
                    return len(outs)
                checkpoints.write(rt)
            self._gc_snapshots(rt)
            self.coord.recovery.prune_history(rt)
        log.debug("merged seq %d..%d in %.1f ms", items[0][0], last, 1000 * (time.perf_counter() - t0))
        return len(outs)

    def _current(self, rt: RunRuntime) -> RunRuntime:
        """The run's live model to merge into: reloaded first if it is behind (see step), and the one
        the coordinator holds now (a reload replaced the object the caller may still hold)."""
        if rt.run_id in self._behind:
            self._reload(rt.run_id)
        current = self.coord.live.get(rt.run_id)
        return rt if current is None else current

    def _reload(self, run_id: int) -> None:
        self.coord.recovery.reload_run(run_id)
        self._behind.discard(run_id)
        log.info("run %d reloaded from its checkpoint and the committed deltas", run_id)

    def _compensate(self, rt: RunRuntime, rows: list) -> tuple[list[int], list[int]]:
        """Take back the merged deltas found false since (coordinator/queries/compensations.py), before the
        batch's first version; returns the ids of the rows applied and of those that cannot be (their
        kept bytes are gone: deleted by hand; logged, never guessed), committed with the batch."""
        done, lost = [], []
        for row in rows:
            try:
                rt.compensate(row.seq, row.applied)
            except FileNotFoundError:
                log.error("run %s: the kept bytes of delta %d are gone; it cannot be compensated",
                          rt.config.name, row.seq)
                lost.append(row.id)
                continue
            done.append(row.id)
        return done, lost

    def _commit(self, rt: RunRuntime, outs: list[MergeOutcome],
                undone: tuple[list[int], list[int]] = ([], [])) -> None:
        first, last = outs[0].version, outs[-1].version
        with self.coord.db.begin() as c:
            compensation_rows.applied_before(c, rt.run_id, undone[0], first)
            compensation_rows.applied_before(c, rt.run_id, undone[1], compensation_rows.LOST)
            for out in outs:
                delta_rows.record_outcome(c, rt.run_id, out.version, merged=out.merged, staleness=out.staleness,
                                          weight=out.weight, reason=out.reason, norm=out.norm, cosine=out.cosine,
                                          at=utcnow(), applied=out.applied)
                if out.snapshot_sha256:  # versions between snapshots exist only in the merger's memory
                    version_rows.record(c, run_id=rt.run_id, version=out.version, sha256=out.snapshot_sha256,
                                        size=out.snapshot_size)
            # Fenced: the version moves only from the one this batch followed. A process that lost the
            # merger lock without knowing it yet cannot merge a delta twice.
            if not run_rows.advance_version(c, rt.run_id, first=first, last=last):
                raise RuntimeError(f"run {rt.config.name}: version {first - 1} is no longer the newest; "
                                   "another coordinator process merged it")
            for out in outs:  # in order: each worker's standing sees its deltas one by one
                self.coord.workers.record_merge(c, rt.run_id, out.version, rt.config)

    def _gc_snapshots(self, rt: RunRuntime) -> None:
        """Keep the newest versions and any a live lease still points at; older snapshots and the model
        updates from them go."""
        settings = self.coord.settings  # keep about snapshot_keep snapshots, however far apart they are
        keep_from = rt.version - settings.snapshot_keep * settings.snapshot_every + 1
        with self.coord.db.begin() as c:
            # a live lease's base, and a pending spot-check's (its replay starts from it), stay
            leased = lease_rows.live_base_versions(c, rt.run_id) | check_rows.pending_bases(c, rt.run_id)
            doomed = [v for v in version_rows.older_than(c, rt.run_id, keep_from) if v not in leased and v != 0]
            for v in doomed:
                rt.storage.delete(rt.storage.snapshot(rt.run_id, v))
            for start, name in rt.storage.list_updates(rt.run_id):  # updates from a version that is gone go too
                if start < keep_from and start not in leased:
                    rt.storage.delete(name)
            if doomed:
                version_rows.forget(c, rt.run_id, doomed)
