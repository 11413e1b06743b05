"""A run's live state in the coordinator's memory: the global model and the merge rule's state.

The merger thread mutates it, and so do sparse exchanges (sparta), always under `lock`. It is
rebuilt on start from the newest good checkpoint plus a replay, in their original order, of the
deltas processed and the exchanges answered after it, so nothing acknowledged is lost or doubled.

A checkpoint holds everything the merge depends on: the weights, the outer optimizer state
(momentum, the group's accumulator and count), the version, the robust-merge norm history and
the last exchange folded in. Data position (shards done / leased / pending) lives in the
database, committed with each lease and delta. The coordinator draws no random numbers: every
seed it hands out is derived from the run's seed and a lease id, so there is no RNG to save.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import safetensors.torch
import torch

from coordinator.storage import Storage
from shared import codec
from shared.algorithms import robust, sparta
from shared.algorithms.outer import OuterState, apply_delta, staleness_weight
from shared.config import RunConfig
from shared.errors import DeltaFormatError
from shared.model import TransformerLM, build_model, evaluate_loss, get_params, param_schema, set_params
from shared.snapshot import encode_snapshot

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MergeOutcome:
    version: int
    merged: bool
    staleness: int
    weight: float
    reason: str | None
    snapshot_sha256: str
    snapshot_size: int
    norm: float | None = None
    cosine: float | None = None
    clipped: bool = False


class RunRuntime:
    CHECKPOINTS_KEPT = 3  # a torn or corrupt newest one falls back to the one before

    def __init__(self, *, run_id: int, config: RunConfig, storage: Storage, state: OuterState, version: int,
                 norm_history: list[float] | None = None, last_exchange_id: int = 0) -> None:
        self.run_id = run_id
        self.config = config
        self.storage = storage
        self.state = state
        self.version = version
        self.norm_history: list[float] = list(norm_history or [])  # robust merging: recent merged norms
        self.last_exchange_id = last_exchange_id  # the newest exchange folded into `state`
        self.model: TransformerLM = build_model(config.model, seed=config.seed)
        self.schema = param_schema(self.model)
        inner = config.inner
        self.adam_bound = robust.adam_bound(steps=inner.steps, lr=inner.lr,
                                            n_params=sum(p.numel() for p in self.model.parameters()))
        self._eval_tokens: torch.Tensor | None = None
        self.lock = threading.Lock()  # held while the state changes or is read (evaluation, snapshot, checkpoint)

    @classmethod
    def fresh(cls, *, run_id: int, config: RunConfig, storage: Storage) -> RunRuntime:
        params = get_params(build_model(config.model, seed=config.seed))
        return cls(run_id=run_id, config=config, storage=storage, state=OuterState.fresh(params), version=0)

    # -- snapshots and checkpoints -------------------------------------------------------------

    def write_snapshot(self) -> tuple[str, int]:
        """Write the current weights as version `self.version`; returns (sha256, size)."""
        blob = encode_snapshot(self.state.params, metadata={
            "run": self.config.name, "version": str(self.version),
            "model": json.dumps(self.config.model.to_dict())})
        self.storage.write(self.storage.snapshot(self.run_id, self.version), blob)
        return hashlib.sha256(blob).hexdigest(), len(blob)

    def write_checkpoint(self) -> Path:
        """Atomically write the state as checkpoints/<version>.ckpt; keep the newest few."""
        tensors = {k: v.contiguous() for k, v in self.state.tensors().items()}
        meta = {"version": str(self.version), "in_group": str(self.state.in_group),
                "norm_history": json.dumps(self.norm_history), "last_exchange_id": str(self.last_exchange_id),
                "config": self.config.model_dump_json()}
        raw = safetensors.torch.save(tensors, metadata=meta)
        digest = hashlib.sha256(raw).hexdigest()
        # The hash sits beside the data so a torn or corrupted file is detected on load.
        path = self.storage.checkpoint(self.run_id, self.version)
        self.storage.write(path, digest.encode() + b"\n" + raw)
        for _, old in self.storage.list_checkpoints(self.run_id)[self.CHECKPOINTS_KEPT:]:
            old.unlink(missing_ok=True)
        return path

    @classmethod
    def from_checkpoint(cls, *, run_id: int, config: RunConfig, storage: Storage,
                        max_version: int | None = None) -> RunRuntime | None:
        """The newest checkpoint that passes its hash and is not ahead of `max_version`; None if none."""
        for version, path in storage.list_checkpoints(run_id):
            if max_version is not None and version > max_version:
                log.warning("checkpoint %s is ahead of the recorded version %d; skipping it", path, max_version)
                continue
            try:
                rt = cls._load(path, run_id=run_id, config=config, storage=storage)
            except (OSError, ValueError, KeyError) as exc:
                log.error("checkpoint %s is unreadable (%s); trying an older one", path, exc)
                continue
            if rt is not None:
                return rt
        return None

    @classmethod
    def _load(cls, path: Path, *, run_id: int, config: RunConfig, storage: Storage) -> RunRuntime | None:
        blob = path.read_bytes()
        digest, _, raw = blob.partition(b"\n")
        if hashlib.sha256(raw).hexdigest().encode() != digest:
            log.error("checkpoint %s fails its hash; trying an older one", path)
            return None
        tensors = safetensors.torch.load(raw)
        header_len = int.from_bytes(raw[:8], "little")
        meta = json.loads(raw[8:8 + header_len])["__metadata__"]
        state = OuterState.from_tensors(tensors, in_group=int(meta["in_group"]))
        return cls(run_id=run_id, config=config, storage=storage, state=state, version=int(meta["version"]),
                   norm_history=json.loads(meta.get("norm_history", "[]")),
                   last_exchange_id=int(meta.get("last_exchange_id", "0")))

    # -- merging and evaluation ----------------------------------------------------------------

    def merge(self, *, seq: int, base_version: int, write_snapshot: bool = True) -> MergeOutcome:
        """Process the delta stored as `seq` (which must be version + 1) and write its snapshot.

        Replay on restart passes write_snapshot=False: those versions already have their snapshot
        files and recorded hashes (written before the version was committed), so rewriting them is
        wasted work; they would come out byte-identical (shared/snapshot.py encodes deterministically)."""
        if seq != self.version + 1:
            raise RuntimeError(f"merge order broken: next version is {self.version + 1}, got seq {seq}")
        staleness = self.version - base_version
        cfg = self.config.outer
        weight = staleness_weight(max(0, staleness), cfg)
        reason, merged, verdict = None, False, None
        if staleness < 0:
            reason = f"base version {base_version} is newer than the model ({self.version})"
        elif staleness > cfg.max_staleness:
            reason = f"{staleness} versions stale, above the limit of {cfg.max_staleness}"
        else:
            try:
                blob = self.storage.read(self.storage.delta(self.run_id, seq))
                delta = codec.decode(blob, schema=self.schema)
            except (OSError, DeltaFormatError) as exc:
                reason = f"stored delta unreadable: {exc}"
            else:
                if not delta.entries:  # a sparta round's end: changes nothing, not even the group count
                    merged = True
                else:
                    # the outer momentum is the recent consensus direction (all zeros before the first group)
                    verdict = robust.screen(delta, history=self.norm_history, reference=self.state.momentum,
                                            cfg=self.config.robust, bound=self.adam_bound)
                    reason, merged = verdict.reason, verdict.merged
                    if merged:
                        apply_delta(self.state, delta, weight=weight * verdict.scale, cfg=cfg)
                    robust.remember(self.norm_history, verdict, self.config.robust)
        self.version = seq
        sha, size = self.write_snapshot() if write_snapshot else ("", 0)
        return MergeOutcome(seq, merged, staleness, weight, reason, sha, size,
                            norm=verdict.norm if verdict else None, cosine=verdict.cosine if verdict else None,
                            clipped=bool(verdict and verdict.action == "clip"))

    def exchange(self, sent: codec.Delta, *, exchange_id: int | None = None) -> codec.Delta:
        """Fold one sparse exchange into the global model (caller holds `lock`); returns the correction.

        Replay passes the recorded exchange_id; live exchanges set it once their row is committed."""
        cfg = self.config.sparta
        correction = sparta.mix_into_centre(self.state.params, sent, alpha=cfg.alpha, values=cfg.values)
        if exchange_id is not None:
            self.last_exchange_id = exchange_id
        return correction

    def centre_at(self, sent: codec.Delta) -> dict[str, torch.Tensor]:
        """The centre's values at an exchange's indices (caller holds `lock`), for undo_exchange."""
        return {e.name: self.state.params[e.name].view(-1)[torch.from_numpy(e.indices)].clone()
                for e in sent.entries}

    def undo_exchange(self, sent: codec.Delta, before: dict[str, torch.Tensor]) -> None:
        """Put back what centre_at saved: an exchange refused after exchange() changes nothing."""
        for e in sent.entries:
            self.state.params[e.name].view(-1)[torch.from_numpy(e.indices)] = before[e.name]

    def eval_tokens(self) -> torch.Tensor:
        if self._eval_tokens is None:
            raw = np.fromfile(self.storage.eval_tokens(self.run_id), dtype=np.uint8)
            self._eval_tokens = torch.from_numpy(raw[: self.config.eval_tokens].copy())
        return self._eval_tokens

    def evaluate(self) -> float:
        set_params(self.model, self.state.params)
        return evaluate_loss(self.model, self.eval_tokens(), context=self.config.model.context)
