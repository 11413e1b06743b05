"""What the coordinator reports about its runs (bodies of /api/v1, re-exported by shared/protocol.py):
a run's status, progress and summary, its workers, the lifecycle's answers, the public dashboard's
numbers and /metrics' per-run numbers. Workers never parse these; operators, the dashboard and the
CLI do."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field

from shared.algorithms.registry import AlgorithmName
from shared.config import NAME_PATTERN


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class EvalPoint(_Body):
    version: int
    loss: float
    tokens_trained: int
    at: datetime


class WorkerInfo(_Body):
    """One worker as the operator sees it (`idletrain worker list`)."""

    worker_id: int
    name: str | None
    team: str | None
    team_verified: bool = Field(False, description="registered with the key of the registered team `team`")
    device: str | None
    standing: str = Field(description="ok | throttled | banned (robust merging's verdict)")
    standing_reason: str | None
    revoked: bool
    created_at: datetime
    last_seen: datetime
    tokens_trained: int
    deltas_accepted: int
    deltas_rejected: int
    bytes_up: int
    bytes_down: int
    credit: float = Field(0.0, description="tokens of its merged deltas times their quick-return bonus")
    spot_checks: dict[str, int] = Field(default_factory=dict, description="its replay spot-checks by verdict: "
                                        "pending | passed | failed | skipped (a failed one revoked its credit)")


class RunStatus(_Body):
    name: str = Field(pattern=NAME_PATTERN)
    state: str
    algorithm: AlgorithmName
    version: int
    merged_deltas: int
    pending_deltas: int
    rejected_deltas: int = Field(description="rejected at merge (merged + rejected = version)")
    refused_at_upload: int = Field(0, description="deltas refused before they were acknowledged")
    eval_loss: float | None
    eval_history: list[EvalPoint]
    next_eval_version: int | None = Field(None, description="the version whose merge brings the next evaluation")
    workers_active: int
    workers_total: int
    tokens_trained: int
    worker_steps: int
    bytes_up: int
    bytes_down: int
    bytes_down_model: int
    bytes_down_data: int
    exchanges: int = Field(0, description="sparse exchanges with the global model (sparta algorithms)")
    dense_equivalent_bytes: int = Field(
        description="bytes data-parallel training of the same tokens would move: dense fp32 "
                    "gradients up and down for every local step")
    traffic_ratio_vs_dense: float | None
    n_params: int
    shards_total: int
    shards_done: int
    epoch: int
    clipped_deltas: int = Field(0, description="merged after robust merging scaled them down")
    compensated_deltas: int = Field(0, description="merged deltas taken back after a failed replay spot-check")
    # Counts only: which workers and why is the operator's (GET /runs/{run}/workers, admin token);
    # the reasons quote the screening's thresholds, a map for a poisoner to stay under them.
    workers_throttled: int = Field(0, description="workers robust merging throttled")
    workers_banned: int = Field(0, description="workers robust merging banned")
    token_budget: int | None = Field(None, description="the run finishes once this many tokens are trained")
    max_epochs: int | None = Field(None, description="the run finishes after this many epochs (None: no limit)")
    priority: int = 0
    finished_at: datetime | None = None
    progress: RunProgress | None = None


class RunProgress(_Body):
    """A run's progress toward its token budget, and when it gets there at its recent rate."""

    tokens_trained: int
    token_budget: int | None = Field(description="None: the run has no token budget")
    fraction: float | None = Field(description="tokens_trained / token_budget, at most 1 (None: no budget)")
    tokens_per_s: float | None = Field(description="tokens acknowledged per second over rate_window_s "
                                                   "(None: none in it)")
    rate_window_s: float = Field(description="the last hour, or the run's age when younger")
    eta_s: float | None = Field(description="seconds until the budget at that rate (None: no budget, no recent "
                                            "work, or the run is not active; 0 once reached)")


class RunSummary(_Body):
    """A run in GET /runs (public): what a worker following the whole coordinator picks by."""

    name: str
    state: str = Field(description="creating | active | paused | finishing | finished | archived")
    version: int
    created_at: datetime
    priority: int = Field(0, description="workers following the coordinator train the active run of highest "
                                         "priority they can hold")
    token_budget: int | None = Field(None, description="the run finishes once this many tokens are trained")
    tokens_trained: int = 0
    epoch: int = 0
    max_epochs: int | None = Field(None, description="the run finishes after this many epochs (None: no limit)")
    n_params: int = 0
    join_key_required: bool = Field(False, description="workers must present the run's join key to register")
    finished_at: datetime | None = None


class RunOptions(_Body):
    """PATCH /runs/{run}: the lifecycle options to change (the operator's); a field left out stays."""

    token_budget: int | None = Field(None, ge=1, le=2**62, description="null: no budget")
    epochs: int | None = Field(None, ge=0, le=1_000_000, description="0: repeat until the budget or `run finish`")
    priority: int | None = Field(None, ge=-1_000_000, le=1_000_000)


class RunDeleted(_Body):
    name: str
    rows: dict[str, int] = Field(description="database rows deleted, per table")
    files: int = Field(description="files deleted from the data dir")


# -- the public dashboard (GET / draws these; names and teams are public, tokens and reasons are not) --

class LeaderboardEntry(_Body):
    rank: int
    worker_id: int
    name: str | None
    team: str | None
    tokens_trained: int = Field(description="tokens in its deltas accepted at upload")
    deltas_accepted: int
    credit: float = Field(description="tokens of its merged deltas times their quick-return bonus")
    standing: str = Field(description="ok | throttled | banned | revoked, a badge (the reason stays with operators)")


class TeamEntry(_Body):
    rank: int
    team: str
    workers: int
    tokens_trained: int
    deltas_accepted: int
    credit: float


class LiveWorker(_Body):
    worker_id: int
    name: str | None
    team: str | None
    device: str | None
    tokens_per_s: float | None = Field(
        description="tokens of its recent deltas over the time from lease to upload; None before its first one")
    last_seen: datetime
    leasing: bool = Field(description="holds a live lease now")
    standing: str


class Dashboard(_Body):
    """Every number the dashboard page shows, for one run."""

    name: str
    state: str
    algorithm: AlgorithmName
    version: int
    n_params: int
    tokens_trained: int
    merged_deltas: int
    rejected_deltas: int = Field(description="rejected at merge, as RunStatus counts them")
    refused_at_upload: int = Field(0, description="deltas refused before they were acknowledged")
    eval_loss: float | None
    evals: list[EvalPoint] = Field(description="the eval history, thinned to at most 500 points "
                                               "(the first and the last always kept)")
    workers_total: int
    workers_live: int = Field(description="seen within live_window_s, or holding a live lease")
    live_window_s: float
    bytes_moved: int = Field(description="bytes up and down so far (deltas, exchanges, snapshots, shards)")
    dense_equivalent_bytes: int = Field(description="what data-parallel training of the same steps would move")
    bytes_saved: int = Field(description="dense_equivalent_bytes - bytes_moved (negative early in a run)")
    traffic_ratio_vs_dense: float | None
    credit_total: float
    credit_formula: str = Field(description="how credit is computed (coordinator/credit.py)")
    live_workers: list[LiveWorker] = Field(description="the fastest live workers first, at most 200")
    leaderboard: list[LeaderboardEntry] = Field(description="by credit, at most 100")
    teams: list[TeamEntry] = Field(description="by credit, at most 50")
    generated_at: datetime
    progress: RunProgress | None = None


class RunMetrics(_Body):
    """One run's numbers read from the database when /metrics is scraped."""

    name: str
    version: int
    tokens_trained: int
    merged_deltas: int
    rejected_at_merge: int
    refused_at_upload: int
    queued_deltas: int
    leases: dict[str, int] = Field(description="by state: active, expired, delivered, abandoned")
    eval_loss: float | None
    bytes_up: int
    bytes_down_model: int
    bytes_down_data: int
    dense_equivalent_bytes: int
    workers_total: int
    workers_live: int
    credit_total: float
