"""Workers: registration, authentication, the operator's list / revoke / readmit, and each worker's
standing (coordinator/trust.py) from what merging and the refusals made of its work.

Contributor names are unique per run, compared folded (coordinator/names.py): the first worker to
register a name claims it, and is answered its contributor key (a generated one, unless it brought
its own); a later worker joins under that name only with that key, and shows the name as first
claimed. Unnamed workers are anonymous: never compared. Team names are shared, never unique, but
for the teams the operator registered, which are taken only with their key (services/teams.py)."""

from __future__ import annotations

import logging
import secrets

from sqlalchemy import Connection, Row

from coordinator import credit, names, timing, trust
from coordinator.db import Database
from coordinator.errors import Conflict, Forbidden, NotFound, TooManyRequests, Unauthorized, Unprocessable
from coordinator.models import utcnow
from coordinator.queries import deltas as delta_rows
from coordinator.queries import leases as lease_rows
from coordinator.queries import runs as run_rows
from coordinator.queries import spotchecks as check_rows
from coordinator.queries import stats as stat_rows
from coordinator.queries import workers as worker_rows
from coordinator.ratelimit import RateLimiter, client_key
from coordinator.services.common import Caller, aware, aware_or_none, hash_secret, named_run
from coordinator.services.teams import team_of
from coordinator.traffic import Traffic
from shared import protocol
from shared.config import RunConfig

log = logging.getLogger(__name__)


def judged_outcomes(c: Connection, worker_id: int, cfg: RunConfig,
                    members: list[int] | None = None) -> list[tuple[str, str | None]]:
    """(outcome, reason) of the worker's last trust.RECENT judged events, oldest first: its deltas
    judged at merge that speak about the worker (trust.judged) and the requests refused for its own
    doing (Refusal rows, outcome "rejected"), interleaved by time. `members`: the workers that speak in
    one voice with it (coordinator/voices.py), whose events are its own too."""
    events = []
    for wid in [worker_id, *(members or [])]:
        rows, refused = worker_rows.recent_judged(c, wid, trust.RECENT)
        events += [(aware(at), 0, (outcome, reason, staleness)) for outcome, reason, staleness, at in rows]
        events += [(aware(at), 1, ("rejected", reason, None)) for reason, at in refused]
    events.sort(key=lambda e: (e[0], e[1]))
    return trust.judged([row for _, _, row in events[-trust.RECENT:]], max_staleness=cfg.outer.max_staleness)


def _abandon_leases(c: Connection, worker_id: int) -> None:
    """End the worker's live leases (a revoked or banned token); their shards go back to the queue,
    instead of waiting out the deadlines for deltas that will be refused."""
    for lease_id, shard_id in lease_rows.live_of_worker(c, worker_id):
        lease_rows.end_lease(c, lease_id, shard_id, "abandoned")


def _info(w: Row) -> protocol.WorkerInfo:
    return protocol.WorkerInfo(
        worker_id=w.id, name=w.name, team=w.team, team_verified=w.team_id is not None, device=w.device,
        standing=w.standing, standing_reason=w.standing_reason, revoked=w.revoked, created_at=aware(w.created_at),
        last_seen=aware(w.last_seen), tokens_trained=w.tokens_trained, deltas_accepted=w.deltas_accepted,
        deltas_rejected=w.deltas_rejected, bytes_up=w.bytes_up, bytes_down=w.bytes_down, credit=w.credit or 0.0)


class WorkerService:
    SEEN_EVERY_S = 5.0  # a worker's last_seen is written at most this often

    def __init__(self, db: Database, *, limiter: RateLimiter, traffic: Traffic) -> None:
        self.db, self.limiter, self.traffic = db, limiter, traffic

    def register(self, run_name: str, req: protocol.RegisterRequest, *,
                 client: str | None = None) -> protocol.RegisterResponse:
        key = client_key(client)  # an IPv6 client by its /64: its single addresses cost nothing
        wait = self.limiter.take("register", key)
        if wait > 0:
            raise TooManyRequests(f"too many registrations from {key}; retry in {wait:.1f} s", retry_after=wait)
        try:  # names anyone's page shows: refused (422) when they cannot be shown as plain text
            name, team = names.clean(req.name), names.clean(req.team, what="team")
            name_keys = names.name_keys(name) if name is not None else ()
        except ValueError as exc:
            raise Unprocessable(str(exc)) from None
        with self.db.begin() as c:
            run = named_run(run_rows.by_name(c, run_name), run_name)
            if run.join_key_hash is not None:
                if req.join_key is None:
                    raise Unauthorized(f"run {run_name!r} requires a join key (--join-key)")
                if not secrets.compare_digest(hash_secret(req.join_key), run.join_key_hash):
                    raise Forbidden("wrong join key")
            team, team_id = team_of(c, team, req.team_key)
            contributor_id, contributor_key = None, None
            if name is not None:
                name, contributor_id, contributor_key = self._contributor(
                    c, run.id, run_name, name=name, keys=name_keys, key=req.contributor_key)
            token = secrets.token_urlsafe(32)
            worker_id = worker_rows.insert_worker(c, run_id=run.id, token_hash=hash_secret(token), name=name,
                                                  team=team, device=req.device, contributor_id=contributor_id,
                                                  team_id=team_id)
        return protocol.RegisterResponse(worker_id=worker_id, token=token, contributor_key=contributor_key)

    @staticmethod
    def _contributor(c: Connection, run_id: int, run_name: str, *, name: str, keys: tuple[str, ...],
                     key: str | None) -> tuple[str, int, str | None]:
        """(the name the worker shows, its contributor's id, the contributor key to answer): `name`
        claimed now (with `key`, else a generated key, answered once), or joined with its `key`; 409
        for a name taken without its key, 403 for a wrong key. Where names claimed before the forms
        compared last changed share a form, `key` picks which of them it joins."""
        secret = key or secrets.token_urlsafe(16)
        claimed = stat_rows.claim(c, run_id=run_id, name=name, keys=keys, key_hash=hash_secret(secret))
        if claimed is not None:
            return name, claimed, None if key else secret
        holders = stat_rows.holders(c, run_id, keys)
        if not holders:  # the name it collided with was let go that instant
            raise Conflict(f"the name {name!r} was being claimed in run {run_name!r} at the same moment; "
                           "register again")
        holder = holders[0]
        if key is None:
            shown = "" if holder.name == name else f" (as {holder.name!r}: names are compared ignoring case, " \
                                                   "width, accents, invisible characters and lookalike letters)"
            raise Conflict(f"the name {name!r} is taken in run {run_name!r}{shown}. If it is yours, add this "
                           "machine with the contributor key your first registration printed "
                           "(--contributor-key KEY); otherwise choose another name")
        for h in holders:
            if secrets.compare_digest(hash_secret(key), h.key_hash):
                return h.name, h.id, None
        raise Forbidden(f"wrong contributor key for the name {holder.name!r} in run {run_name!r}")

    def authenticate(self, token: str | None) -> Caller:
        if not token:
            raise Unauthorized("missing bearer token: register with POST /api/v1/runs/{run}/workers",
                               headers={"WWW-Authenticate": "Bearer"})
        with timing.phase("auth"), self.db.read() as c:
            row = worker_rows.by_token(c, hash_secret(token))
            if row is None:
                raise Unauthorized("unknown token", headers={"WWW-Authenticate": "Bearer"})
            worker = Caller(**row._mapping)
            if worker.revoked:
                raise Forbidden("this worker's token was revoked by the operator")
            if worker.standing == "banned":
                raise Forbidden(f"this worker is banned: {worker.standing_reason}; ask the operator")
            now = utcnow()
            # last_seen feeds the dashboard's five-minute "live" window: a write every few seconds per
            # worker is plenty, not one per request
            if (now - aware(worker.last_seen)).total_seconds() >= self.SEEN_EVERY_S:
                worker_rows.seen(c, worker.id, now)
                worker.last_seen = now
            return worker

    # -- the operator's -----------------------------------------------------------------------

    def list(self, run_name: str) -> list[protocol.WorkerInfo]:
        self.traffic.flush()
        with self.db.read() as c:
            run = named_run(run_rows.by_name(c, run_name), run_name)
            checks = check_rows.by_run(c, run.id)  # replay spot-checks (services/spotchecks.py)
            return [_info(w).model_copy(update={"spot_checks": checks.get(w.id, {})})
                    for w in worker_rows.of_run(c, run.id)]

    @staticmethod
    def _of_run(c: Connection, run_name: str, worker_id: int) -> Row:
        run = named_run(run_rows.by_name(c, run_name), run_name)
        w = worker_rows.by_id(c, worker_id)
        if w is None or w.run_id != run.id:
            raise NotFound(f"run {run_name!r} has no worker {worker_id}")
        return w

    def revoke(self, run_name: str, worker_id: int) -> protocol.WorkerInfo:
        """Revoke a worker's token: every later request with it gets 403. Its active lease returns to the queue."""
        with self.db.begin() as c:
            self._of_run(c, run_name, worker_id)
            worker_rows.revoke(c, worker_id)
            _abandon_leases(c, worker_id)
            info = _info(worker_rows.by_id(c, worker_id))
        log.warning("run %s: worker %d revoked by the operator", run_name, worker_id)
        return info

    def readmit(self, run_name: str, worker_id: int) -> protocol.WorkerInfo:
        """Lift a ban or throttle (robust merging's verdict); a revoked token stays revoked."""
        with self.db.begin() as c:
            self._of_run(c, run_name, worker_id)
            worker_rows.set_standing(c, worker_id, "ok", None)
            info = _info(worker_rows.by_id(c, worker_id))
        log.warning("run %s: worker %d re-admitted by the operator", run_name, worker_id)
        return info

    # -- standing -----------------------------------------------------------------------------

    def record_merge(self, c: Connection, run_id: int, seq: int, cfg: RunConfig) -> None:
        """After the merger judged delta `seq` (its outcome written in `c`'s transaction): count a
        rejection or award the credit of a merged delta (coordinator/credit.py), and update the
        worker's standing."""
        rec = delta_rows.for_credit(c, run_id, seq)
        if rec is None:
            return
        if rec.outcome == "rejected":
            worker_rows.count_rejected(c, rec.worker_id)
        elif rec.outcome == "merged":
            return_s = (aware(rec.received_at) - aware(rec.leased_at)).total_seconds()
            worker_rows.add_credit(c, rec.worker_id, credit.delta_credit(rec.tokens, return_s=return_s,
                                                                         lease_ttl_s=cfg.lease_ttl_s))
        self.judge(c, rec.worker_id, rec.standing, cfg)

    @staticmethod
    def judge(c: Connection, worker_id: int, current: str, cfg: RunConfig) -> None:
        """Update the worker's standing (`current`) from its recent judged events (coordinator/trust.py),
        and its voice's other members' with it: tokens of one address are judged together, on all
        their events (coordinator/voices.py)."""
        w = worker_rows.by_id(c, worker_id)
        members = delta_rows.voice_members(c, w.run_id, worker_id) if w is not None else []
        for wid in [worker_id, *members]:
            state = current if wid == worker_id else worker_rows.by_id(c, wid).standing
            others = [m for m in [worker_id, *members] if m != wid]
            verdict = trust.standing(judged_outcomes(c, wid, cfg, others), current=state, cfg=cfg.robust)
            if verdict.state != state:
                reason = verdict.reason if wid == worker_id else f"with the tokens of its address: {verdict.reason}"
                log.warning("run %s: worker %d is now %s: %s", cfg.name, wid, verdict.state, reason)
                worker_rows.set_standing(c, wid, verdict.state, reason)
                if verdict.state == "banned":  # it delivers nothing more: its shards go back to the queue now
                    _abandon_leases(c, wid)

    @staticmethod
    def check_throttle(c: Connection, worker: Caller, cfg: RunConfig) -> None:
        """429 while a throttled worker's next lease is not due yet."""
        if worker.standing != "throttled":
            return
        recent = judged_outcomes(c, worker.id, cfg)
        wait = trust.throttle_wait(rejections=trust.rejection_weight(recent),
                                   last_lease_at=aware_or_none(worker.last_lease_at), now=utcnow(), cfg=cfg.robust)
        if wait > 0:
            raise TooManyRequests(f"this worker is throttled ({worker.standing_reason}); "
                                  f"next lease in {wait:.0f} s", retry_after=wait)

    def count_refusal(self, worker_id: int, run_id: int, size: int, *, reason: str | None = None,
                      kind: str = "delta") -> None:
        """Count a refused request of `worker_id`: a refused delta in its deltas_rejected, and, given a
        `reason` (the refusal was the worker's own doing, not e.g. the coordinator's queue), a Refusal
        row that counts toward throttle and ban like a delta rejected at merge (its standing is
        judged again here). Its bytes are counted as traffic all the same."""
        with self.db.begin() as c:
            w = worker_rows.by_id(c, worker_id)
            if w is not None:
                if kind == "delta":
                    worker_rows.count_rejected(c, worker_id)
                if reason is not None:
                    worker_rows.insert_refusal(c, run_id=run_id, worker_id=worker_id, kind=kind, reason=reason[:1000])
                    cfg = RunConfig.model_validate_json(run_rows.by_id(c, run_id).config_json)
                    self.judge(c, worker_id, w.standing, cfg)
        if size:
            self.traffic.add(run_id, worker_id, up=size)  # the bytes came all the same (coordinator/traffic.py)

