"""A round's start state: what a worker's later round trains from that the coordinator does not hold.

A worker's first round starts from a fresh AdamW, as the coordinator's replay does. A later one
starts from the AdamW state (and the error-feedback residual) its earlier rounds left, so a replay
from a fresh optimiser only comes near it (spotcheck.CARRIED), and near is loose enough for a
delta borrowed from another lease to pass. So a worker commits to its start state with its delta
(its SHA-256 and size, in the upload's headers: protocol.H_START_STATE), before it can know whether
the lease is sampled, and keeps the bytes; a sampled lease's check asks for them, checks them
against the commitment and replays the round from them: then an honest later round is the replay
but for compression and float rounding, and is held to spotcheck.EXACT like a first round.

A sparta round starts from the worker's own replica, which the coordinator does not hold either:
its state carries the replica's weights as the round starts (`params`), and the check replays the
round's exchanges from them.

The bytes are one safetensors file, deterministic for a given state (the same state hashes alike):

    opt/<param>/<key>   each optimizer state tensor (AdamW: exp_avg, exp_avg_sq, step)
    residual/<param>    the error-feedback residual (none without error feedback)
    params/<param>      the weights the round starts from (rounds on a replica only: sparta)
    __metadata__        {"idletrain.start_state": JSON of format, steps_done, the optimizer's scalars}

`decode` treats them as untrusted: the size capped before parsing (max_bytes), every name a
parameter of the run's model, every shape its shape, every value finite; `incomplete` says where
the state is not what the run's optimizer keeps for every parameter, and `implausible` where an
AdamW state is not one AdamW's updates can produce (a first moment beyond `moment_bound(beta1,
beta2)` times the square root of the second: no gradients make that). A state crafted within those
bounds to steer the replay towards a borrowed delta is caught by the check's control replay
(spotcheck.compare_committed): the round's own data must explain what the state does not.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Mapping

import safetensors.torch
import torch

from shared.optim_state import OptimizerState

FORMAT = 1
_META_KEY = "idletrain.start_state"
HEADER_SLACK = 1 << 20  # bytes: the safetensors header (names, shapes, offsets) and the metadata


@dataclasses.dataclass(frozen=True)
class StartState:
    optimizer: OptimizerState  # tensors by parameter name; no param groups (the replay makes its own)
    residual: dict[str, torch.Tensor]
    steps_done: int  # the worker's local steps before this round: where its lr warm-up stands
    params: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # a replica's start (sparta)

    @property
    def fresh(self) -> bool:
        """A state with no optimizer tensors: a fresh AdamW (a first round, or a worker that lost its state)."""
        return not self.optimizer.tensors


def encode(optimizer: OptimizerState | None, residual: Mapping[str, torch.Tensor], *, steps_done: int,
           params: Mapping[str, torch.Tensor] | None = None) -> bytes:
    """The state's bytes (optimizer None: a fresh one; params: a replica's weights). Equal states give
    equal bytes."""
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(params or {}):
        tensors[f"params/{name}"] = params[name].detach().to("cpu", torch.float32).contiguous()
    scalars: dict = {}
    if optimizer is not None:
        for name in sorted(optimizer.tensors):
            for key in sorted(optimizer.tensors[name]):
                tensors[f"opt/{name}/{key}"] = optimizer.tensors[name][key].detach().to("cpu").contiguous()
        scalars = {n: dict(sorted(v.items())) for n, v in sorted(optimizer.scalars.items())}
    for name in sorted(residual):
        tensors[f"residual/{name}"] = residual[name].detach().to("cpu", torch.float32).contiguous()
    meta = json.dumps({"format": FORMAT, "steps_done": int(steps_done), "scalars": scalars}, sort_keys=True)
    return safetensors.torch.save(tensors, metadata={_META_KEY: meta})


def sha256(blob: bytes) -> str:
    return hashlib.sha256(blob).hexdigest()


def max_bytes(schema: Mapping[str, tuple[int, ...]], *, optimizer_tensors: int = 3, replica: bool = False) -> int:
    """The most a start state of a model of this schema can weigh: `optimizer_tensors` fp32 tensors a
    parameter (AdamW: 2 moments, or GroupAdamW's 4, and its step) plus the residual (and the weights,
    for a round on a replica), and the header."""
    n = sum(math.prod(shape) for shape in schema.values())
    per = optimizer_tensors + 1 + replica
    return 4 * n * per + 64 * len(schema) * (per + 1) + HEADER_SLACK


def decode(blob: bytes, *, schema: Mapping[str, tuple[int, ...]], limit: int) -> StartState:
    """The state in `blob`, checked against the run's model (ValueError says what is wrong)."""
    if len(blob) > limit:
        raise ValueError(f"{len(blob)} bytes, more than a start state of this model can weigh ({limit})")
    if len(blob) < 8 or int.from_bytes(blob[:8], "little") > min(len(blob) - 8, HEADER_SLACK):
        raise ValueError("not a safetensors file, or one whose header is larger than a start state's")
    try:
        header = json.loads(blob[8:8 + int.from_bytes(blob[:8], "little")])
        meta = json.loads(header["__metadata__"][_META_KEY])
        loaded = safetensors.torch.load(blob)
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"not a start state: {exc}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"start state format {meta.get('format') if isinstance(meta, dict) else None!r}, "
                         f"this coordinator reads {FORMAT}")
    steps_done, scalars = meta.get("steps_done"), meta.get("scalars", {})
    if not isinstance(steps_done, int) or not 0 <= steps_done < 2**62:
        raise ValueError(f"steps_done {steps_done!r} is not a count of steps")
    if not isinstance(scalars, dict) or any(n not in schema or not isinstance(v, dict) for n, v in scalars.items()):
        raise ValueError("its optimizer scalars name no parameter of the run's model")
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    residual: dict[str, torch.Tensor] = {}
    params: dict[str, torch.Tensor] = {}
    for key, t in loaded.items():
        kind, _, rest = key.partition("/")
        name, sub = (rest.rsplit("/", 1) + [""])[:2] if kind == "opt" else (rest, "")
        if name not in schema:
            raise ValueError(f"{key!r} names no parameter of the run's model")
        if t.dtype != torch.float32:
            raise ValueError(f"{key!r} is {t.dtype}, not float32")
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"{key!r} holds values that are not finite")
        if kind in ("residual", "params"):
            if tuple(t.shape) != tuple(schema[name]):
                raise ValueError(f"{key!r} has shape {tuple(t.shape)}, the parameter {tuple(schema[name])}")
            (residual if kind == "residual" else params)[name] = t
        elif kind == "opt" and sub:
            if sub != "step" and tuple(t.shape) != tuple(schema[name]):
                raise ValueError(f"{key!r} has shape {tuple(t.shape)}, the parameter {tuple(schema[name])}")
            tensors.setdefault(name, {})[sub] = t
        else:
            raise ValueError(f"{key!r} is neither an optimizer tensor, a residual nor a weight")
    clean = {n: {k: v for k, v in d.items() if isinstance(v, (bool, int, float)) and math.isfinite(float(v))}
             for n, d in scalars.items()}
    return StartState(OptimizerState(tensors=tensors, scalars=clean, groups=[]), residual, steps_done, params)


ADAMW_KEYS = frozenset({"step", "exp_avg", "exp_avg_sq"})  # torch.optim.AdamW's, `step` a 0-d tensor
GROUP_KEYS = frozenset({"exp_avg", "signal", "noise", "prev_grad"})  # group_adamw.GroupAdamW's; `step` an int


def incomplete(state: StartState, *, schema: Mapping[str, tuple[int, ...]], group: bool,
               replica: bool = False) -> str | None:
    """Why the state is not one the run's optimizer holds for every parameter (None: it is, or it is
    fresh): the same tensors for each parameter as that optimizer keeps, and one step count; and for
    a round on a replica (replica=True), its weights, every one of them, and only then."""
    if replica and set(state.params) != set(schema):
        missing = sorted(set(schema) - set(state.params))
        return f"the replica's weights the round starts from: none for {missing[:4] or 'every parameter'}"
    if not replica and state.params:
        return "it carries weights, where the round starts from its lease's base"
    if state.fresh:
        return None
    keys = GROUP_KEYS if group else ADAMW_KEYS
    steps = set()
    for name in schema:
        have = set(state.optimizer.tensors.get(name, {}))
        if have != keys:
            return (f"optimizer state of {name}: {sorted(have) or 'nothing'}, where the run's optimizer keeps "
                    f"{sorted(keys)}")
        step = state.optimizer.scalars.get(name, {}).get("step") if group else state.optimizer.tensors[name]["step"]
        if step is None or (isinstance(step, torch.Tensor) and step.numel() != 1):
            return f"optimizer state of {name}: no step count"
        steps.add(float(step))
    if len(steps) != 1 or not 0 <= next(iter(steps)) <= state.steps_done:
        return f"optimizer step counts {sorted(steps)[:4]} are not one count within the {state.steps_done} steps done"
    return None


def moment_bound(beta1: float, beta2: float) -> float:
    """The largest |m| / sqrt(v) AdamW's moments reach from zero, whatever the gradients: by
    Cauchy-Schwarz m^2 <= v (1-b1)^2 / ((1-b2) (1 - b1^2/b2)). inf where b1^2 >= b2 (no bound)."""
    if beta1 ** 2 >= beta2:
        return math.inf
    return (1 - beta1) / math.sqrt((1 - beta2) * (1 - beta1 ** 2 / beta2))


def implausible(state: StartState, *, beta1: float, beta2: float) -> str | None:
    """Where an AdamW state's first moment exceeds what its second allows (None: nowhere). Other
    optimizers' states (GroupAdamW's) are checked for their names, shapes and finiteness only."""
    c = moment_bound(beta1, beta2) * 1.001 + 1e-6  # float rounding of the EMAs
    for name, per in state.optimizer.tensors.items():
        m, v = per.get("exp_avg"), per.get("exp_avg_sq")
        if m is None or v is None:
            continue
        if bool((v < 0).any()):
            return f"optimizer state of {name}: a negative second moment"
        if bool((m.abs() > c * v.sqrt() + 1e-12).any()):
            return (f"optimizer state of {name}: a first moment above {c:.3g} x the square root of the second, "
                    f"which AdamW's updates never reach")
    return None


def judge(blob: bytes, *, schema: Mapping[str, tuple[int, ...]], group: bool, replica: bool, beta1: float,
          beta2: float) -> StartState | str:
    """A committed start state as the check takes it: decoded within max_bytes, then held to
    `incomplete` and `implausible`; or why the check fails on it (a str)."""
    try:
        state = decode(blob, schema=schema, limit=max_bytes(schema, replica=replica))
    except ValueError as exc:
        return f"its round's start state is not one: {exc}"
    why = incomplete(state, schema=schema, group=group, replica=replica) or implausible(state, beta1=beta1, beta2=beta2)
    return f"its round's start state is no AdamW state: {why}" if why else state
