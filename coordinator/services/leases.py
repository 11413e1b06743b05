"""Leases: grant (a shard and the model version to train it from), renew while the round progresses,
give up, and expire the ones past their deadline."""

from __future__ import annotations

import enum
import logging
import time
from datetime import datetime

from sqlalchemy import Connection, Executable, Row

from coordinator import scheduler, timing
from coordinator.db import Database
from coordinator.errors import (Conflict, Forbidden, Gone, TooManyRequests, Unprocessable, UpgradeRequired,
                                worker_install)
from coordinator.models import utcnow
from coordinator.queries import deltas as delta_rows
from coordinator.queries import leases as lease_rows
from coordinator.queries import runs as run_rows
from coordinator.queries import teams as team_rows
from coordinator.queries import workers as worker_rows
from coordinator.ratelimit import RateLimiter
from coordinator.services.common import Caller, aware, named_run, owned, rate_limit
from coordinator.services.workers import WorkerService
from coordinator.settings import CoordinatorSettings
from shared import protocol
from shared.algorithms.inner import scheduled_lr
from shared.config import RunConfig

log = logging.getLogger(__name__)


class Retry(enum.Enum):
    AGAIN = "again"  # nothing claimed, but a shard may be free in a moment: commit and ask again
    EXHAUSTED = "exhausted"  # every shard done in the run's last epoch: the run finishes


def pick_shard(c: Connection, claim: Executable, run_id: int, epoch: int, *,
               max_epochs: int | None = None) -> Row | None | Retry:
    """Claim the run's next shard (queries.leases.claim_statement: the least-trained pending one, lowest
    index on ties): (id, index, sha256). Only when no pending shard was free does it look further:
    Retry.AGAIN when pending shards were only being claimed that instant, or when every shard was
    done and this call opened the next epoch (all pending again); Retry.EXHAUSTED when every shard
    was done in epoch max_epochs - 1 (None: no limit); None while the rest are all out on lease (or
    the run has no shard)."""
    claimed = lease_rows.claim(c, claim, run_id)
    if claimed is not None:
        return claimed
    states = lease_rows.shard_states(c, run_id)
    if states.get("pending"):  # pending rows exist but others hold them this instant
        return Retry.AGAIN
    if not states or states.get("leased"):
        return None
    if max_epochs is not None and epoch + 1 >= max_epochs:
        return Retry.EXHAUSTED
    run_rows.open_epoch(c, run_id, epoch)  # every shard done: one request opens the next epoch, all then pick again
    return Retry.AGAIN


def finished_detail(name: str, why: str) -> str:
    """The 410 a lease request of a run that is finishing or finished gets (workers read "finished")."""
    return f"run {name!r} finished ({why}); it hands out no more leases"


def budget_left(run: Row, cfg: RunConfig, live: int) -> int | None:
    """Tokens of the run's budget not yet trained nor promised to the `live` leases out (a round each);
    None: no budget."""
    if run.token_budget is None:
        return None
    per_round = scheduler.round_tokens(steps=cfg.inner.steps, batch_size=cfg.inner.batch_size,
                                       context=cfg.model.context)
    return run.token_budget - run.tokens_trained - live * per_round


class LeaseService:
    EXPIRE_EVERY_S = 0.5  # a lease request sweeps expired leases at most this often (per process)
    ADDRESS_RETRY_S = 30.0  # Retry-After for an address at its lease cap: a round's length is unknown here

    def __init__(self, db: Database, settings: CoordinatorSettings, *, limiter: RateLimiter,
                 workers: WorkerService) -> None:
        self.db, self.settings, self.limiter, self.workers = db, settings, limiter, workers
        self._claim = lease_rows.claim_statement(skip_locked=db.skip_locked)
        self._expired_at = float("-inf")  # monotonic time of the last expiry sweep in this process

    def expire(self, now: datetime | None = None) -> int:
        """Return the shards of leases past their deadline to the queue."""
        self._expired_at = time.monotonic()
        now = now or utcnow()
        with self.db.begin() as c:
            dead = lease_rows.past_deadline(c, now)
            for lease_id, worker_id, shard_id in dead:
                log.info("lease %d of worker %d expired; its shard goes back to the queue", lease_id, worker_id)
                lease_rows.end_lease(c, lease_id, shard_id, "expired")
            return len(dead)

    def grant(self, run_name: str, worker: Caller, *, keep: int | None = None,
              client: str | None = None, api_version: int = protocol.API_VERSION) -> protocol.Lease | None:
        """A new lease for `worker`. Its earlier live leases are given up (it restarted or lost them),
        except `keep`: the one whose delta it is still uploading while it trains the next round.
        `client`: the requester's address (ratelimit.client_key): one address holds at most
        settings.max_leases_per_address live leases of a run (429 past it), so tokens minted from
        one address cannot take every shard. `api_version`: the worker's; 426 when the run's leases
        need a later one (protocol.lease_api_version). None: no work right now."""
        rate_limit(self.limiter, "lease", worker)
        if time.monotonic() - self._expired_at >= self.EXPIRE_EVERY_S:  # the merger sweeps too, every second
            with timing.phase("expire"):
                self.expire()
        with timing.phase("lease"):
            cfg: RunConfig | None = None
            for _ in range(16):
                # One transaction: give up the worker's earlier leases, claim a shard, insert the lease.
                with self.db.connect() as c:
                    run = named_run(run_rows.for_lease(c, run_name), run_name)
                    if cfg is None:  # the first attempt checks the request
                        cfg = self._admit(c, run, worker, keep, api_version)
                        if cfg is None:
                            return None
                    got = self._try(c, run, cfg, worker, keep, client)
                    if got is not Retry.AGAIN:
                        return got
            return None  # lost every race this time; the worker asks again after Retry-After

    def _admit(self, c: Connection, run: Row, worker: Caller, keep: int | None,
               api_version: int) -> RunConfig | None:
        """The request's checks (403, 429 while throttled, `keep` the worker's own, 410 once the run is
        finishing, or its token budget is trained: it starts finishing then, 426 for a worker API too old
        for the run's leases); None: the run is paused, or the leases out would train the rest of its
        budget (they may expire: ask again)."""
        if worker.run_id != run.id:
            raise Forbidden(f"this worker is registered with another run, not {run.name!r}")
        if run.state in ("finishing", "finished", "archived"):
            raise Gone(finished_detail(run.name, "its state is " + run.state))
        if run.state != "active":
            return None
        cfg = RunConfig.model_validate_json(run.config_json)
        need = protocol.lease_api_version(cfg)
        if api_version < need:
            install = worker_install()
            raise UpgradeRequired(f"run {run.name!r}'s leases (compression values {cfg.compression.values!r}, "
                                  f"feedback_decay {cfg.compression.feedback_decay:g}) need worker API v{need}, "
                                  f"not v{api_version}: {install}",
                                  extra={"min_api_version": need, "api_version": protocol.API_VERSION,
                                         "worker_install": install})
        left = budget_left(run, cfg, 0)
        if left is not None and left <= 0:
            self._finishing(c, run, f"its token budget of {run.token_budget:,} tokens is trained")
        self.workers.check_throttle(c, worker, cfg)
        if keep is not None:
            owned(lease_rows.owner(c, keep), keep, worker)
        if left is not None:  # the asker's own earlier leases are given up by this request, but for the one it keeps
            live = lease_rows.live_count(c, run.id, besides_worker=worker.id) + (keep is not None)
            if budget_left(run, cfg, live) <= 0:
                c.commit()
                return None
        return cfg

    def _finishing(self, c: Connection, run: Row, why: str) -> None:
        """The run starts finishing (committed here) and the request gets its 410."""
        c.rollback()  # nothing else of this request is kept
        if run_rows.start_finishing(c, run.id, finish_by=None, states=("active",)):
            log.info("run %s: %s; it finishes once the leases out are delivered or expired", run.name, why)
        c.commit()
        raise Gone(finished_detail(run.name, why))

    def _try(self, c: Connection, run: Row, cfg: RunConfig, worker: Caller, keep: int | None,
             client: str | None) -> protocol.Lease | None | Retry:
        """One attempt, committed (or rolled back) here."""
        # A worker asking again has given up its previous lease (it restarted, or lost it), unless it
        # says the lease's delta is on its way.
        lease_rows.abandon_others(c, worker.id, keep=keep)
        if client is not None:  # counted after the worker's own earlier leases were given up
            self._check_address(c, run, worker, client)
        claimed = pick_shard(c, self._claim, run.id, run.epoch, max_epochs=run.max_epochs)
        if claimed is Retry.EXHAUSTED:
            self._finishing(c, run, f"its {run.max_epochs} epoch(s) over the data are trained")
        if not isinstance(claimed, Row):
            c.commit()
            return claimed
        now = utcnow()
        worker_rows.leased(c, worker.id, now)
        lr = scheduled_lr(cfg.inner, tokens_done=run.tokens_trained, schedule_tokens=cfg.schedule_tokens)
        deadline = scheduler.lease_deadline(now, cfg.lease_ttl_s)
        lease_id, base_version = lease_rows.insert_lease(c, run_id=run.id, worker_id=worker.id, shard_id=claimed.id,
                                                         lr=lr, deadline=deadline, now=now, client=client)
        seed = scheduler.lease_seed(cfg.seed, lease_id)
        lease_rows.set_seed(c, lease_id, seed)
        c.commit()
        return protocol.Lease(
            lease_id=lease_id, run=run.name, shard_id=claimed.index, shard_sha256=claimed.sha256,
            base_version=base_version, seed=seed, lr=lr, inner=cfg.inner,
            compression=protocol.lease_compression(cfg), model=cfg.model.to_dict(), deadline=deadline,
            algorithm=cfg.algorithm, sparta=cfg.sparta, init_seed=cfg.seed,
            token_dtype=cfg.tokens.dtype, tokenizer_sha256=cfg.tokens.tokenizer_sha256)

    def _check_address(self, c: Connection, run: Row, worker: Caller, client: str) -> None:
        """429 (rolled back: the earlier leases stay live) when `client` holds its cap of the run's live
        leases: max_leases_per_address for workers of no registered team; a verified member's team
        has its own count at the address, and its own cap (team_rows.lease_cap, else the same)."""
        held = lease_rows.of_client(c, run.id, client, utcnow(), team_id=worker.team_id)
        cap = self.settings.max_leases_per_address
        if worker.team_id is not None:
            cap = team_rows.lease_cap(c, worker.team_id) or cap
        if held < cap:
            return
        c.rollback()
        whose = "its team's members" if worker.team_id is not None else "workers of no registered team"
        raise TooManyRequests(
            f"address {client} holds {held} live leases of run {run.name!r} by {whose}, the most allowed "
            f"({cap}: max_leases_per_address, or the team's own cap; a lab behind one address: ask the operator "
            "for a team key, --team-key); ask again when one of them is delivered", retry_after=self.ADDRESS_RETRY_S)

    def renew(self, lease_id: int, worker: Caller, *, step: int | None = None,
              now: datetime | None = None) -> protocol.LeaseRenewed:
        """Push a live lease's deadline to now + lease_ttl_s while its round progresses (a slow machine
        still training keeps its shard): `step`, the round's local step, must be past the one the last
        renewal reported (409 otherwise), and the deadline never passes the lease's lifetime
        (scheduler.lease_lifetime_s: a few of the run's expected rounds, at most max_lease_lifetime_s;
        409 once there), so no one holds a shard for ever. 410 once it expired or was given up (its
        shard may be someone else's by now)."""
        rate_limit(self.limiter, "lease", worker)
        now = now or utcnow()
        with self.db.begin() as c:
            lease = owned(lease_rows.by_id(c, lease_id), lease_id, worker)
            if lease.state != "active" or scheduler.is_expired(aware(lease.deadline), now):
                state = "expired" if lease.state == "active" else lease.state
                raise Gone(f"lease {lease_id} is {state}; it can no longer be renewed")
            cfg = RunConfig.model_validate_json(run_rows.by_id(c, lease.run_id).config_json)
            self._check_progress(lease, cfg, worker, step)
            round_times = [(aware(received) - aware(created)).total_seconds()
                           for received, created in lease_rows.recent_rounds(c, lease.run_id)]
            lifetime_s = scheduler.lease_lifetime_s(round_times, lease_ttl_s=cfg.lease_ttl_s,
                                                    rounds=self.settings.lease_lifetime_rounds,
                                                    cap_s=self.settings.max_lease_lifetime_s)
            deadline = scheduler.renewed_deadline(now, created_at=aware(lease.created_at), ttl_s=cfg.lease_ttl_s,
                                                  lifetime_s=lifetime_s)
            if deadline <= aware(lease.deadline):
                raise Conflict(f"lease {lease_id} has lived its lifetime of {lifetime_s:.0f} s (a few of this run's "
                               f"expected rounds) and is not renewed again: deliver by its deadline "
                               f"{aware(lease.deadline).isoformat()}, after which its shard goes to another worker")
            if not lease_rows.renew(c, lease_id, deadline=deadline, step=step):  # expired by the sweep a moment ago
                raise Gone(f"lease {lease_id} expired; it can no longer be renewed")
            return protocol.LeaseRenewed(lease_id=lease_id, deadline=deadline)

    def _check_progress(self, lease: Row, cfg: RunConfig, worker: Caller, step: int | None) -> None:
        """A renewal reports the round's local step, within the round and past the last renewal's."""
        if step is None:
            raise Unprocessable(f"renewing lease {lease.id} needs the round's local step (?step=N): a lease "
                                "is renewed only while its round progresses; update the worker")
        if step > cfg.inner.steps:
            reason = (f"renewal of lease {lease.id} reports local step {step}, but the run's rounds have "
                      f"{cfg.inner.steps} steps")
            self.workers.count_refusal(worker.id, lease.run_id, 0, reason=reason, kind="renew")
            raise Unprocessable(reason)
        if step <= lease.progress_step:
            raise Conflict(f"lease {lease.id}: no progress since its last renewal (step {step}; that one "
                           f"reported step {lease.progress_step}); a lease is renewed only while its round moves")

    def standing(self, lease_id: int, worker: Caller, *, now: datetime | None = None) -> protocol.LeaseStanding:
        """Whether the worker's lease still stands: a delta of it is taken while it is live, and after
        its deadline while its shard was not leased again (UploadService.ack's rule)."""
        rate_limit(self.limiter, "lease", worker)
        now = now or utcnow()
        with self.db.read() as c:
            lease = owned(lease_rows.by_id(c, lease_id), lease_id, worker)
            expired = lease.state == "expired" or (lease.state == "active"
                                                   and scheduler.is_expired(aware(lease.deadline), now))
            reissued = expired and delta_rows.shard_reissued(c, lease.shard_id, lease_id)
        if lease.state in ("delivered", "abandoned"):
            state, ok = lease.state, False
            why = ("its delta was delivered" if state == "delivered"
                   else "it was given up when this worker took a newer lease")
        elif expired:
            state, ok = "expired", not reissued
            why = (f"it expired at {aware(lease.deadline):%H:%M:%S} UTC and "
                   + ("its shard was leased to another worker since" if reissued
                      else "its shard was not leased again yet: a delta of it is still taken"))
        else:
            state, ok, why = "active", True, f"it is live until {aware(lease.deadline):%H:%M:%S} UTC"
        return protocol.LeaseStanding(lease_id=lease_id, state=state, deliverable=ok, reason=why)

    def release(self, lease_id: int, worker: Caller) -> None:
        """The worker gives a live lease up (it stops before training it): its shard goes back to the
        queue now instead of at the deadline. Giving up a lease already given up or expired changes
        nothing; 409 for one whose delta was delivered."""
        rate_limit(self.limiter, "lease", worker)
        with self.db.begin() as c:
            lease = owned(lease_rows.by_id(c, lease_id), lease_id, worker)
            if lease.state == "delivered":
                raise Conflict(f"lease {lease_id} delivered its delta; there is nothing to give up")
            if lease.state == "active":
                lease_rows.end_lease(c, lease_id, lease.shard_id, "abandoned")
