"""The JSON contract between coordinator and worker (bodies of /api/v1). Bump API_VERSION on
any incompatible change, and MIN_API_VERSION once the coordinator stops serving an older worker;
the coordinator reports both at /healthz and workers check them."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from shared.algorithms.registry import ALGORITHMS, NAMES, AlgorithmName, End
from shared.config import NAME_PATTERN, CompressionConfig, InnerConfig, RunConfig, SpartaConfig
from shared.model import ModelConfig

# 2: leases carry the token dtype and the tokenizer's hash, the model's arch fields and the inner
# micro-batch; a version-1 worker would refuse them, so it is told to upgrade instead.
# 3: a lease's compression may send int2 values or decay its error feedback (feedback_decay); a
# version-2 worker still takes the leases of runs without them (lease_api_version).
# 4: a lease's compression may send int1 values, and a run's model updates may be taken from the worker's
# copy (RunConfig.update_feedback, int2 / int1 updates); older workers still take the leases of runs without.
# A worker of this release speaks any version from MIN_API_VERSION up: the highest its coordinator serves.
API_VERSION = 4
# The oldest worker API this coordinator still serves: a worker of MIN_API_VERSION..API_VERSION works,
# one outside it is answered 426 and told what to install (worker requests say theirs in H_API_VERSION).
MIN_API_VERSION = 2
API_PREFIX = "/api/v1"

# Custom headers on binary answers and uploads.
H_SHA256 = "X-Content-SHA256"  # hex SHA-256 of the body as sent
H_VERSION = "X-Model-Version"
H_BASE_VERSION = "X-Base-Version"
H_UPDATE_FEEDBACK = "X-Update-Feedback"  # "1" on a model update taken from the worker's copy (update_feedback)
H_API_VERSION = "X-Idletrain-Api"  # on a worker's requests: its API version (absent: the current one)
H_MAX_BODY = "X-Max-Body-Bytes"  # on a 413: the largest body the route takes
# On a delta upload: the worker's commitment to its round's start state (shared/algorithms/start_state.py),
# the SHA-256 (lowercase hex) and the size in bytes of the state it keeps until told it is not wanted.
H_START_STATE = "X-Start-State-SHA256"
H_START_STATE_BYTES = "X-Start-State-Bytes"
H_EXCHANGES_APPLIED = "X-Exchanges-Applied"  # with a sparta round's start state: spotcheck.format_applied

# The exact forms of what a coordinator sends that a worker puts in a file name, a URL or a header:
# the worker does not trust the coordinator either, and checks them before using any.
SHA256_PATTERN = r"^[0-9a-f]{64}$"  # hashlib's hexdigest(): lowercase, exactly 64 characters
TOKEN_PATTERN = r"^[A-Za-z0-9_-]{1,256}$"  # secrets.token_urlsafe's alphabet; it travels in a header
MAX_ID = 2**63 - 1  # database ids, versions and seeds are signed 64-bit integers


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Health(BaseModel):
    # Fields a newer coordinator adds are ignored, so an older worker still reads its /healthz.
    model_config = ConfigDict(extra="ignore")

    status: str = "ok"
    api_version: int = API_VERSION
    keeps_delivering_lease: bool = Field(False, description="a lease request may name (?keep=) the worker's lease "
                                                            "whose delta is still uploading; that lease stays live "
                                                            "(absent, from an older coordinator: it does not)")
    min_api_version: int | None = Field(None, description="the oldest worker API served; api_version is the newest "
                                                          "(absent, from an older coordinator: only api_version)")
    worker_install: str | None = Field(None, description="what a worker outside the range installs")
    max_upload_bytes: int | None = Field(None, description="the largest delta body accepted (a worker reads "
                                                           "anything but 1..2^63-1 as not said)")

    @field_validator("max_upload_bytes", mode="before")
    @classmethod
    def _a_cap_or_none(cls, v):
        """A cap of 0, -1, 10^30 or a string says nothing a worker can act on: it is taken as not said."""
        return v if isinstance(v, int) and not isinstance(v, bool) and 0 < v <= MAX_ID else None


class RegisterRequest(_Body):
    name: str | None = Field(None, max_length=64, description="contributor name shown on the leaderboard")
    team: str | None = Field(None, max_length=64)
    device: str | None = Field(None, max_length=64, description="cpu, cuda, mps…")
    join_key: str | None = Field(None, max_length=256)
    contributor_key: str | None = Field(None, max_length=256, description="adds this machine under `name` when "
                                        "another claimed it: the key its first registration answered")
    team_key: str | None = Field(None, max_length=256, description="joins the registered team `team` as a verified "
                                 "member: the key the operator created it with")


class TeamCreate(_Body):
    name: str = Field(min_length=1, max_length=64, description="compared as contributor names are")
    max_leases_per_address: int | None = Field(None, ge=1, description="live leases of a run its verified members "
                                               "may hold from one address (default: the coordinator's)")


class TeamInfo(_Body):
    team_id: int
    name: str
    max_leases_per_address: int | None
    created_at: datetime
    members: int = Field(0, description="verified workers, every run's, not revoked")
    key: str | None = Field(None, description="the team's key: in the answer that created it, shown only that once")


class RegisterResponse(_Body):
    worker_id: int = Field(ge=1, le=MAX_ID)
    token: str = Field(pattern=TOKEN_PATTERN, description="bearer token (urlsafe, at most 256 characters); shown "
                                                          "once, stored hashed by the coordinator")
    contributor_key: str | None = Field(None, max_length=256, description="when this registration claimed its name "
                                        "with a generated key: that key (shown once), which adds other machines")


class RunCreated(_Body):
    name: str
    n_shards: int
    n_params: int
    train_tokens: int
    eval_tokens: int


class Lease(_Body):
    lease_id: int = Field(ge=1, le=MAX_ID)
    run: str = Field(pattern=NAME_PATTERN)
    shard_id: int = Field(ge=0, le=MAX_ID)
    shard_sha256: str = Field(pattern=SHA256_PATTERN, description="SHA-256 (lowercase hex) of the shard's tokens; "
                                                                  "a worker names its cached copy by it")
    base_version: int = Field(ge=0, le=MAX_ID)
    seed: int = Field(ge=0, le=MAX_ID, description="seeds this round's sampling and random index selection")
    lr: float = Field(ge=0, le=1.0, description="inner learning rate for this round (already scheduled)")
    inner: InnerConfig
    compression: CompressionConfig = Field(description="how the round's pseudo-gradient is cut down: the run's "
                                                       "compression (lease_compression)")
    model: ModelConfig = Field(description="the run's ModelConfig (on the wire: ModelConfig.to_dict()); checked here "
                                           "(keys, types, ranges, at most shared.model.MAX_PARAMS parameters), sized "
                                           "against its own cap by the worker")
    deadline: datetime
    algorithm: AlgorithmName = Field("diloco", description="the run's algorithm (RunConfig.algorithm): diloco, sparta "
                                                           "or sparta+diloco; a worker refuses one it does not know")
    sparta: SpartaConfig = Field(default_factory=SpartaConfig,
                                 description="exchange settings; used when the algorithm exchanges "
                                             "(shared/algorithms/registry.py)")
    token_dtype: Literal["uint8", "uint16", "uint32"] = Field(
        "uint8", description="the shard's ids: little-endian uint8 (bytes), uint16, or uint32 for a vocab above "
                             "65,536 (RunConfig.tokens.dtype); absent from older coordinators: uint8")
    tokenizer_sha256: str | None = Field(None, pattern=SHA256_PATTERN,
                                         description="SHA-256 of the run's tokenizer.json (GET /runs/{run}/tokenizer)")
    init_seed: int | None = Field(None, ge=0, le=MAX_ID,
                                  description="the run's seed: version 0 is the model built from it, so a "
                                              "worker can make it and only check its hash (If-None-Match) "
                                              "instead of downloading it; absent from older coordinators")

    @field_validator("model", mode="before")
    @classmethod
    def _model_config(cls, v):
        if not isinstance(v, Mapping):
            return v  # a ModelConfig already (anything else is refused as not one)
        try:
            return ModelConfig.from_dict(v)  # arithmetic only: nothing is built or allocated
        except (TypeError, ValueError) as exc:
            raise ValueError(f"not a valid model config: {exc}") from None

    @field_validator("algorithm", mode="before")
    @classmethod
    def _known_algorithm(cls, v):
        if isinstance(v, str) and v not in NAMES:  # a newer coordinator's: say what to do about it
            raise ValueError(f"this worker does not know the algorithm {v!r} (it knows {', '.join(NAMES)}): "
                             "upgrade idletrain")
        return v


def lease_compression(cfg: RunConfig) -> CompressionConfig:
    """The compression a lease of the run carries: the run's, or, when its algorithm ends a round with
    an empty delta (nothing is compressed), the default, which a worker of any version reads."""
    return CompressionConfig() if ALGORITHMS[cfg.algorithm].ends_with is End.EMPTY else cfg.compression


def lease_api_version(cfg: RunConfig) -> int:
    """The oldest worker API that takes the run's leases: a version-3 worker knows neither int1 values
    nor update_feedback's copies; a version-2 worker knows neither int2 values, feedback_decay nor
    inner.second_moment_workers (their configs leave a decay of 1 and second_moment_workers 1 out of
    their JSON)."""
    compression = lease_compression(cfg)
    if compression.values == "int1" or cfg.update_feedback:  # int1 updates come only with update_feedback
        return 4
    new = compression.values == "int2" or compression.feedback_decay != 1.0 or cfg.inner.second_moment_workers != 1
    return 3 if new else 2


class LeaseRenewed(_Body):
    lease_id: int = Field(ge=1, le=MAX_ID)
    deadline: datetime = Field(description="the lease's new deadline (now + the run's lease_ttl_s)")


class DeltaAccepted(_Body):
    lease_id: int = Field(ge=1, le=MAX_ID)
    delta_id: int = Field(ge=1, le=MAX_ID)
    will_merge_into: int = Field(ge=0, le=MAX_ID, description="the model version this delta becomes part of")
    duplicate: bool = False
    start_state_wanted: bool = Field(False, description="the lease is spot-checked: send the start state the upload "
                                                        "committed to (PUT .../start-state); only ever true for "
                                                        "an upload that made a commitment")


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


__all__ = [
    "API_PREFIX", "API_VERSION", "DeltaAccepted", "EvalPoint", "H_API_VERSION", "H_BASE_VERSION", "H_MAX_BODY",
    "H_UPDATE_FEEDBACK", "H_EXCHANGES_APPLIED", "H_SHA256", "H_START_STATE", "H_START_STATE_BYTES", "H_VERSION",
    "MIN_API_VERSION", "lease_api_version", "lease_compression",
    "Health", "Lease", "RegisterRequest", "RegisterResponse", "RunConfig", "RunCreated", "RunStatus", "RunSummary",
    "WorkerInfo", "LeaseRenewed", "Dashboard", "LeaderboardEntry", "LiveWorker", "RunMetrics", "TeamEntry",
]
