"""A run's live state to and from its checkpoint blobs (`checkpoints/<version>.ckpt`, newest few kept).

A checkpoint is one line with the sha256 of the rest, then a safetensors file: the merge rule's flat
state exactly as it is in memory (FlatOuter.checkpoint, not materialised, so a restart continues bit
for bit), the reference round's direction while it is kept, and in its metadata the version, the
screen's state, the last exchange folded in, the merge rule's counters (deltas in the open group,
momentum steps done: the outer warm-up's position) and the run's config. Checkpoints written before
the flat form (plain per-tensor tensors) and before per-worker norms (`norm_history`) still load; one
written before the momentum-step counter (`groups`) counts version // group steps done: at least as
many as were, since a version counts every delta judged (merged, rejected or empty) and a step
takes `group` merged ones, so a warm-up set on such a run errs toward done.
"""

from __future__ import annotations

import hashlib
import json
import logging

import safetensors.torch

from coordinator.runtime import RunRuntime
from coordinator.storage import Storage
from shared.algorithms.flat_outer import FlatOuter
from shared.algorithms.outer import OuterState
from shared.config import RunConfig
from shared.snapshot import parts_sha256, safetensors_parts

log = logging.getLogger(__name__)

KEPT = 3  # a torn or corrupt newest one falls back to the one before


def write(rt: RunRuntime) -> str:
    """Atomically write `rt`'s state as its version's checkpoint; keep the newest KEPT. Returns its name.
    The caller holds `rt.lock` when anything else may change the state meanwhile."""
    tensors, outer_meta = rt.outer.checkpoint()
    if rt.reference_delta is not None:
        tensors["screen/reference"] = rt.reference_delta
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    meta = {"version": str(rt.version), "in_group": str(rt.outer.in_group), "groups": str(rt.outer.groups),
            "screen": json.dumps(rt.screen_json()), "last_exchange_id": str(rt.last_exchange_id),
            "config": rt.config.model_dump_json(), **outer_meta}
    # The file in parts straight from the tensors' memory: nothing copied, so the GIL is not held
    # for seconds (safetensors.torch.save and a join would: every request of this process waits).
    parts = safetensors_parts(tensors, meta)
    # The hash sits beside the data so a torn or corrupted file is detected on load.
    name = rt.storage.checkpoint(rt.run_id, rt.version)
    rt.storage.write(name, [parts_sha256(parts).encode() + b"\n", *parts])
    for _, old in rt.storage.list_checkpoints(rt.run_id)[KEPT:]:
        rt.storage.delete(old)
    return name


def load_newest(*, run_id: int, config: RunConfig, storage: Storage,
                max_version: int | None = None) -> RunRuntime | None:
    """The newest checkpoint that passes its hash and is not ahead of `max_version`; None if none."""
    for version, name in storage.list_checkpoints(run_id):
        if max_version is not None and version > max_version:
            log.warning("checkpoint %s is ahead of the recorded version %d; skipping it", name, max_version)
            continue
        try:
            rt = _load(name, run_id=run_id, config=config, storage=storage)
        except (OSError, ValueError, KeyError) as exc:
            log.error("checkpoint %s is unreadable (%s); trying an older one", name, exc)
            continue
        if rt is not None:
            return rt
    return None


def _load(name: str, *, run_id: int, config: RunConfig, storage: Storage) -> RunRuntime | None:
    blob = storage.read(name)
    digest, _, raw = blob.partition(b"\n")
    if hashlib.sha256(raw).hexdigest().encode() != digest:
        log.error("checkpoint %s fails its hash; trying an older one", name)
        return None
    tensors = safetensors.torch.load(raw)
    header_len = int.from_bytes(raw[:8], "little")
    meta = json.loads(raw[8:8 + header_len])["__metadata__"]
    counters = {"in_group": int(meta["in_group"]),
                "groups": int(meta["groups"]) if "groups" in meta else int(meta["version"]) // config.outer.group}
    if meta.get("outer_form") == "flat1":
        state: OuterState | FlatOuter = FlatOuter.from_checkpoint(tensors, meta, **counters)
    else:  # written before the flat form: the plain tensors, converted on load
        state = OuterState.from_tensors(tensors, **counters)
    rt = RunRuntime(run_id=run_id, config=config, storage=storage, state=state, version=int(meta["version"]),
                    norm_history=json.loads(meta.get("norm_history", "[]")),
                    last_exchange_id=int(meta.get("last_exchange_id", "0")),
                    screen=json.loads(meta["screen"]) if "screen" in meta else None)
    rt.reference_delta = tensors.get("screen/reference")
    return rt
