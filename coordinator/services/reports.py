"""Reports: evaluations, a run's status, the public dashboard and the numbers of a /metrics scrape
(public: names, teams and devices; never tokens or reasons)."""

from __future__ import annotations

import logging
import math
from datetime import datetime, timedelta

from sqlalchemy.exc import IntegrityError

from coordinator import credit, scheduler
from coordinator.db import Database
from coordinator.errors import Conflict
from coordinator.models import utcnow
from coordinator.queries import compensations as compensation_rows
from coordinator.queries import deltas as delta_rows
from coordinator.queries import leases as lease_rows
from coordinator.queries import reports as report_rows
from coordinator.queries import runs as run_rows
from coordinator.queries import versions as version_rows
from coordinator.runtime import RunRuntime
from coordinator.services.common import aware, aware_or_none, named_run
from coordinator.services.recovery import RecoveryService
from coordinator.services.stats import run_progress
from coordinator.traffic import Traffic
from shared import protocol
from shared.config import RunConfig

log = logging.getLogger(__name__)


def _thin(points: list, limit: int) -> list:
    """At most `limit` (>= 2) of `points`, evenly spread, the first and the last always among them."""
    if len(points) <= limit:
        return points
    step = (len(points) - 1) / (limit - 1)
    return [points[round(i * step)] for i in range(limit)]


def _evals(c, run_id: int) -> list[protocol.EvalPoint]:
    return [protocol.EvalPoint(version=v, loss=loss, tokens_trained=t, at=aware(at))
            for v, loss, t, at in version_rows.evals(c, run_id)]


class ReportService:
    LIVE_WINDOW_S = 300.0  # seen this recently (or holding a live lease): a live worker
    RATE_DELTAS = 4000  # the run's newest deltas tokens/s looks at: bounded work whatever the history
    DASHBOARD_EVALS, DASHBOARD_LIVE, DASHBOARD_LEADERS, DASHBOARD_TEAMS = 500, 200, 100, 50

    def __init__(self, db: Database, *, traffic: Traffic, recovery: RecoveryService) -> None:
        self.db, self.traffic, self.recovery = db, traffic, recovery

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
        with self.db.connect() as c:
            prior = version_rows.eval_at(c, rt.run_id, version)
            if prior is not None:
                return protocol.EvalPoint(version=version, loss=prior.loss, tokens_trained=prior.tokens_trained,
                                          at=aware(prior.at))
            # Tokens in the deltas this version holds (merged ones, up to this version).
            tokens, at = delta_rows.merged_tokens(c, rt.run_id, version), utcnow()
            try:
                version_rows.record_eval(c, run_id=rt.run_id, version=version, loss=loss, tokens_trained=tokens, at=at)
                c.commit()
            except IntegrityError:  # evaluated concurrently by the merger and an operator: same result
                c.rollback()
        log.info("run %s version %d: eval loss %.4f", rt.config.name, version, loss)
        return protocol.EvalPoint(version=version, loss=loss, tokens_trained=tokens, at=at)

    def evaluate_now(self, run_name: str) -> protocol.EvalPoint:
        with self.db.read() as c:
            run_id = named_run(run_rows.by_name(c, run_name), run_name).id
        point = self.evaluate(self.recovery.live_model(run_id, run_name))
        if point is None:
            raise Conflict(f"run {run_name!r}: the eval loss is not finite: the global model diverged "
                           "(see the coordinator's log); nothing was recorded")
        return point

    # -- status -------------------------------------------------------------------------------

    def status(self, run_name: str) -> protocol.RunStatus:
        self.traffic.flush()
        now = utcnow()
        with self.db.connect() as c:
            run = named_run(run_rows.by_name(c, run_name), run_name)
            counts = report_rows.delta_counts(c, run.id)
            exchanges = report_rows.exchanges(c, run.id)
            evals = _evals(c, run.id)
            active = report_rows.workers_leasing(c, run.id, now)
            total_workers = report_rows.worker_count(c, run.id)
            shard_counts = lease_rows.shard_states(c, run.id)
            clipped = report_rows.clipped(c, run.id)
            compensated = compensation_rows.count(c, run.id)
            standings = report_rows.standings(c, run.id)
            progress = run_progress(c, run, now=now)
        dense = scheduler.dense_equivalent_bytes(worker_steps=run.worker_steps, n_params=run.n_params)
        moved = run.bytes_up + run.bytes_down_model + run.bytes_down_data
        cfg = RunConfig.model_validate_json(run.config_json)
        return protocol.RunStatus(
            name=run.name, state=run.state, algorithm=cfg.algorithm,
            version=run.version, merged_deltas=counts["merged"], pending_deltas=counts["queued"],
            rejected_deltas=counts["rejected"], refused_at_upload=counts["refused"],
            eval_loss=evals[-1].loss if evals else None,
            eval_history=evals, workers_active=active, workers_total=total_workers,
            next_eval_version=(run.version // cfg.eval_every + 1) * cfg.eval_every if run.state == "active" else None,
            tokens_trained=run.tokens_trained, worker_steps=run.worker_steps, bytes_up=run.bytes_up,
            bytes_down=run.bytes_down_model + run.bytes_down_data, bytes_down_model=run.bytes_down_model,
            bytes_down_data=run.bytes_down_data, exchanges=exchanges, dense_equivalent_bytes=dense,
            traffic_ratio_vs_dense=(dense / moved) if moved else None, n_params=run.n_params,
            shards_total=sum(shard_counts.values()), shards_done=shard_counts.get("done", 0), epoch=run.epoch,
            clipped_deltas=clipped, compensated_deltas=compensated, workers_throttled=standings.get("throttled", 0),
            workers_banned=standings.get("banned", 0), token_budget=run.token_budget, max_epochs=run.max_epochs,
            priority=run.priority, finished_at=aware_or_none(run.finished_at), progress=progress)

    # -- the dashboard and /metrics -----------------------------------------------------------

    def dashboard(self, run_name: str, *, now: datetime | None = None) -> protocol.Dashboard:
        """Every number of the public dashboard, aggregated in SQL and capped in rows, so it stays a
        few milliseconds with hundreds of workers and a long history."""
        self.traffic.flush()
        now = now or utcnow()
        with self.db.connect() as c:
            run = named_run(run_rows.by_name(c, run_name), run_name)
            cfg = RunConfig.model_validate_json(run.config_json)
            counts = report_rows.delta_counts(c, run.id)
            n_workers, credit_total = report_rows.worker_totals(c, run.id)
            evals = _evals(c, run.id)
            live_workers = self._live_workers(c, run, cfg, now)
            leaders = report_rows.leaders(c, run.id, self.DASHBOARD_LEADERS)
            teams = report_rows.teams(c, run.id, self.DASHBOARD_TEAMS)
            progress = run_progress(c, run, now=now)
        dense = scheduler.dense_equivalent_bytes(worker_steps=run.worker_steps, n_params=run.n_params)
        moved = run.bytes_up + run.bytes_down_model + run.bytes_down_data
        return protocol.Dashboard(
            name=run.name, state=run.state, algorithm=cfg.algorithm, version=run.version, n_params=run.n_params,
            tokens_trained=run.tokens_trained, merged_deltas=counts["merged"], rejected_deltas=counts["rejected"],
            refused_at_upload=counts["refused"], eval_loss=evals[-1].loss if evals else None,
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
            generated_at=now, progress=progress)

    def _live_workers(self, c, run, cfg: RunConfig, now: datetime) -> list[protocol.LiveWorker]:
        """The run's live workers, fastest first: tokens/s is tokens over seconds from lease to upload,
        over each worker's recent deltas."""
        holding = report_rows.holding(c, run.id, now)
        live = report_rows.live(c, run.id, since=now - timedelta(seconds=self.LIVE_WINDOW_S), now=now)
        rate_since = now - timedelta(seconds=max(900.0, 2 * cfg.lease_ttl_s))
        spent: dict[int, list[float]] = {}
        for worker_id, tokens, received, leased in report_rows.deliveries(
                c, run.id, from_seq=run.next_seq - self.RATE_DELTAS, since=rate_since):
            acc = spent.setdefault(worker_id, [0.0, 0.0])
            acc[0] += tokens
            acc[1] += max(1e-3, (aware(received) - aware(leased)).total_seconds())
        live_workers = [protocol.LiveWorker(
            worker_id=wid, name=name, team=team, device=device, last_seen=aware(seen), leasing=wid in holding,
            standing=standing, tokens_per_s=spent[wid][0] / spent[wid][1] if wid in spent else None)
            for wid, name, team, device, seen, standing in live]
        live_workers.sort(key=lambda w: (w.tokens_per_s is None, -(w.tokens_per_s or 0.0), w.worker_id))
        return live_workers

    def metrics_sample(self, *, now: datetime | None = None) -> list[protocol.RunMetrics]:
        """Each run's numbers for a /metrics scrape: a handful of grouped queries over all runs."""
        self.traffic.flush()
        now = now or utcnow()
        with self.db.connect() as c:
            runs = run_rows.created(c)
            outcomes = report_rows.pending_outcomes(c)
            leases = report_rows.lease_states(c, now)
            workers = report_rows.worker_stats(c, since=now - timedelta(seconds=self.LIVE_WINDOW_S), now=now)
            losses = report_rows.newest_losses(c)
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
