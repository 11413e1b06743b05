"""The worker's local state on disk, so a kill or a laptop's sleep resumes where it was.

One folder per (coordinator, run): state_dir/runs/<sha256("coordinator|run")[:16]>/, holding

    state.st      the trainer: model, AdamW state, error-feedback residual, warm-up count; and,
                  while a round is in flight, that round: its lease, the local step reached, the
                  batch-sampling generator, the snapshot it started from, the losses so far
    unsent.delta  a finished round's encoded delta, written before the upload and deleted once
                  the coordinator acknowledged it (202) or refused it for good (404/409/410...);
                  while one is still uploading in the background the next round's goes to
                  unsent-<lease id>.delta (a queue, delivered in lease order)

Each file is "<sha256 hex of the rest>\\n<rest>" (the coordinator's checkpoint layout), written
atomically: temp file, fsync, rename, fsync of the folder. A file that fails its hash or does
not parse is set aside as *.corrupt with a warning and treated as absent: a bad state file costs
the work since the last good one, never the worker. Tensors travel in safetensors and
everything else in JSON; nothing is ever unpickled (no pickle, no torch.load).

This module touches no network and no trainer: it turns plain objects into files and back.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import threading
from pathlib import Path

import safetensors.torch
import torch

from shared import protocol
from shared.optim_state import OptimizerState, load_optimizer_state, optimizer_state
from shared.files import atomic_write

log = logging.getLogger(__name__)

FORMAT = 1
_META_KEY = "idletrain.worker_state"


@dataclasses.dataclass
class RoundState:
    """A round in flight, after `step` of its lease's inner steps."""

    lease: protocol.Lease
    step: int
    losses: list[float]
    generator: torch.Tensor  # torch.Generator.get_state() of the batch sampler after `step` batches
    base: dict[str, torch.Tensor] | None  # the snapshot the round started from (None: not needed, sparta)
    # sparta: exchange step -> the local step after which its correction was applied (RoundExchanges)
    exchanges_applied: dict[int, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class TrainerState:
    model: dict  # ModelConfig.to_dict()
    inner: dict  # the InnerConfig the optimizer was made with (JSON)
    steps_done: int  # the trainer's local steps before the round in flight (all of them between rounds)
    replica: bool  # sparta: the model is this worker's own replica, kept between leases
    params: dict[str, torch.Tensor]
    optimizer: OptimizerState
    residual: dict[str, torch.Tensor]  # error feedback: what earlier rounds computed but did not send
    round: RoundState | None = None


@dataclasses.dataclass(frozen=True)
class UnsentDelta:
    lease: protocol.Lease
    body: bytes


# -- encoding -------------------------------------------------------------------------------------

def _hashed(raw: bytes) -> bytes:
    return hashlib.sha256(raw).hexdigest().encode() + b"\n" + raw


def _unhashed(blob: bytes) -> bytes:
    digest, sep, raw = blob.partition(b"\n")
    if not sep or hashlib.sha256(raw).hexdigest().encode() != digest:
        raise ValueError("fails its SHA-256 (torn or corrupted)")
    return raw


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").contiguous()


def encode_state(state: TrainerState) -> bytes:
    tensors: dict[str, torch.Tensor] = {}
    for name, t in state.params.items():
        tensors[f"params/{name}"] = _cpu(t)
    for name, t in state.residual.items():
        tensors[f"residual/{name}"] = _cpu(t)
    for name, per_key in state.optimizer.tensors.items():
        for key, t in per_key.items():
            tensors[f"opt/{name}/{key}"] = _cpu(t)
    meta: dict = {
        "format": FORMAT, "names": list(state.params), "residual_names": list(state.residual),
        "model": state.model, "inner": state.inner, "steps_done": state.steps_done, "replica": state.replica,
        "optimizer": {"scalars": state.optimizer.scalars, "groups": state.optimizer.groups}, "round": None}
    rnd = state.round
    if rnd is not None:
        tensors["round/generator"] = _cpu(rnd.generator)
        for name, t in (rnd.base or {}).items():
            tensors[f"base/{name}"] = _cpu(t)
        meta["round"] = {"lease": rnd.lease.model_dump(mode="json"), "step": rnd.step,
                         "losses": [float(x) for x in rnd.losses], "has_base": rnd.base is not None,
                         "base_names": list(rnd.base or {}),
                         "exchanges_applied": sorted([int(k), int(v)] for k, v in rnd.exchanges_applied.items())}
    return _hashed(safetensors.torch.save(tensors, metadata={_META_KEY: json.dumps(meta)}))


def _metadata(raw: bytes) -> dict:
    header_len = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + header_len])
    return json.loads(header["__metadata__"][_META_KEY])


def decode_state(blob: bytes) -> TrainerState:
    """The inverse of encode_state; raises ValueError (or KeyError/TypeError) on anything off."""
    raw = _unhashed(blob)
    meta = _metadata(raw)
    if meta.get("format") != FORMAT:
        raise ValueError(f"state format {meta.get('format')!r}, this worker reads {FORMAT}")
    groups: dict[str, dict[str, torch.Tensor]] = {}
    opt_tensors: dict[str, dict[str, torch.Tensor]] = {}
    generator = None
    for key, t in safetensors.torch.load(raw).items():
        kind, _, rest = key.partition("/")
        if kind == "opt":
            name, _, field = rest.rpartition("/")
            opt_tensors.setdefault(name, {})[field] = t
        elif kind in ("params", "residual", "base"):
            groups.setdefault(kind, {})[rest] = t
        elif key == "round/generator":
            generator = t
        else:
            raise ValueError(f"unexpected tensor {key!r}")
    # Each dict comes back in the order it was saved in (safetensors does not keep it): a resumed
    # round then compresses its tensors in the order an uninterrupted one would.
    names = [str(n) for n in meta["names"]]
    if not names or set(names) != set(groups.get("params", {})):
        raise ValueError("the parameters do not match their list of names")

    def ordered(tensors: dict, order: list[str]) -> dict:
        if not set(tensors) <= set(names):
            raise ValueError(f"tensors for parameters the model lacks: {sorted(set(tensors) - set(names))[:5]}")
        if set(order) != set(tensors):
            raise ValueError("tensors do not match their list of names")
        return {n: tensors[n] for n in order}

    params = ordered(groups["params"], names)
    residual = ordered(groups.get("residual", {}), [str(n) for n in meta["residual_names"]])
    opt_tensors = ordered(opt_tensors, [n for n in names if n in opt_tensors])
    rnd = None
    if meta["round"] is not None:
        r = meta["round"]
        lease = protocol.Lease.model_validate(r["lease"])
        step = int(r["step"])
        if not 0 <= step <= lease.inner.steps:
            raise ValueError(f"step {step} is outside lease {lease.lease_id}'s {lease.inner.steps} steps")
        if generator is None or generator.dtype != torch.uint8 or generator.dim() != 1:
            raise ValueError("the round's generator state is missing or malformed")
        base = ordered(groups.get("base", {}), [str(n) for n in r["base_names"]]) if r["has_base"] else None
        if base is not None and set(base) != set(params):
            raise ValueError("the round's base does not name the model's parameters")
        losses = [float(x) for x in r["losses"]]
        if len(losses) != step:
            raise ValueError(f"{len(losses)} losses for {step} steps")
        applied = {int(k): int(v) for k, v in r.get("exchanges_applied", [])}
        if any(not 1 <= k < v <= step for k, v in applied.items()):
            raise ValueError("the round's applied corrections are not within its steps")
        rnd = RoundState(lease=lease, step=step, losses=losses, generator=generator, base=base,
                         exchanges_applied=applied)
    opt = meta["optimizer"]
    return TrainerState(
        model=dict(meta["model"]), inner=dict(meta["inner"]), steps_done=int(meta["steps_done"]),
        replica=bool(meta["replica"]), params=params, residual=residual,
        optimizer=OptimizerState(tensors=opt_tensors, scalars=dict(opt["scalars"]), groups=list(opt["groups"])),
        round=rnd)


def encode_unsent(unsent: UnsentDelta) -> bytes:
    head = json.dumps({"format": FORMAT, "lease": unsent.lease.model_dump(mode="json")}).encode()
    return _hashed(head + b"\n" + unsent.body)


def decode_unsent(blob: bytes) -> UnsentDelta:
    head, sep, body = _unhashed(blob).partition(b"\n")
    meta = json.loads(head)
    if not sep or meta.get("format") != FORMAT:
        raise ValueError("not an unsent delta of this format")
    return UnsentDelta(lease=protocol.Lease.model_validate(meta["lease"]), body=body)


def store_key(coordinator: str, run: str) -> str:
    return hashlib.sha256(f"{coordinator}|{run}".encode()).hexdigest()[:16]


class StateStore:
    """The state files of one (coordinator, run). Loads never raise: a missing file is None,
    a bad one is set aside with a warning and is None too."""

    STATE = "state.st"
    UNSENT = "unsent.delta"

    def __init__(self, state_dir: Path, coordinator: str, run: str) -> None:
        self.dir = Path(state_dir) / "runs" / store_key(coordinator, run)
        self.state_path = self.dir / self.STATE
        self.unsent_path = self.dir / self.UNSENT
        self._lock_fd: int | None = None
        self._unsent_lock = threading.RLock()  # the loop saves deltas while the upload thread forgets them

    def lock(self) -> bool:
        """Take this folder for this process (an advisory lock the OS drops when the process dies);
        False when another process holds it. Two workers on one folder would overwrite each other."""
        if self._lock_fd is not None:
            return True
        try:
            import fcntl
        except ImportError:  # Windows: no flock; go without
            return True
        self.dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.dir / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return False
        self._lock_fd = fd
        return True

    def unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the descriptor releases the flock
            self._lock_fd = None

    def _read(self, path: Path, decode):
        try:
            blob = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("cannot read %s (%s); ignoring it", path, exc)
            return None
        try:
            return decode(blob)
        except Exception as exc:  # noqa: BLE001 -- anything at all: a bad file must never stop the worker
            aside = path.with_name(path.name + ".corrupt")
            log.warning("local state %s is unusable (%s); ignoring it (kept as %s)", path, exc, aside.name)
            try:
                os.replace(path, aside)
            except OSError:
                pass
            return None

    # the trainer and the round in flight
    def load(self) -> TrainerState | None:
        return self._read(self.state_path, decode_state)

    def save(self, state: TrainerState) -> None:
        atomic_write(self.state_path, encode_state(state))

    def clear(self) -> None:
        self.state_path.unlink(missing_ok=True)

    # finished rounds' deltas, until the coordinator has answered them: unsent.delta first (the one
    # file of older versions), then unsent-<lease id>.delta while that one is still in the queue
    def _queued_path(self, lease_id: int) -> Path:
        return self.dir / f"unsent-{int(lease_id)}.delta"

    def load_all_unsent(self) -> list[UnsentDelta]:
        """Every saved delta not answered yet, in lease order (the order they were trained in)."""
        with self._unsent_lock:
            return self._load_all_unsent()

    def _load_all_unsent(self) -> list[UnsentDelta]:
        found = []
        for path in [self.unsent_path, *sorted(self.dir.glob("unsent-*.delta"))]:
            unsent = self._read(path, decode_unsent)
            if unsent is not None and all(u.lease.lease_id != unsent.lease.lease_id for u in found):
                found.append(unsent)
        return sorted(found, key=lambda u: u.lease.lease_id)

    def load_unsent(self) -> UnsentDelta | None:
        """The oldest saved delta not answered yet."""
        queue = self.load_all_unsent()
        return queue[0] if queue else None

    def save_unsent(self, lease: protocol.Lease, body: bytes) -> None:
        with self._unsent_lock:
            path = self.unsent_path
            if path.exists():
                held = self._read(path, decode_unsent)
                if held is not None and held.lease.lease_id != lease.lease_id:
                    path = self._queued_path(lease.lease_id)
            atomic_write(path, encode_unsent(UnsentDelta(lease=lease, body=body)))

    def clear_unsent(self, lease_id: int | None = None) -> None:
        """Forget one lease's saved delta (None: all of them)."""
        with self._unsent_lock:
            if lease_id is None:
                for path in self.dir.glob("unsent-*.delta"):
                    path.unlink(missing_ok=True)
                self.unsent_path.unlink(missing_ok=True)
                return
            self._queued_path(lease_id).unlink(missing_ok=True)
            if self.unsent_path.exists():
                held = self._read(self.unsent_path, decode_unsent)
                if held is not None and held.lease.lease_id == lease_id:
                    self.unsent_path.unlink(missing_ok=True)

