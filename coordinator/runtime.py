"""A run's live state in the coordinator's memory: the global model and the merge rule's state.

The merger thread mutates it, and so do sparse exchanges (sparta), always under `lock`. It is
rebuilt on start from the latest good checkpoint plus a replay of the deltas processed after it,
so an acknowledged delta is never lost or doubled. Exchanges are not replayed: those made after
the last checkpoint are lost in a crash (see Coordinator.exchange).
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from dataclasses import dataclass

import numpy as np
import safetensors.torch
import torch

from coordinator.storage import Storage
from shared import codec
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


class RunRuntime:
    def __init__(self, *, run_id: int, config: RunConfig, storage: Storage, state: OuterState, version: int) -> None:
        self.run_id = run_id
        self.config = config
        self.storage = storage
        self.state = state
        self.version = version
        self.model: TransformerLM = build_model(config.model, seed=config.seed)
        self.schema = param_schema(self.model)
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

    def write_checkpoint(self) -> None:
        tensors = {k: v.contiguous() for k, v in self.state.tensors().items()}
        meta = {"version": str(self.version), "in_group": str(self.state.in_group),
                "config": self.config.model_dump_json()}
        raw = safetensors.torch.save(tensors, metadata=meta)
        digest = hashlib.sha256(raw).hexdigest()
        # The hash sits beside the data so a torn or corrupted file is detected on load.
        self.storage.write(self.storage.checkpoint(self.run_id), digest.encode() + b"\n" + raw)

    @classmethod
    def from_checkpoint(cls, *, run_id: int, config: RunConfig, storage: Storage) -> RunRuntime | None:
        path = storage.checkpoint(run_id)
        if not path.exists():
            return None
        blob = path.read_bytes()
        digest, _, raw = blob.partition(b"\n")
        if hashlib.sha256(raw).hexdigest().encode() != digest:
            log.error("checkpoint %s fails its hash; ignoring it", path)
            return None
        tensors = safetensors.torch.load(raw)
        header_len = int.from_bytes(raw[:8], "little")
        meta = json.loads(raw[8:8 + header_len])["__metadata__"]
        state = OuterState.from_tensors(tensors, in_group=int(meta["in_group"]))
        return cls(run_id=run_id, config=config, storage=storage, state=state, version=int(meta["version"]))

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
        reason = None
        if staleness < 0:
            reason = f"base version {base_version} is newer than the model ({self.version})"
        elif staleness > cfg.max_staleness:
            reason = f"{staleness} versions stale, above the limit of {cfg.max_staleness}"
        if reason is None:
            try:
                blob = self.storage.read(self.storage.delta(self.run_id, seq))
                delta = codec.decode(blob, schema=self.schema)
                if delta.entries:  # an empty delta (a sparta round's end) changes nothing, not even the group count
                    apply_delta(self.state, delta, weight=weight, cfg=cfg)
            except (OSError, DeltaFormatError) as exc:
                reason = f"stored delta unreadable: {exc}"
        self.version = seq
        sha, size = self.write_snapshot() if write_snapshot else ("", 0)
        return MergeOutcome(seq, reason is None, staleness, weight, reason, sha, size)

    def eval_tokens(self) -> torch.Tensor:
        if self._eval_tokens is None:
            raw = np.fromfile(self.storage.eval_tokens(self.run_id), dtype=np.uint8)
            self._eval_tokens = torch.from_numpy(raw[: self.config.eval_tokens].copy())
        return self._eval_tokens

    def evaluate(self) -> float:
        set_params(self.model, self.state.params)
        return evaluate_loss(self.model, self.eval_tokens(), context=self.config.model.context)
