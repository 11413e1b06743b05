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
# what the coordinator reports about its runs (status, dashboard, metrics) lives there; named here too
from shared.reports import (Dashboard, EvalPoint, LeaderboardEntry, LiveWorker, RunDeleted, RunMetrics, RunOptions,
                            RunProgress, RunStatus, RunSummary, TeamEntry, WorkerInfo)

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
    unused_tokens: int = Field(0, description="training tokens past the last whole shard: in no shard")


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


class LeaseStanding(_Body):
    """GET /leases/{id}: whether a lease still stands (a worker resuming a saved round asks first)."""

    lease_id: int = Field(ge=1, le=MAX_ID)
    state: Literal["active", "expired", "delivered", "abandoned"]
    deliverable: bool = Field(description="whether its delta would be taken now")
    reason: str = Field(max_length=1000, description="the state in words")


class DeltaAccepted(_Body):
    lease_id: int = Field(ge=1, le=MAX_ID)
    delta_id: int = Field(ge=1, le=MAX_ID)
    will_merge_into: int = Field(ge=0, le=MAX_ID, description="the model version this delta becomes part of")
    duplicate: bool = False
    start_state_wanted: bool = Field(False, description="the lease is spot-checked: send the start state the upload "
                                                        "committed to (PUT .../start-state); only ever true for "
                                                        "an upload that made a commitment")


__all__ = [
    "API_PREFIX", "API_VERSION", "DeltaAccepted", "EvalPoint", "H_API_VERSION", "H_BASE_VERSION", "H_MAX_BODY",
    "H_UPDATE_FEEDBACK", "H_EXCHANGES_APPLIED", "H_SHA256", "H_START_STATE", "H_START_STATE_BYTES", "H_VERSION",
    "MIN_API_VERSION", "lease_api_version", "lease_compression",
    "Health", "Lease", "LeaseStanding", "RegisterRequest", "RegisterResponse", "RunConfig", "RunCreated", "RunStatus", "RunSummary",
    "WorkerInfo", "LeaseRenewed", "Dashboard", "LeaderboardEntry", "LiveWorker", "RunMetrics", "TeamEntry",
]
