"""Replay spot-checks: keep a sampled delta's copy at upload, re-train its round later, judge it.

The upload (UploadService) asks `keep(...)` before it acknowledges a sampled lease (policy:
coordinator/spotcheck.py): the delta's bytes are copied under the run's `spotchecks/` folder, and the
acknowledgement's transaction adds the pending row, which keeps the lease's base snapshot from being
deleted (Merger._gc_snapshots) until the check is done.

The checker is one background thread of the merging process, at the lowest CPU priority the OS
gives it, one check at a time: it takes the oldest pending check whose delta the merger has judged
(so that a revoked credit is one that was awarded), re-trains the round on CPU from the base
snapshot (less the worker's own earlier deltas it does not hold yet, as the worker's round starts:
worker/ledger.py), the shard, the seed and the lr of the lease (shared/algorithms/spotcheck.py),
and records the verdict. Where the upload committed to its round's start state (the worker's AdamW
state and residual: shared/algorithms/start_state.py), the acknowledgement asks for it, the check
waits until it came (`receive_start_state`: its hash must be the committed one) and replays from
it, held to the exact bounds; a state that never comes (state_wait_s), or that AdamW could not
have left, fails the check. A failed check revokes the credit the delta earned and counts against the
worker's standing as a refusal does (throttled, then banned: coordinator/trust.py); the delta, if
merged, stays merged. Requests and merges never wait for it.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from datetime import timedelta

import torch
import zstandard
from sqlalchemy import Row

from coordinator import credit, spotcheck, trust
from coordinator.db import Database
from coordinator.errors import Conflict, NotFound
from coordinator.models import utcnow
from coordinator.queries import compensations as compensation_rows
from coordinator.queries import exchanges as exchange_rows
from coordinator.queries import spotchecks as check_rows
from coordinator.queries import workers as worker_rows
from coordinator.services.common import Caller, aware, owned
from coordinator.services.live import LiveRuns
from coordinator.services.workers import WorkerService
from coordinator.storage import ReceivedBody, Storage
from shared import codec, protocol
from shared.algorithms import spotcheck as replay
from shared.algorithms import start_state
from shared.algorithms.registry import ALGORITHMS, Start
from shared.config import RunConfig
from shared.data import tokens_from_bytes
from shared.snapshot import decode_snapshot

log = logging.getLogger(__name__)

AHEAD = 8  # the worker's own deltas a round starts without, at most (worker/ledger.py OwnDeltas.KEEP)


class NotReplayable(Exception):
    """What a check needs is not there through no doing of the worker's: the check is skipped."""


def copy_name(storage: Storage, run_id: int, lease_id: int, sha256: str) -> str:
    """Where a sampled lease's delta is kept until its check is done (the received ones are pruned)."""
    return f"{storage.run_dir(run_id)}/spotchecks/{lease_id:010d}-{sha256[:32]}.delta"


def state_name(storage: Storage, run_id: int, lease_id: int) -> str:
    """Where a sampled lease's start state is kept until its check is done."""
    return f"{storage.run_dir(run_id)}/spotchecks/{lease_id:010d}.start"


class SpotCheckService:
    IDLE_S = 2.0  # the checker's wait when nothing is ready

    def __init__(self, db: Database, storage: Storage, *, rate: float, live: LiveRuns, workers: WorkerService,
                 state_wait_s: float = 6 * 3600.0) -> None:
        self.db, self.storage, self.rate, self.live, self.workers = db, storage, rate, live, workers
        self.state_wait_s = state_wait_s
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- at upload ---------------------------------------------------------------------------------

    def wanted(self, *, run_seed: int, lease_id: int) -> bool:
        return spotcheck.sampled(run_seed=run_seed, lease_id=lease_id, rate=self.rate)

    def keep(self, run_id: int, lease_id: int, sha256: str, body: bytes) -> str:
        """Copy a sampled delta's bytes (before its acknowledgement); returns the copy's name."""
        name = copy_name(self.storage, run_id, lease_id, sha256)
        self.storage.write(name, body)
        return name

    def state_wanted(self, lease_id: int, worker: Caller) -> Row:
        """The lease's check row while it is pending with a commitment (404/403 otherwise; a state that
        came already is still wanted, so that a retry after a lost answer is answered alike)."""
        with self.db.read() as c:
            row = owned(check_rows.start_state_of(c, lease_id), lease_id, worker)
        if row.state_sha256 is None or row.verdict != "pending":
            raise NotFound(f"lease {lease_id}'s start state is not wanted: its check made no commitment, or "
                           "was judged already")
        return row

    def receive_start_state(self, lease_id: int, worker: Caller, body: ReceivedBody, *,
                            exchanges_applied: str | None = None) -> None:
        """Keep the start state the route streamed to a file: it must be the committed bytes (409);
        `exchanges_applied`: a sparta round's protocol.H_EXCHANGES_APPLIED, kept for its replay."""
        row = self.state_wanted(lease_id, worker)
        if body.sha256 != row.state_sha256 or body.size != row.state_bytes:
            raise Conflict(f"lease {lease_id}'s start state is not what its upload committed to (SHA-256 "
                           f"{body.sha256[:12]}..., {body.size} bytes; committed {row.state_sha256[:12]}..., "
                           f"{row.state_bytes} bytes)")
        if row.state_received_at is not None:
            return  # the same bytes again
        self.storage.stage_received(body, state_name(self.storage, row.run_id, lease_id))
        with self.db.begin() as c:
            check_rows.start_state_received(c, lease_id, utcnow(), exchanges_applied=exchanges_applied)
        self._wake.set()

    # -- the checker --------------------------------------------------------------------------------

    def start(self) -> None:
        if self.rate <= 0 or self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="idletrain-spotcheck", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def _loop(self) -> None:
        try:  # Linux: a thread's own niceness; merges, requests and evaluations go first
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (AttributeError, OSError):
            pass
        while not self._stop.is_set():
            try:
                done = self.run_next()
            except Exception:  # logged; the check stays pending and is tried again later
                log.exception("spot-check failed to run")
                done = False
            if not done:
                self._wake.wait(self.IDLE_S)
                self._wake.clear()

    def run_pending(self) -> int:
        """Run every check that is ready now, synchronously (tests). Returns how many."""
        n = 0
        while self.run_next():
            n += 1
        return n

    def run_next(self) -> bool:
        """Judge the oldest ready check; False when none is ready."""
        with self.db.read() as c:
            row = check_rows.next_ready(c, state_due=utcnow() - timedelta(seconds=self.state_wait_s))
            if row is None:
                return False
            first = check_rows.first_lease(c, row.worker_id, row.lease_id)
            offset = check_rows.steps_before(c, row.worker_id, row.seq)
            ahead = check_rows.ahead_of(c, row.worker_id, row.lease_id, row.base_version, AHEAD)
        cfg = RunConfig.model_validate_json(row.config_json)
        committed = row.state_sha256 is not None
        why = spotcheck.not_checkable(cfg, first_lease=first or committed, committed=committed)
        result = None
        if why is None:
            try:
                if ALGORITHMS[cfg.algorithm].exchanges:
                    result = self._compare_exchanges(row, cfg)
                else:
                    result = self._compare(row, cfg, first=first, offset=offset, ahead=ahead)
            except NotReplayable as exc:
                why = str(exc)
            except (OSError, ValueError, zstandard.ZstdError) as exc:  # DeltaFormatError, SnapshotError
                why = f"its base snapshot, shard or kept delta could not be read: {exc}"
            except Exception as exc:  # a replay that cannot run must not hold up the checks after it
                log.exception("run %s: the replay of lease %d failed", cfg.name, row.lease_id)
                why = f"the replay failed: {exc!r}"
        self._record(row, cfg, result, skipped=why)
        if ALGORITHMS[cfg.algorithm].exchanges:  # the bodies the check kept from pruning
            with self.db.begin() as c:
                exchange_rows.drop_checked(c, row.lease_id, before_version=self.storage.pruned_through(row.run_id))
        self.storage.delete(copy_name(self.storage, row.run_id, row.lease_id, row.sha256))
        self.storage.delete(state_name(self.storage, row.run_id, row.lease_id))
        return True

    def _start_state(self, row, cfg: RunConfig, schema) -> start_state.StartState | str | None:
        """The committed start state the round is replayed from (None: no commitment was made), or why
        the check fails on it (a str): it never came, or it is no state the run's optimizer leaves."""
        if row.state_sha256 is None:
            return None
        if row.state_received_at is None:
            return (f"its round's start state, committed with its upload, was not sent within "
                    f"{self.state_wait_s:g} s")
        return start_state.judge(self.storage.read(state_name(self.storage, row.run_id, row.lease_id)),
                                 schema=schema, group=cfg.inner.second_moment_workers > 1,
                                 replica=ALGORITHMS[cfg.algorithm].starts_from is Start.REPLICA,
                                 beta1=cfg.inner.beta1, beta2=cfg.inner.beta2)

    def _compare(self, row, cfg: RunConfig, *, first: bool, offset: int, ahead: list) -> replay.Comparison:
        schema = self.live.schema_of(row.run_id)
        state = self._start_state(row, cfg, schema)
        if isinstance(state, str):
            return replay.Comparison(math.nan, math.nan, False, state)
        base, _ = decode_snapshot(self.storage.read(self.storage.snapshot(row.run_id, row.base_version)),
                                  schema=schema)
        for seq, lease_id, sha in ahead:  # the worker started from its base minus these (worker/ledger.py)
            blob = next((n for n in (self.storage.delta(row.run_id, seq),
                                      self.storage.staged_delta(row.run_id, lease_id, sha)) if self.storage.exists(n)),
                        None)
            if blob is None:
                continue  # pruned already: the replay starts a little off, within the carried bounds
            for name, values in codec.decode(self.storage.read(blob), schema=schema).to_dense(schema).items():
                base[name] = base[name] - torch.from_numpy(values).reshape(base[name].shape)
        tokens = self._tokens(row.run_id, row.shard_index, cfg)
        sent = codec.decode(self.storage.read(copy_name(self.storage, row.run_id, row.lease_id, row.sha256)),
                            schema=schema)
        pg = replay.replay_round(cfg.model, cfg.inner, base, tokens, lr=row.lr, seed=row.seed,
                                 step_offset=0 if first else offset, start=state,
                                 feedback_decay=cfg.compression.feedback_decay)
        values, ref = replay.on_support(sent, pg)
        rounded = replay.rounded_on_support(sent, pg)
        if state is None:
            return replay.compare(values, ref, spotcheck.bounds(cfg, first_lease=first), rounded=rounded)
        # the control: the same start state on another shard, with other batches (compare_committed)
        control = replay.replay_round(cfg.model, cfg.inner, base, self._tokens(row.run_id, self._other_shard(
            row.run_id, row.shard_index), cfg), lr=row.lr, seed=row.seed ^ replay.CONTROL_SEED, start=state,
            feedback_decay=cfg.compression.feedback_decay)
        return replay.compare_committed(values, ref, rounded, replay.on_support(sent, control)[1])

    def _compare_exchanges(self, row, cfg: RunConfig) -> replay.Comparison:
        """A round with exchanges (sparta): what its exchanges carried, less its start, against a replay
        of the round from its committed start state (the replica's weights for sparta, else the base)
        and a control replay on another shard (replay.compare_committed)."""
        schema = self.live.schema_of(row.run_id)
        state = self._start_state(row, cfg, schema)
        if isinstance(state, str):
            return replay.Comparison(math.nan, math.nan, False, state)
        try:
            resumed, applied = replay.parse_applied(row.exchanges_applied or "", steps=cfg.inner.steps)
        except ValueError as exc:
            return replay.Comparison(math.nan, math.nan, False, f"where it applied its corrections is not said "
                                     f"({protocol.H_EXCHANGES_APPLIED}): {exc}")
        with self.db.read() as c:
            rows = exchange_rows.of_lease(c, row.lease_id)
        # a round resumed after an interruption: its exchanges after the resume were made before it by
        # a run of steps whose corrections the restart lost; those before it are the replay's
        sent = {step: codec.decode(body, schema=schema) for step, body, _ in rows
                if body and (not resumed or step <= resumed)}
        answers = {step: answer for step, _, answer in rows}
        if not sent:
            return replay.Comparison(math.nan, math.nan, False, "its round made no exchange: nothing of it "
                                     "reached the model to compare with the replay")
        corrections: dict[int, list[codec.Delta]] = {}
        for step, after in sorted(applied.items()):
            if step not in answers:
                return replay.Comparison(math.nan, math.nan, False, f"it says it applied a correction to its "
                                         f"exchange after step {step}, which it never made")
            if answers[step] is None:  # not kept: sampled at another rate than when it was answered
                raise NotReplayable(f"the answer to its exchange after step {step} was not kept")
            corrections.setdefault(after, []).append(codec.decode(answers[step], schema=schema))
        if ALGORITHMS[cfg.algorithm].starts_from is Start.REPLICA:
            start = state.params
        else:
            start, _ = decode_snapshot(self.storage.read(self.storage.snapshot(row.run_id, row.base_version)),
                                       schema=schema)
        steps = sorted(sent)

        def replayed(index: int, batch_seed: int) -> dict:
            return replay.replay_exchanges(cfg.model, cfg.inner, start, self._tokens(row.run_id, index, cfg),
                                           lr=row.lr, batch_seed=batch_seed, lease_seed=row.seed, steps=steps,
                                           cfg=cfg.sparta, start=state, corrections=corrections)

        own = replayed(row.shard_index, row.seed)
        control = replayed(self._other_shard(row.run_id, row.shard_index), row.seed ^ replay.CONTROL_SEED)
        values, ref, rounded, ctl = replay.exchange_vectors(sent, own, control, start)
        return replay.compare_committed(values, ref, rounded, ctl)

    def _tokens(self, run_id: int, index: int, cfg: RunConfig) -> torch.Tensor:
        raw = zstandard.ZstdDecompressor().stream_reader(self.storage.read(self.storage.shard(run_id, index))).read()
        return tokens_from_bytes(raw, cfg.tokens.dtype)

    def _other_shard(self, run_id: int, index: int) -> int:
        """A shard of the run other than `index` (the next, else the one before); `index` if it is the only one."""
        for other in (index + 1, index - 1):
            if other >= 0 and self.storage.exists(self.storage.shard(run_id, other)):
                return other
        return index

    def _record(self, row, cfg: RunConfig, result: replay.Comparison | None, *, skipped: str | None) -> None:
        now = utcnow()
        with self.db.begin() as c:
            if result is None:
                check_rows.record(c, row.id, verdict="skipped", cosine=None, norm_ratio=None, reason=skipped,
                                  credit_revoked=0.0, at=now)
                log.info("run %s: spot-check of lease %d skipped: %s", cfg.name, row.lease_id, skipped)
                return
            revoked = 0.0
            if not result.passed and row.outcome == "merged":
                return_s = (aware(row.received_at) - aware(row.leased_at)).total_seconds()
                revoked = credit.delta_credit(row.tokens, return_s=return_s, lease_ttl_s=cfg.lease_ttl_s)
            verdict = "passed" if result.passed else "failed"
            if not check_rows.record(c, row.id, verdict=verdict, cosine=result.cosine, norm_ratio=result.norm_ratio,
                                     reason=result.reason, credit_revoked=revoked, at=now):
                return  # judged meanwhile by another process's checker
            if result.passed:
                log.debug("run %s: spot-check of lease %d passed (cosine %.4f, norm ratio %.3f)", cfg.name,
                          row.lease_id, result.cosine, result.norm_ratio)
                return
            reason = f"{trust.SPOT_CHECK} of lease {row.lease_id} failed: {result.reason}"
            taken_back = row.outcome == "merged" and self._take_back(c, row, reason)
            worker_rows.add_credit(c, row.worker_id, -revoked)
            worker_rows.insert_refusal(c, run_id=row.run_id, worker_id=row.worker_id, kind="spotcheck",
                                       reason=reason[:1000])
            w = worker_rows.by_id(c, row.worker_id)
            self.workers.judge(c, row.worker_id, w.standing, cfg)
        log.warning("run %s: worker %d: %s; %.1f credit revoked%s", cfg.name, row.worker_id, reason, revoked,
                    f"; delta {row.seq} is taken back at the next merge" if taken_back else "")

    def _take_back(self, c, row, reason: str) -> bool:
        """Queue the compensation of the failed check's merged delta (coordinator/queries/compensations.py),
        its bytes kept for it (and for a restart's replay). False when there is nothing to take back."""
        name = self.storage.compensation(row.run_id, row.seq)
        self.storage.write(name, self.storage.read(copy_name(self.storage, row.run_id, row.lease_id, row.sha256)))
        if compensation_rows.add(c, run_id=row.run_id, seq=row.seq, reason=reason[:1000]) is None:
            self.storage.delete(name)
            return False
        return True
