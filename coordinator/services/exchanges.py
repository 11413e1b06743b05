"""Sparse exchanges (the algorithms that exchange: sparta, sparta+diloco; shared/algorithms/registry.py):
a worker's values at seeded indices mixed into the global model mid-round, the correction sent back.

Exchanges change the global model between versions; the next merged version's snapshot contains
them. Each one is committed with its body and the version it followed before its answer leaves,
so a restart replays deltas and exchanges in their original order (RecoveryService).
"""

from __future__ import annotations

import dataclasses

from sqlalchemy.exc import IntegrityError

from coordinator import limits, scheduler, spotcheck, timing
from coordinator.db import Database
from coordinator.errors import DISK_FULL_RETRY_S, Conflict, Gone, Unavailable, Unprocessable
from coordinator.models import utcnow
from coordinator.queries import exchanges as exchange_rows
from coordinator.queries import leases as lease_rows
from coordinator.queries import runs as run_rows
from coordinator.ratelimit import RateLimiter
from coordinator.runtime import RunRuntime
from coordinator.services.common import Caller, aware, owned, rate_limit
from coordinator.services.live import LiveRuns
from coordinator.services.recovery import RecoveryService
from coordinator.services.spotchecks import SpotCheckService
from coordinator.services.workers import WorkerService
from coordinator.traffic import Traffic
from shared import codec
from shared.algorithms import exchange_screen, sparta
from shared.algorithms.compress import k_for, tensor_seed
from shared.algorithms.registry import ALGORITHMS
from shared.config import RunConfig
from shared.errors import DeltaFormatError


@dataclasses.dataclass(frozen=True)
class _Admitted:
    """What an exchange takes from its lease and run once admitted."""

    cfg: RunConfig
    run_id: int
    run_name: str
    lease_seed: int
    base_version: int


def check_exchange(sent: codec.Delta, schema: dict[str, tuple[int, ...]], *, seed: int, p: float,
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


class ExchangeService:
    def __init__(self, db: Database, *, limiter: RateLimiter, workers: WorkerService, live: LiveRuns,
                 recovery: RecoveryService, traffic: Traffic, validations: limits.Slots,
                 in_flight: limits.InFlight, spotchecks: SpotCheckService | None = None) -> None:
        self.db, self.limiter, self.workers, self.live, self.recovery = db, limiter, workers, live, recovery
        self.traffic, self.validations = traffic, validations
        self.in_flight = in_flight  # the route holds an exchange's slot from before its body is read
        # the lease's sampling is known before its round ends (spotcheck.sampled): a sampled lease's
        # answers are kept, for its check's replay
        self.spotchecks = spotchecks

    def _checked(self, rt: RunRuntime, lease_id: int) -> bool:
        """Whether the lease will be spot-checked if it commits to its start state."""
        return (self.spotchecks is not None and spotcheck.replays_from_state(rt.config)
                and self.spotchecks.wanted(run_seed=rt.config.seed, lease_id=lease_id))

    def precheck(self, lease_id: int, worker: Caller) -> None:
        """An exchange's checks before its body is read: the lease exists and is this worker's (404/403).
        The rest (rate limit, state, step) is exchange()'s."""
        with timing.phase("check"), self.db.read() as c:
            owned(lease_rows.owner(c, lease_id), lease_id, worker)

    def exchange(self, lease_id: int, step: int, worker: Caller, body: bytes) -> bytes:
        """One sparse exchange after local step `step` of a lease; returns the encoded correction.

        `body` is what shared.algorithms.sparta.select encodes: the worker's values at the indices
        drawn from exchange_seed(lease.seed, step), every tensor once, k = k_for(numel, sparta.p).
        The centre is pulled toward them (mix_into_centre) under the run's lock and the answer is
        the correction d the worker subtracts. Each (lease, step) counts once (409 after that).

        The exchange is committed (with its body and the version it followed) before the answer
        leaves, so after a crash the restart replays it in its place.
        """
        rate_limit(self.limiter, "exchange", worker)
        got = self._admit(lease_id, step, worker)
        rt = self.recovery.live_model(got.run_id, got.run_name)
        try:
            # a bounded pool and ratio as for uploads; a malformed body is the worker's doing
            with self.validations.hold(), timing.phase("validate"):
                sent = codec.decode(body, schema=rt.schema, max_ratio=codec.MAX_UPLOAD_RATIO)
        except DeltaFormatError as exc:
            reason = f"exchange refused: {exc}"
            self.workers.count_refusal(worker.id, got.run_id, len(body), reason=reason, kind="exchange")
            raise Unprocessable(reason) from None
        check_exchange(sent, rt.schema, seed=sparta.exchange_seed(got.lease_seed, step), p=got.cfg.sparta.p,
                       base_version=got.base_version, lease_id=lease_id)
        with rt.lock:
            verdict = rt.screen_exchange(sent, step=step, worker=worker.id)
            # the worker's own doing unless its peers' exchanges are beyond their limits too (then the
            # global model is what is off): only then it counts toward throttle and ban
            counts = exchange_screen.counts_against(rt.exchange_ratios, str(worker.id), cfg=got.cfg.robust)
        if not verdict.merged:  # changes nothing else
            message = f"exchange refused: {verdict.reason}"
            self.workers.count_refusal(worker.id, got.run_id, len(body), reason=message if counts else None,
                                       kind="exchange")
            raise Unprocessable(message)
        return self._fold(rt, sent, lease_id, step, worker, body)

    def _admit(self, lease_id: int, step: int, worker: Caller) -> _Admitted:
        """The lease's and the run's checks: 404/403, 409 (no exchanges in this run, or this step's
        already made), 410 (the lease is not live), 422 (not an exchange step)."""
        with self.db.read() as c:
            lease = owned(lease_rows.by_id(c, lease_id), lease_id, worker)
            run = run_rows.by_id(c, lease.run_id)
            cfg = RunConfig.model_validate_json(run.config_json)
            if not ALGORITHMS[cfg.algorithm].exchanges:
                raise Conflict(f"run {run.name!r} uses {cfg.algorithm!r}, which has no exchanges")
            if lease.state != "active" or scheduler.is_expired(aware(lease.deadline), utcnow()):
                state = "expired" if lease.state == "active" else lease.state
                raise Gone(f"lease {lease_id} is {state}; exchanges need an active lease")
            every, steps = cfg.sparta.every, cfg.inner.steps
            if not 1 <= step <= steps or step % every:
                raise Unprocessable(f"step {step} is not an exchange step of this run: exchanges follow local "
                                    f"steps {every}, {2 * every}, ... up to {steps}")
            if exchange_rows.exists(c, lease_id, step):
                raise Conflict(f"lease {lease_id} already exchanged after step {step}")
        return _Admitted(cfg=cfg, run_id=run.id, run_name=run.name, lease_seed=lease.seed,
                         base_version=lease.base_version)

    def _fold(self, rt: RunRuntime, sent: codec.Delta, lease_id: int, step: int, worker: Caller,
              body: bytes) -> bytes:
        """Fold a screened exchange into the live model and record it; the encoded correction."""
        with rt.lock:
            # Keep the centre's values at the exchanged indices and the screen's exchange ratios, so a
            # failure below can put them back: a refused exchange changes nothing. (An exchange of
            # another worker between the screen and here moved the centre by a bounded step only.)
            if rt.ahead:  # a failed merge step left it ahead of the database; the merger reloads the run
                raise Unavailable("the coordinator is recovering from a failed merge (its disk may be full); retry",
                                  retry_after=DISK_FULL_RETRY_S)
            before, ratios_before = rt.centre_at(sent), rt.exchange_ratios.copy()
            try:
                correction, scale = rt.exchange(sent, step=step, worker=worker.id)
                answer = codec.encode(correction)
                if not self.live.still_leading():  # fence: a process that lost the merger lock answers nothing more
                    raise Unavailable("the merger is changing hands between coordinator processes; retry")
                with self.db.begin() as c:
                    exchange_id = exchange_rows.record(c, run_id=rt.run_id, lease_id=lease_id, worker_id=worker.id,
                                                       step=step, after_version=rt.version, body=body,
                                                       bytes_out=len(answer), centre_scale=scale,
                                                       answer=answer if self._checked(rt, lease_id) else None)
                rt.last_exchange_id = exchange_id
                self.traffic.add(rt.run_id, worker.id, up=len(body), down_model=len(answer))
            except BaseException as exc:
                rt.undo_exchange(sent, before)
                rt.exchange_ratios = ratios_before
                if isinstance(exc, IntegrityError):  # the same exchange raced itself; the first one won
                    raise Conflict(f"lease {lease_id} already exchanged after step {step}") from None
                if isinstance(exc, ValueError):  # the correction does not fit its value codec
                    raise Unprocessable(f"exchange refused: its correction cannot be encoded: {exc}") from None
                raise
        return answer
