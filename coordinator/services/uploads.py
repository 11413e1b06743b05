"""Delta uploads: checked before the body is read, then validated, written durably and acknowledged.

A delta is acknowledged (202) only after its bytes are fsynced and its row committed. Every refusal
changes nothing but the counts: the worker's refused deltas, its standing when the refusal was its
own doing (a Refusal row: coordinator/trust.py), and the bytes it sent.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Sequence

from sqlalchemy import Connection, Row

from coordinator import credit, limits, scheduler, spotcheck, timing, voices
from coordinator.db import Database
from coordinator.errors import Conflict, Gone, ServiceError, Unprocessable
from coordinator.models import utcnow
from coordinator.queries import deltas as delta_rows
from coordinator.queries import runs as run_rows
from coordinator.queries import spotchecks as check_rows
from coordinator.queries import workers as worker_rows
from coordinator.ratelimit import RateLimiter
from coordinator.services.common import Caller, aware, owned, rate_limit
from coordinator.services.live import LiveRuns
from coordinator.services.spotchecks import SpotCheckService, copy_name
from coordinator.services.workers import WorkerService
from coordinator.storage import ReceivedBody, Storage
from shared import codec, protocol
from shared.algorithms.compress import shape_mismatch
from shared.algorithms.registry import ALGORITHMS, End
from shared.config import RunConfig
from shared.errors import DeltaFormatError


class Refused(Exception):
    """An upload refused: `error` to raise once the refusal is counted, `reason` when it counts
    against the worker's standing (None: not the worker's doing)."""

    def __init__(self, error: ServiceError, reason: str | None) -> None:
        super().__init__(error.detail)
        self.error, self.reason = error, reason


def _judged(error: type[ServiceError], message: str) -> Refused:
    return Refused(error(message), message)


class UploadService:
    def __init__(self, db: Database, storage: Storage, *, limiter: RateLimiter, workers: WorkerService,
                 live: LiveRuns, validations: limits.Slots, in_flight: limits.InFlight,
                 spotchecks: SpotCheckService | None = None, ungrouped: Sequence[voices.Network] = ()) -> None:
        self.db, self.storage, self.limiter, self.workers, self.live = db, storage, limiter, workers, live
        self.ungrouped = list(ungrouped)  # addresses whose tokens each keep their own voice (coordinator/voices.py)
        self.spotchecks = spotchecks  # replay spot-checks: a sampled lease's delta is kept and checked later
        # HTTP-layer bounds (coordinator/limits.py), per process: the route holds an upload's slot from
        # before its body is read; decoding a body holds a validation slot (shared with exchanges)
        self.validations, self.in_flight = validations, in_flight
        self._ack_lock = threading.Lock()  # one delta at a time takes the next sequence number

    def precheck(self, lease_id: int, worker: Caller) -> int:
        """What refuses an upload before a byte of its body is read (then accept(prechecked=True)):
        the upload rate limit (its token is taken here), a lease that does not exist (404), is another
        worker's (403) or was given up (410). A lease already delivered passes: whether the body is a
        retry of the same bytes (the same answer) or other content (409) takes its hash. Returns the
        lease's run id (where the body is streamed to: Storage.receiving)."""
        rate_limit(self.limiter, "upload", worker)
        with timing.phase("check"), self.db.read() as c:
            lease = owned(delta_rows.upload_check(c, lease_id), lease_id, worker)
        if lease.delta_id is None and lease.state == "abandoned":
            raise Gone(f"lease {lease_id} was given up when this worker took a newer lease")
        return lease.run_id

    def accept(self, lease_id: int, worker: Caller, body: bytes | ReceivedBody, *,
               prechecked: bool = False, commitment: tuple[str, int] | None = None) -> protocol.DeltaAccepted:
        """Validate and acknowledge a lease's delta: 202's answer once its bytes are fsynced and its row
        committed. `body`: its bytes, or the file the route streamed it to (storage.ReceivedBody, hashed
        as it arrived; renamed to its staged name once it passes). `prechecked`: precheck ran before
        the body was read (and took the rate limit's token). `commitment`: (SHA-256, size) of the
        round's start state the worker keeps (shared/algorithms/start_state.py); a sampled lease's
        acknowledgement then asks for it (start_state_wanted)."""
        if not prechecked:
            rate_limit(self.limiter, "upload", worker)
        with timing.phase("hash"):
            digest = body.sha256 if isinstance(body, ReceivedBody) else hashlib.sha256(body).hexdigest()
        with timing.phase("check"), self.db.read() as c:
            lease = owned(delta_rows.upload_check(c, lease_id), lease_id, worker)
        if lease.delta_id is not None:
            if lease.delta_sha256 == digest:  # a retry after a lost answer: same answer, merged once
                return protocol.DeltaAccepted(lease_id=lease_id, delta_id=lease.delta_id,
                                              will_merge_into=lease.delta_seq, duplicate=True,
                                              start_state_wanted=self._wants_state(lease_id, commitment))
            raise Conflict(f"lease {lease_id} already delivered a different delta")
        if lease.state == "abandoned":
            raise Gone(f"lease {lease_id} was given up when this worker took a newer lease")
        cfg = RunConfig.model_validate_json(lease.config_json)
        try:
            self._check(lease_id, lease, cfg, body)
            tokens, steps = self._round(lease_id, cfg)
            # Bytes first, durably, under a name of their lease and content, before the serial section:
            # only the row then makes the delta real, and the merger renames it to its sequence number.
            staged = self.storage.staged_delta(lease.run_id, lease_id, digest)
            with timing.phase("write"):
                if isinstance(body, ReceivedBody):
                    self.storage.stage_received(body, staged)
                else:
                    self.storage.write(staged, body)
            kept = self._keep_for_check(lease_id, lease, cfg, staged, digest, committed=commitment is not None)
            acked = None
            with timing.phase("ack_wait"):
                self._ack_lock.acquire()
            try:
                with self.db.connect() as c:
                    acked = self.ack(c, lease_id, lease, worker, len(body), digest, tokens, cfg, staged, steps=steps,
                                     spot_check=kept is not None, commitment=commitment)
                    return acked
            finally:
                self._ack_lock.release()
                if kept is not None and acked is None:  # not acknowledged: nothing to check
                    self.storage.delete(kept)  # (a duplicate's copy is the first upload's: same lease, same bytes)
        except Refused as refused:  # after any rollback: counted in a transaction of its own
            self.workers.count_refusal(worker.id, lease.run_id, len(body), reason=refused.reason)
            raise refused.error from None

    def _wants_state(self, lease_id: int, commitment: tuple[str, int] | None) -> bool:
        """Whether a delivered lease's check waits for the start state this upload commits to."""
        if commitment is None:
            return False
        with self.db.read() as c:
            row = check_rows.start_state_of(c, lease_id)
        return (row is not None and row.verdict == "pending" and row.state_received_at is None
                and (row.state_sha256, row.state_bytes) == commitment)

    def _check(self, lease_id: int, lease: Row, cfg: RunConfig, body: bytes | ReceivedBody) -> None:
        """The body's checks; raises Refused."""
        try:
            # the codec's every check (decode_flat's), without building the delta: the merger decodes it.
            # A few at a time per process (settings.max_validations: each holds its decompressed
            # body), and a frame may not expand more than an honest one can (codec.MAX_UPLOAD_RATIO).
            with self.validations.hold(), timing.phase("validate"):
                delta = codec.check_flat(body.read() if isinstance(body, ReceivedBody) else body,
                                         schema=self.live.schema_of(lease.run_id), max_ratio=codec.MAX_UPLOAD_RATIO)
        except DeltaFormatError as exc:
            raise _judged(Unprocessable, f"delta refused: {exc}") from None
        if delta.base_version != lease.base_version:
            raise _judged(Unprocessable, f"delta says base version {delta.base_version}, "
                                         f"but lease {lease_id} handed out version {lease.base_version}")
        ends_with = ALGORITHMS[cfg.algorithm].ends_with
        if ends_with is End.PSEUDO_GRADIENT and not delta.n_entries:
            raise _judged(Unprocessable, f"run {lease.run_name!r} uses {cfg.algorithm}: a round ends with its "
                                         "pseudo-gradient, not an empty delta")
        if ends_with is End.EMPTY and delta.n_entries:
            raise _judged(Unprocessable, f"run {lease.run_name!r} uses {cfg.algorithm}: a round ends with an empty "
                                         f"delta (its progress travels through exchanges), not one of "
                                         f"{delta.n_entries} entries")
        if ends_with is End.PSEUDO_GRADIENT:  # what the lease's compression makes of a whole round, nothing less
            wrong = shape_mismatch(delta.entries, self.live.schema_of(lease.run_id), cfg.compression,
                                   round_seed=lease.seed)
            if wrong is not None:
                raise _judged(Unprocessable, f"delta refused: {wrong}")
        if lease.run_version - lease.base_version > cfg.outer.max_staleness:
            # the coordinator's queue, not the worker's doing: counted, but not against its standing
            raise Refused(Gone(f"lease {lease_id} is {lease.run_version - lease.base_version} versions stale, "
                               f"above the run's limit of {cfg.outer.max_staleness}; take a new lease"), None)

    def _keep_for_check(self, lease_id: int, lease: Row, cfg: RunConfig, staged: str, digest: str, *,
                        committed: bool) -> str | None:
        """A copy of a sampled lease's staged delta, for its replay spot-check (None: not sampled).
        Taken before the serial section: the acknowledgement only adds the check's row."""
        if (self.spotchecks is None or spotcheck.not_checkable(cfg, first_lease=True, committed=committed) is not None
                or not self.spotchecks.wanted(run_seed=cfg.seed, lease_id=lease_id)):
            return None
        with timing.phase("write"):
            return self.spotchecks.keep(lease.run_id, lease_id, digest, self.storage.read(staged))

    def _round(self, lease_id: int, cfg: RunConfig) -> tuple[int, int]:
        """(tokens, steps) the delivery is credited for: a whole round's, or for sparta (whose empty
        delta is evidence of nothing) the share of its exchanges the lease made."""
        tokens = scheduler.round_tokens(steps=cfg.inner.steps, batch_size=cfg.inner.batch_size,
                                        context=cfg.model.context)
        steps = cfg.inner.steps
        if ALGORITHMS[cfg.algorithm].ends_with is End.EMPTY:
            with self.db.read() as c:
                made = delta_rows.exchanges_of(c, lease_id)
            expected = cfg.inner.steps // cfg.sparta.every
            tokens = credit.sparta_tokens(tokens, exchanges_made=made, exchanges_expected=expected)
            steps = credit.sparta_tokens(steps, exchanges_made=made, exchanges_expected=expected)
        return tokens, steps

    def ack(self, c: Connection, lease_id: int, lease: Row, worker: Caller, size: int, digest: str, tokens: int,
            cfg: RunConfig, staged: str, *, steps: int | None = None,
            spot_check: bool = False, commitment: tuple[str, int] | None = None) -> protocol.DeltaAccepted:
        """The acknowledgement itself, under the process's _ack_lock: the delta's sequence number, its
        row and every count, in one transaction (its bytes are stored already, as `staged`). Rows
        are locked in coordinator/queries' order (lease, shard, run, worker): the run's row, which
        serialises the acknowledgements, is held for the last three statements only.

        Refused here, under those locks so that no two processes both pass (raises Refused, after
        the rollback, its blob removed): an expired lease whose shard was re-issued since (410), and
        bytes another lease of the run delivered already (409: identical content merges once).
        `spot_check`: the lease was sampled for a replay spot-check (its delta's copy is kept): its
        pending row is added, unless the run has spotcheck.MAX_PENDING waiting already."""
        steps = cfg.inner.steps if steps is None else steps
        if not spotcheck.replays_from_state(cfg):
            commitment = None  # its check replays without the state: not asked for
        with timing.phase("lock"):
            delivered = delta_rows.mark_delivered(c, lease_id)
            if delivered is None:
                c.rollback()  # the same upload raced itself and the first one won, or the lease was given up
                prior = delta_rows.delivered_of(c, lease_id)
                c.rollback()
                if prior is None:  # given up since the upload's checks (the worker took a newer lease)
                    self.storage.delete(staged)
                    raise Refused(Gone(f"lease {lease_id} was given up when this worker took a newer lease"), None)
                if prior.sha256 != digest:
                    self.storage.delete(staged)  # ours alone: the delivered delta's blob has another name
                    raise Conflict(f"lease {lease_id} already delivered a different delta")
                return protocol.DeltaAccepted(lease_id=lease_id, delta_id=prior.id,
                                              will_merge_into=prior.seq, duplicate=True,
                                              start_state_wanted=self._wants_state(lease_id, commitment))
            delta_rows.shard_trained(c, lease.shard_id)  # the shard's row is ours now
            # Past its deadline (swept or not), a lease delivers only while its shard was not
            # re-issued: otherwise the shard is trained twice and a hoarder keeps its leases' credit.
            if ((lease.state == "expired" or scheduler.is_expired(aware(delivered.deadline), utcnow()))
                    and delta_rows.shard_reissued(c, lease.shard_id, lease_id)):
                c.rollback()
                self.storage.delete(staged)
                raise Refused(Gone(f"lease {lease_id} expired and its shard was leased again since; its delta "
                                   "is not taken (the shard's new holder trains it): take a new lease"), None)
            seq = run_rows.delivered(c, lease.run_id, tokens=tokens, steps=steps, size=size)
            if seq is None:  # the run finished meanwhile: its final model is made, nothing merges into it
                c.rollback()
                self.storage.delete(staged)
                raise Refused(Gone(f"lease {lease_id}'s run is finished; its delta is not taken"), None)
            # the run's row is ours: every earlier acknowledgement of the run is committed and seen.
            # Not for empty deltas (sparta's): every round of a version ends with the same one.
            copied = (None if ALGORITHMS[cfg.algorithm].ends_with is End.EMPTY
                      else delta_rows.same_content(c, lease.run_id, digest, lease_id))
            if copied is not None:
                c.rollback()
                self.storage.delete(staged)
                reason = (f"delta refused: lease {copied} of this run delivered these exact bytes "
                          "already; identical content is merged once")
                raise Refused(Conflict(reason), reason)
        with timing.phase("commit"):
            worker_rows.delivered(c, worker.id, tokens=tokens, size=size)
            delta_id = delta_rows.insert_delta(c, run_id=lease.run_id, lease_id=lease_id, worker_id=worker.id,
                                               seq=seq, base_version=lease.base_version, size=size, sha256=digest,
                                               tokens=tokens, steps=steps, now=utcnow(),
                                               voice=voices.voice_of(lease.client, team_id=worker.team_id,
                                                                     ungrouped=self.ungrouped))
            checked = spot_check and check_rows.pending_count(c, lease.run_id) < spotcheck.MAX_PENDING
            if checked:
                check_rows.insert_pending(c, run_id=lease.run_id, lease_id=lease_id, worker_id=worker.id,
                                          base_version=lease.base_version,
                                          state_sha256=commitment[0] if commitment else None,
                                          state_bytes=commitment[1] if commitment else None)
            c.commit()
        if spot_check and not checked:  # too many checks wait: this one is not taken
            self.storage.delete(copy_name(self.storage, lease.run_id, lease_id, digest))
        return protocol.DeltaAccepted(lease_id=lease_id, delta_id=delta_id, will_merge_into=seq,
                                      start_state_wanted=checked and commitment is not None)
