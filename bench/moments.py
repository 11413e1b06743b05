"""DES-LOC's optimizer-state averaging (arXiv 2505.22549), as the simulator runs it on top of
asynchronous DiLoCo: the weights are merged every round as always; every `every` rounds of its own a
worker also sends one AdamW state (the first moment `exp_avg` or the second `exp_avg_sq`), the
coordinator keeps each worker's latest, and the worker replaces its own state by the mean of the
latest ones before its next round. DES-LOC's published periods are 3x (first moment) and 6x (second)
the weights' period: a state is averaged on the time scale it forgets on (beta1 0.9: ~7 steps,
beta2 0.95: ~14), not every step.

What travels is counted as the real wire format would carry it: a dense int8 Delta (shared/codec,
per-block scales) each way. The second moment spans many orders of magnitude, so it travels as
log(v + eps^2) (int8 per block: v within ~+-8%, sqrt(v) within ~+-4%); below eps^2 AdamW's eps
dominates the denominator anyway.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np
import torch

from shared import codec
from shared.codec import Delta, Entry, IndexKind, ValueKind

STATES = ("exp_avg", "exp_avg_sq")


@dataclasses.dataclass(frozen=True)
class MomentSchedule:
    """Rounds between averagings of each AdamW state; 0 keeps it local (today's DiLoCo)."""

    first: int = 0  # exp_avg
    second: int = 0  # exp_avg_sq

    def period(self, state: str) -> int:
        return self.first if state == "exp_avg" else self.second

    @property
    def active(self) -> bool:
        return self.first > 0 or self.second > 0


def _to_wire(t: torch.Tensor, state: str, eps: float) -> np.ndarray:
    flat = t.detach().reshape(-1).to("cpu", torch.float32)
    if state == "exp_avg_sq":
        flat = torch.log(flat + eps * eps)
    return flat.numpy()


def _from_wire(values: np.ndarray, shape: torch.Size, state: str, eps: float) -> torch.Tensor:
    t = torch.from_numpy(np.asarray(values, dtype=np.float32)).reshape(shape)
    if state == "exp_avg_sq":
        t = (torch.exp(t) - eps * eps).clamp_min(0.0)
    return t


def encode_state(opt: torch.optim.Optimizer, names: dict[torch.nn.Parameter, str], state: str,
                 eps: float) -> bytes:
    """One AdamW state of every parameter as a dense int8 Delta's bytes (what a worker would upload)."""
    entries = []
    for group in opt.param_groups:
        for p in group["params"]:
            values = _to_wire(opt.state[p][state], state, eps)
            entries.append(Entry(names[p], values.size, IndexKind.DENSE, ValueKind.INT8, values))
    return codec.encode(Delta(base_version=0, entries=tuple(entries)))


def decode_state(blob: bytes, schema: dict[str, tuple[int, ...]], state: str, eps: float) -> dict[str, torch.Tensor]:
    dense = codec.decode(blob, schema=schema).to_dense(schema)
    return {n: _from_wire(a, torch.Size(schema[n]), state, eps) for n, a in dense.items()}


class Replica(Protocol):
    """What MomentSync needs of a simulated worker (bench/sim.py's _Replica)."""

    model: torch.nn.Module
    opt: torch.optim.Optimizer
    rounds: int  # rounds trained so far
    bytes_up: int
    bytes_down: int


class MomentSync:
    """The coordinator's side (each worker's latest state) and the workers' adoption of the mean."""

    def __init__(self, schedule: MomentSchedule, *, eps: float = 1e-8) -> None:
        self.schedule = schedule
        self.eps = eps
        self.latest: dict[str, dict[int, dict[str, torch.Tensor]]] = {s: {} for s in STATES}

    def round_done(self, worker: int, replica: Replica) -> None:
        """After a worker's round: send, and adopt the mean of, each state due at its round count;
        the bytes each way are added to the replica's."""
        model, opt, rounds = replica.model, replica.opt, replica.rounds
        names = {p: n for n, p in model.named_parameters()}
        schema = {n: tuple(p.shape) for n, p in model.named_parameters()}
        for state in STATES:
            every = self.schedule.period(state)
            if not every or rounds % every or not all(state in opt.state[p] for p in names):
                continue
            blob = encode_state(opt, names, state, self.eps)
            replica.bytes_up += len(blob)
            self.latest[state][worker] = decode_state(blob, schema, state, self.eps)
            reports = list(self.latest[state].values())
            mean = {n: torch.stack([r[n] for r in reports]).mean(0) for n in schema}
            answer = self._encode_mean(mean, state)
            replica.bytes_down += len(answer)
            adopted = decode_state(answer, schema, state, self.eps)
            for p, name in names.items():
                opt.state[p][state].copy_(adopted[name])

    def _encode_mean(self, mean: dict[str, torch.Tensor], state: str) -> bytes:
        entries = []
        for name, t in mean.items():
            values = _to_wire(t, state, self.eps)
            entries.append(Entry(name, values.size, IndexKind.DENSE, ValueKind.INT8, values))
        return codec.encode(Delta(base_version=0, entries=tuple(entries)))
