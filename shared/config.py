"""A training run's knobs: validated once, travel as JSON between coordinator and worker.

`RunConfig` is what `idletrain run create` sends; a lease carries the `InnerConfig` and
`CompressionConfig` a worker needs for one round.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer, model_validator

from shared.algorithms.registry import AlgorithmName
from shared.data import BUILTIN
from shared.model import ModelConfig

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
MAX_SHARD_TOKENS = 1 << 30  # RunConfig.shard_tokens at most: what a worker caps a shard's download at


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _OmitsDefaults(_Strict):
    """A model whose fields named in OMITTED_AT_DEFAULT are left out of its JSON (and model_dump)
    while they hold their default. A field added within an API version goes there: a worker of the
    previous version refuses unknown fields (extra="forbid"), and reads a config that leaves the
    new field at its default as it always did; one that sets it needs a worker that knows it."""

    OMITTED_AT_DEFAULT: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _omit_defaults(self, handler):
        data = handler(self)
        if isinstance(data, dict):
            fields = type(self).model_fields
            for name in self.OMITTED_AT_DEFAULT:
                if name in data and data[name] == fields[name].default:
                    del data[name]
        return data


class InnerConfig(_OmitsDefaults):
    """The worker's local optimisation in one round (DiLoCo's inner loop)."""

    OMITTED_AT_DEFAULT = ("second_moment_workers",)  # new in API version 3

    steps: int = Field(100, ge=1, le=100_000, description="H: local AdamW steps per round")
    batch_size: int = Field(16, ge=1, le=4096, description="sequences per local step")
    micro_batch_size: int | None = Field(
        None, ge=1, le=4096, description="sequences per forward/backward pass: a step's batch is split into "
                                         "micro-batches whose gradients are summed before the one AdamW step "
                                         "(the same step, up to float rounding); none: the whole batch at once. "
                                         "A worker splits further when its memory needs it (worker run --micro-batch)")
    lr: float = Field(2e-3, gt=0, le=1.0, description="peak inner learning rate")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="cosine floor, as a fraction of lr")
    warmup_steps: int = Field(50, ge=0, le=100_000, description="each worker's first local steps ramp up")
    weight_decay: float = Field(0.1, ge=0, le=1)
    grad_clip: float = Field(1.0, ge=0, description="global grad-norm clip; 0 disables")
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    second_moment_workers: int = Field(
        1, ge=1, le=1024,
        description="1: AdamW, each worker's step normalised by its own batch. N: AdamW's second moment estimated "
                    "for N workers' combined batch from the worker's consecutive gradients, so that N averaged "
                    "workers step as far as ddp (shared/algorithms/group_adamw.py); at most outer.group. Wins in "
                    "long runs of small batches, loses in short ones (docs/BENCHMARKS.md)")


class CompressionConfig(_OmitsDefaults):
    """How a pseudo-gradient is cut down before it travels.

    Default: every element, int4 with per-block scales, error feedback: 8x smaller than fp32. With
    error feedback what int4 rounds off goes into the next round, and measured side by side
    (docs/BENCHMARKS.md) it costs next to nothing against int8 or fp32; top-k sparsity saves bytes
    too, but in short runs costs more loss than it saves.
    """

    index: Literal["dense", "random", "topk"] = Field(
        "dense", description="dense: everything; random: a seeded subset (only the seed travels); "
                             "topk: the largest-magnitude fraction (packed indices travel)")
    fraction: float = Field(None, gt=0, le=1, validate_default=False,
                            description="share of each tensor's elements sent (default: 1 for dense, 0.1 otherwise)")
    values: Literal["fp32", "fp16", "int8", "int4", "int2", "int1"] = Field(
        "int4", description="int8/int4: per-block scales; int2: a sign and one of two fitted magnitudes per "
                            "block, for topk values; int1: a sign and the block's mean magnitude, for dense "
                            "values under error feedback (shared/codec/values.py)")
    OMITTED_AT_DEFAULT = ("feedback_decay",)  # new in API version 3

    error_feedback: bool = Field(True, description="keep what was not sent and add it to the next round")
    feedback_decay: float = Field(1.0, gt=0, le=1, description="with error_feedback, the residual kept is "
                                                               "decay * residual + pseudo-gradient - sent "
                                                               "(SparseLoCo: 0.95, no outer momentum); 1: all of it")

    @model_validator(mode="before")
    @classmethod
    def _default_fraction(cls, data):
        if isinstance(data, dict) and data.get("fraction") is None:
            data = {**data, "fraction": 1.0 if data.get("index", "dense") == "dense" else 0.1}
        return data

    @model_validator(mode="after")
    def _dense_is_whole(self) -> CompressionConfig:
        if self.index == "dense" and self.fraction != 1.0:
            raise ValueError("index='dense' sends every element: set fraction=1.0 or pick 'topk'/'random'")
        if self.feedback_decay != 1.0 and not self.error_feedback:
            raise ValueError("feedback_decay decays the error-feedback residual: set error_feedback=true, "
                             "or leave feedback_decay at 1")
        return self


class OuterConfig(_OmitsDefaults):
    """The coordinator's merge rule: outer SGD with (delayed) Nesterov momentum."""

    # DiLoCo's published 0.7 / 0.9 assumes a pre-trained start; from scratch, in the runs we
    # measured (docs/BENCHMARKS.md), its first steps overshoot (lr*(1+mu) = 1.33x the averaged
    # update) and the loss climbs. 0.8 / 0.2 keeps Nesterov with a steady-state gain of 1.
    lr: float = Field(0.8, gt=0, le=10, description="outer learning rate (DiLoCo paper: 0.7)")
    momentum: float = Field(0.2, ge=0, lt=1, description="outer Nesterov momentum (DiLoCo paper: 0.9)")
    nesterov: bool = True
    group: int = Field(4, ge=1, le=100_000,
                       description="deltas per momentum step; set it near the number of workers")
    staleness_exponent: float = Field(0.5, ge=0, le=4,
                                      description="a delta lagging r rounds is weighted (1+r)^-exponent")
    max_staleness: int = Field(1000, ge=0, description="versions a delta may lag before it is refused")
    # Without it a worker that finishes first restarts from a model holding only 1/G of its own
    # round (and none of the others'), relearns what the group is about to merge, and its next
    # delta overshoots: in the simulator's async diloco (8 workers, H=20, quick profile) 2.615
    # nats/byte against 2.578 with it and 2.535 synchronous (docs/BENCHMARKS.md).
    lookahead: bool = Field(True, description="publish (hand out, snapshot, evaluate) the open group's deltas at "
                                              "their mean, the best guess of the group's end, instead of 1/group "
                                              "of each")
    OMITTED_AT_DEFAULT = ("warmup",)  # new in API version 3
    # a gentler start for the outer steps where DiLoCo's 0.7 / 0.9 overshoots from scratch (above)
    warmup: int = Field(0, ge=0, le=1_000_000,
                        description="momentum steps over which the outer lr ramps up linearly: the k-th group "
                                    "(k = 0, 1, ...) runs at lr * min(1, (k + 1) / warmup); 0: none")


class RobustConfig(_Strict):
    """How the coordinator screens deltas before merging (shared/algorithms/robust.py)."""

    enabled: bool = True
    window: int = Field(64, ge=1, le=100_000, description="recent merged deltas whose norms define 'normal'")
    min_history: int = Field(8, ge=1, le=100_000, description="deltas seen before norms are judged")
    clip_factor: float = Field(3.0, gt=1, description="norms above this x the median are scaled down to it")
    reject_factor: float = Field(10.0, gt=1, description="norms above this x the median are rejected")
    bound_factor: float = Field(10.0, ge=0, description="norms above this x (steps * lr * sqrt(params)) are "
                                                        "rejected from the first delta on; 0 disables")
    min_cosine: float = Field(-0.1, ge=-1, le=1, description="deltas pointing further against the outer "
                                                             "momentum than this cosine are rejected")
    # Honest dense deltas measured 0.88-0.97 against the outer momentum (tests/coordinator/test_poisoned.py's
    # run), 0.41 at least in two-worker runs; a random direction has cosine ~0 (+-1/sqrt(k) on k values).
    # Honest top-k deltas can meet the momentum on a few values only (cosine down to 0.047): their
    # agreement there, less 3 random spreads, counts too (robust.py: measured). Only deltas above the
    # median norm must agree: a random one is then at most a median-sized nudge.
    min_agreement: float = Field(0.05, ge=-1, le=1, description="deltas above the median norm (before min_workers "
                                                                "workers: above half the reference round) are "
                                                                "rejected when both their cosine to the outer "
                                                                "momentum and their agreement with it where it is "
                                                                "nonzero (robust.py) are below this")
    min_workers: int = Field(4, ge=1, le=100_000, description="distinct workers whose norms must be known before "
                                                              "norms are judged against their median")
    # An honest round moves an element by at most ~H * lr (Adam's per-step step is ~lr; measured up to
    # 1.09 H lr on the test model); 3x leaves room for Adam's overshoot after a gradient spike and for a
    # refused round carried over in the error-feedback residual. Sparse compression keeps unsent values
    # for ~1/fraction rounds, so the bound grows by that.
    element_factor: float = Field(3.0, ge=0, description="values above this x (steps * lr) are rejected from the "
                                                         "first delta on; 0 disables")
    # The coordinator's own reference round (RunRuntime.calibrate): honest dense deltas measured at most 0.92x
    # it (tests/coordinator/test_poisoned.py's run, whose tiny model moves almost lr per element per step:
    # the tightest case); 1.5x leaves them 60% to spare. With error feedback a sparse delta carries several
    # rounds, so the bound is also times robust.reference_scale (top-k 10%: 3.16, 2%: 7.07, SparseLoCo's 2%
    # with decay 0.95: 2.61; honest ones measured up to 1.64x, 1.97x and 1.29x the reference).
    reference_factor: float = Field(1.5, ge=0, description="norms above this x the coordinator's own reference "
                                                           "round (x the rounds a sparse delta with error "
                                                           "feedback carries: 1/sqrt(fraction) for top-k without "
                                                           "decay) are rejected from the first delta on; "
                                                           "0 disables")
    reference_steps: int = Field(4, ge=1, le=1000, description="local AdamW steps of the reference round (scaled up "
                                                               "to the round's steps)")
    # A new worker's first round under warm-up (50 steps) moves 4% of a warmed-up one at H=3: 1% leaves room.
    min_norm_ratio: float = Field(0.01, ge=0, lt=1, description="norms below this x the median (or 1/10 of it x the "
                                                                "reference) are no round's work: rejected")
    # 8 slowed the clean test run's loss from 2.83 to 3.34 (every worker is new at first); 4 costs nothing there.
    ramp: int = Field(4, ge=1, le=10_000, description="a worker's merge weight is min(1, (its merged deltas + 1) / "
                                                      "ramp): a new token's influence grows with its record")
    throttle_after: int = Field(2, ge=1, description="rejections among a worker's last 8 deltas that throttle it")
    ban_after: int = Field(4, ge=1, description="rejections among a worker's last 8 deltas that ban it")

    @model_validator(mode="after")
    def _ordered(self) -> RobustConfig:
        if self.reject_factor < self.clip_factor:
            raise ValueError("reject_factor must be at least clip_factor")
        if self.ban_after < self.throttle_after:
            raise ValueError("ban_after must be at least throttle_after")
        return self


class SpartaConfig(_Strict):
    """Sparse elastic averaging with the global model (shared/algorithms/sparta.py)."""

    p: float = Field(0.001, gt=0, le=1, description="fraction of each tensor exchanged per exchange")
    every: int = Field(1, ge=1, le=100_000, description="local steps between exchanges")
    alpha: float = Field(0.5, gt=0, le=1, description="pull toward each other; 0.5 = pairwise average")
    values: Literal["fp32", "fp16"] = "fp16"


class TokensConfig(_Strict):
    """What the run's token ids are. The coordinator sets it when it creates the run, from the data's
    manifest (`data`) or as the bytes tokenizer (`corpus`); what a request says here is replaced."""

    tokenizer: Literal["bytes", "bpe"] = "bytes"
    tokenizer_sha256: str | None = Field(None, pattern=r"^[0-9a-f]{64}$",
                                         description="of the tokenizer.json served at /runs/{run}/tokenizer")
    dtype: Literal["uint8", "uint16", "uint32"] = Field(
        "uint8", description="little-endian ids in shards and the eval split: uint8 for bytes, uint16, uint32 for "
                             "a vocab above 65,536")


# -- the run's regime: which defaults its length calls for (docs/how-it-works.md, "Short and long runs").
# Measured side by side (`python -m bench regime`, docs/BENCHMARKS.md: 8 workers of 72k parameters, batches of
# 4 x 64 tokens), the share of ddp's gain over one worker that the short-run / long-run defaults kept: 14% / 11%
# at 400 local steps a worker, 9% / 23% at 600, 4% / 28% at 800 (two seeds each), 6% / 42% at 1,600, 11% / 47%
# at 3,200, and 19% / 65% at the long profile's 6,400. The quick, full and gpu profiles (160-400 steps) are short.
LONG_RUN_STEPS = 600  # a run planning this many local steps a worker (schedule_tokens / (group x batch x context))
LONG_RUN_LR_FACTOR = 0.7  # the group's AdamW steps up to sqrt(N) further than each worker's own: 0.7x its lr
REGIMES = ("auto", "short", "long")
# what the regime decides (section, field); in a long run: rounds of 19 (int1 both ways: ~520x less traffic
# than ddp), AdamW normalised for the group at 0.7x the lr, model updates from the worker's copy, and plain
# averaging at a gain of 1.2 (outer momentum hurts at int1)
LONG_RUN = {("inner", "steps"): 19, ("inner", "lr"): None, ("inner", "second_moment_workers"): None,
            ("compression", "values"): "int1", (None, "update_feedback"): True, (None, "update_values"): "int1",
            ("outer", "lr"): 1.2, ("outer", "momentum"): 0.0}
# a run that gives any of these has chosen for itself (an inner lr, which depends on the model, it may give and
# still be left the regime's other fields: it is used as given)
DECIDED = tuple(key for key in LONG_RUN if key != ("inner", "lr"))


def planned_worker_steps(data: dict) -> float | None:
    """Local steps each worker takes over the run's schedule_tokens, if outer.group workers train it (None:
    a field it takes is bad, and its own validation says what is wrong)."""
    section = {k: _given(data, k) for k in ("inner", "outer")}
    batch = section["inner"].get("batch_size", InnerConfig.model_fields["batch_size"].default)
    group = section["outer"].get("group", OuterConfig.model_fields["group"].default)
    model = data.get("model", {})
    try:
        context = (ModelConfig.from_dict(model) if isinstance(model, dict) else model).context
        return data["schedule_tokens"] / (group * batch * context)
    except (TypeError, ValueError, ZeroDivisionError, AttributeError):
        return None


def choose_regime(data: dict) -> str:
    """`regime` as asked; "auto": long for a diloco run that states its schedule_tokens, plans at least
    LONG_RUN_STEPS local steps a worker and leaves every field the regime decides to it (but the inner lr)."""
    asked = data.get("regime", "auto")
    if asked not in REGIMES:
        raise ValueError(f"regime must be one of {', '.join(REGIMES)}, got {asked!r}")
    if asked == "long" and data.get("algorithm", "diloco") != "diloco":
        raise ValueError(f"regime 'long' sets diloco's rounds; algorithm {data['algorithm']!r} has its own: leave "
                         "regime out, or set it to short")
    if asked != "auto":
        return asked
    if data.get("algorithm", "diloco") != "diloco" or "schedule_tokens" not in data:
        return "short"
    if any(field in (_given(data, section) if section else data) for section, field in DECIDED):
        return "short"
    steps = planned_worker_steps(data)
    return "long" if steps is not None and steps >= LONG_RUN_STEPS else "short"


def apply_regime(data: dict) -> dict:
    """The run's fields with those its regime decides filled in where not given (`regime` itself removed)."""
    long = choose_regime(data) == "long"
    data = {k: v for k, v in data.items() if k != "regime"}
    if not long or any(not isinstance(data.get(k, {}), (dict, BaseModel)) for k in ("inner", "compression", "outer")):
        return data  # a section that is no section: its own validation says what is wrong
    sections = {k: dict(_given(data, k)) for k in ("inner", "compression", "outer")}
    fills = dict(LONG_RUN)
    fills["inner", "lr"] = round(InnerConfig.model_fields["lr"].default * LONG_RUN_LR_FACTOR, 12)
    fills["inner", "second_moment_workers"] = sections["outer"].get("group", OuterConfig.model_fields["group"].default)
    c = sections["compression"]
    if c.get("index", "dense") != "dense" or _false(c.get("error_feedback", True)):
        del fills["compression", "values"]  # int1 is for dense values under error feedback
    if _false(data.get("update_feedback", True)):
        del fills[None, "update_values"]  # int1 updates need the worker's copy
    for (section, field), value in fills.items():
        target = data if section is None else sections[section]
        target.setdefault(field, value)
    return {**data, **{k: v for k, v in sections.items() if v}}


def _false(value) -> bool:
    """Whether a bool field given as `value` reads false (pydantic also takes "false", "0", "no", "off" ...)."""
    return value is False or str(value).strip().lower() in ("false", "f", "0", "no", "n", "off")


def _given(data: dict, section: str) -> dict:
    """The fields a section of the run's input gives (a dict as given, or a model's explicitly set fields)."""
    value = data.get(section, {})
    if isinstance(value, BaseModel):
        return {k: getattr(value, k) for k in value.model_fields_set}
    return value if isinstance(value, dict) else {}


class RunConfig(_OmitsDefaults):
    OMITTED_AT_DEFAULT = ("update_feedback",)  # new in API version 4

    name: str = Field(pattern=NAME_PATTERN)
    algorithm: AlgorithmName = Field(
        "diloco", description="diloco: H local steps, then a compressed pseudo-gradient merged with outer "
                              "Nesterov; sparta: local steps with sparse exchanges every `sparta.every` steps, "
                              "no pseudo-gradient; sparta+diloco: both")
    model: ModelConfig = Field(default_factory=ModelConfig)
    corpus: str = Field(BUILTIN, description=f"{BUILTIN!r}, or a text file/folder on the coordinator's disk")
    data: str | None = Field(None, description="instead of corpus: a folder made by `idletrain data prepare` on the "
                                               "coordinator's disk (its tokenizer, shards and held-out split)")
    tokens: TokensConfig = Field(default_factory=TokensConfig, description="set by the coordinator (TokensConfig)")
    corpus_max_bytes: int = Field(16 << 20, ge=1 << 16, le=1 << 36)
    shard_tokens: int = Field(1 << 18, ge=1024, le=MAX_SHARD_TOKENS, description="tokens per data shard")
    shuffle_shards: bool = Field(True, description="number the shards (the order leases hand them out in) in an "
                                                   "order shuffled by the run's seed; false: the corpus's own order")
    lease_ttl_s: float = Field(600.0, gt=0, le=7 * 86400, description="a lease expires after this")
    eval_every: int = Field(5, ge=1, description="evaluate the global model every N versions")
    eval_tokens: int = Field(1 << 17, ge=1024, description="held-out tokens used per evaluation")
    schedule_tokens: int = Field(
        200_000_000, ge=1, description="tokens over which the inner lr decays (cosine) to its floor")
    seed: int = Field(0, ge=0, lt=2**63)
    join_key: str | None = Field(None, min_length=8, max_length=256,
                                 description="if set, workers must present it to register")
    inner: InnerConfig = Field(default_factory=InnerConfig)
    compression: CompressionConfig = Field(default_factory=CompressionConfig)
    update_values: Literal["int8", "int4", "int2", "int1"] = Field(
        "int4", description="values of the incremental model updates workers download (GET /updates): int4 "
                            "halves those bytes for a little more rounding (docs/BENCHMARKS.md); int2 and int1 "
                            "only with update_feedback")
    update_feedback: bool = Field(
        False, description="each model update is the change from the worker's own copy, which the coordinator "
                           "keeps, so its rounding is carried into the next update instead of adding up "
                           "(shared/algorithms/sync.py); costs the coordinator one fp32 model per worker on disk")
    outer: OuterConfig = Field(default_factory=OuterConfig)
    sparta: SpartaConfig = Field(default_factory=SpartaConfig)
    robust: RobustConfig = Field(default_factory=RobustConfig)
    # -- the lifecycle: when the run finishes, and its place among the coordinator's runs. The
    # coordinator keeps the values it runs by in the run's row (`idletrain run set` changes them).
    token_budget: int | None = Field(None, ge=1, le=2**62, description="the run finishes once its workers trained "
                                                                      "this many tokens; none: no budget")
    epochs: int | None = Field(None, ge=0, le=1_000_000, description=(
        "passes over the training data before the run finishes; 0: repeat until the budget or `run finish`; "
        "none (the default): 1 without a token_budget, as many as the budget takes with one"))
    priority: int = Field(0, ge=-1_000_000, le=1_000_000, description="workers following the whole coordinator "
                                                                      "train the active run of highest priority")

    def max_epochs(self) -> int | None:
        """The epochs the run may train (None: no limit), as `epochs` says."""
        if self.epochs is None:
            return 1 if self.token_budget is None else None
        return self.epochs or None

    # `regime` ("auto", "short" or "long") is read from the input and not kept: what it decides is filled into
    # the fields it leaves out (apply_regime), and the config that results reads back the same with "auto"
    @model_validator(mode="before")
    @classmethod
    def _regime(cls, data):
        return apply_regime(data) if isinstance(data, dict) else data

    @field_validator("model", mode="before")
    @classmethod
    def _model_from_dict(cls, v):
        try:
            return ModelConfig.from_dict(v) if isinstance(v, dict) else v
        except (TypeError, ValueError) as exc:
            raise ValueError(str(exc)) from None

    @model_validator(mode="after")
    def _fits(self) -> RunConfig:
        if self.data is not None and self.corpus != BUILTIN:
            raise ValueError(f"give corpus ({self.corpus!r}) or data ({self.data!r}), not both")
        if self.shard_tokens < self.model.context + 1:
            raise ValueError(f"shard_tokens ({self.shard_tokens}) must exceed the context ({self.model.context})")
        if self.update_values in ("int2", "int1") and not self.update_feedback:
            raise ValueError(f"update_values {self.update_values!r} needs update_feedback: without it each update's "
                             "rounding (up to 0.6 of the change at int1) adds up until the next snapshot; set "
                             "update_feedback true, or update_values int8 or int4")
        if self.inner.second_moment_workers > self.outer.group:
            raise ValueError(f"inner.second_moment_workers ({self.inner.second_moment_workers}) exceeds outer.group "
                             f"({self.outer.group}): each outer step averages group deltas, and a worker normalised "
                             "for more steps further than ddp would; set it to outer.group or less")
        return self
