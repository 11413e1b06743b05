"""A run's live state in the coordinator's memory: the global model and the merge rule's state.

The merger thread mutates it, and so do sparse exchanges (sparta), always under `lock`. It is
rebuilt on start from the newest good checkpoint plus a replay, in their original order, of the
deltas processed and the exchanges answered after it, so nothing acknowledged is lost or doubled.

The merge rule's state is one flat vector per quantity (shared/algorithms/flat_outer.py FlatOuter:
deltas decode onto global indices, the momentum step is lazy from 4M parameters up); `state`
gives the plain per-tensor form. A checkpoint (coordinator/checkpoints.py) holds everything the
merge depends on, exactly as it is in memory: the flat weights and momentum with their scalars,
the group's pending deltas and count, the momentum steps done (the outer warm-up's place), the
version, the last exchange folded in, and the screen's state (robust.py: each worker's recent
delta and exchange norms, its merged count for the ramp, and the coordinator's own reference
round's norm, computed once per run by `calibrate`). Data position (shards done / leased /
pending) lives in the database, committed with each lease and delta. The coordinator draws no
random numbers: every seed it hands out is derived from the run's seed and a lease id, so there
is no RNG to save.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from coordinator.exchange_folding import ExchangeFolding
from coordinator.storage import Storage
from shared import codec
from shared.algorithms import robust, robust_stats
from shared.algorithms.inner import make_optimizer, pseudo_gradient, run_steps
from shared.algorithms.flat_outer import FlatOuter
from shared.algorithms.outer import OuterState, staleness_weight
from shared.config import RunConfig
from shared.data import tokens_from_bytes
from shared.errors import DeltaFormatError
from shared.model import TransformerLM, build_model, evaluate_loss, get_params, param_schema, set_params
from shared.snapshot import parts_sha256, run_snapshot_parts

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
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
    rejection: robust.Rejection | None = None  # why, when not merged: the metrics' label
    # what moved each weight per unit of its values (its full weight times its group's share of the
    # outer lr; 0 when it moved nothing): what a compensation takes back (FlatOuter.compensate)
    applied: float = 0.0


class RunRuntime(ExchangeFolding):
    # The lazy momentum step (FlatOuter): None = by model size (outer.LAZY_MIN_PARAMS and up); tests force it.
    lazy_momentum: bool | None = None

    def __init__(self, *, run_id: int, config: RunConfig, storage: Storage, state: OuterState | FlatOuter,
                 version: int, norm_history: list[float] | None = None, last_exchange_id: int = 0,
                 screen: dict | None = None) -> None:
        self.run_id = run_id
        self.config = config
        self.storage = storage
        self.version = version
        # Robust merging's state (shared/algorithms/robust.py), checkpointed so a replay decides alike:
        # recent merged delta norms and folded exchanges' ratios to their limits (exchange_screen.py), per
        # worker; merged rounds per worker (the ramp); the norm of the coordinator's own reference round
        # (None: not calibrated).
        # A checkpoint from before per-worker norms (`norm_history`) counts each old norm as its own worker.
        screen = screen or {}
        self.norms = robust.Norms.from_json(screen["deltas"]) if "deltas" in screen else \
            robust.Norms({f"#{i}": [float(x)] for i, x in enumerate(norm_history or [])})
        self.exchange_ratios = robust.Norms.from_json(screen.get("exchange_ratios", []))
        self.merged_by: dict[str, int] = {str(k): int(v) for k, v in screen.get("merged", {}).items()}
        # the workers of each shared voice's recent deltas (coordinator/voices.py), oldest first
        self.voices: dict[str, list[str]] = {str(k): [str(w) for w in v] for k, v in screen.get("voices", {}).items()}
        self.reference_norm: float | None = screen.get("reference")
        # The reference round's own pseudo-gradient, flat: the consensus direction until the outer
        # momentum has one (a random direction has cosine ~0 with it, an honest round a clearly positive
        # one), so a burst of deltas before any honest one cannot steer the model. Dropped, for good, at
        # the first delta whose support meets a non-zero momentum; checkpointed until then.
        self.reference_delta: torch.Tensor | None = None
        self.last_exchange_id = last_exchange_id  # the newest exchange folded into `state`
        self.model: TransformerLM = build_model(config.model, seed=config.seed)
        self.schema = param_schema(self.model)
        # The merge rule's state, flat and with its momentum step lazy (shared/algorithms/outer.py).
        self.outer = state if isinstance(state, FlatOuter) else FlatOuter.from_state(state, self.schema)
        if self.lazy_momentum is not None:
            self.outer.lazy = self.lazy_momentum
        if self.outer.shapes != {n: tuple(s) for n, s in self.schema.items()}:
            raise ValueError("the outer state's tensors do not match the run's model")
        inner = config.inner
        self.adam_bound = robust.adam_bound(steps=inner.steps, lr=inner.lr,
                                            n_params=sum(p.numel() for p in self.model.parameters()))
        comp = config.compression  # unsent values wait in the worker's residual only with error feedback
        fraction = comp.fraction if comp.index != "dense" and comp.error_feedback else 1.0
        self.element_bound = robust.element_bound(steps=inner.steps, lr=inner.lr, fraction=fraction)
        # and a delta can carry several rounds' norm: the reference bound scales (the idle and early checks don't)
        self.reference_scale = robust.reference_scale(fraction=fraction, feedback_decay=comp.feedback_decay,
                                                      random=comp.index == "random")
        self._eval_tokens: torch.Tensor | None = None
        # the descent guard's (exchange_screen.py): the coordinator's own training tokens (the reference
        # round's, set by calibrate) and (version, loss, flat gradient) of the published model on them
        self.guard_tokens: torch.Tensor | None = None
        self._descent: tuple[int, float, torch.Tensor] | None = None
        # True once a merge step moved these weights past what the database committed and failed (the
        # merger then reloads the run into a new object): exchanges must not fold into it meanwhile, or
        # they would be recorded after a version the database never reached
        self.ahead = False
        # True once the coordinator forgot this run (finished or deleted: LiveRuns.remove): a thread that
        # still holds this object must write nothing more of it (a deleted run's folder would come back)
        self.removed = False
        self.lock = threading.Lock()  # held while the state changes or is read (evaluation, snapshot, checkpoint)
        # the last snapshot this process wrote: its version (None: not known yet, ask the database),
        # how long it took and when it ended (time.monotonic()): see snapshot_allowed
        self.snapshot_version: int | None = None
        self.snapshot_cost_s = 0.0
        self.snapshot_done_at = -math.inf

    @property
    def norm_history(self) -> list[float]:
        """The recent merged norms, each worker's in turn (read-only: the screen keeps `norms`)."""
        return [x for v in self.norms.by_worker.values() for x in v]

    def screen_json(self) -> dict:
        """The screen's state as the checkpoint keeps it."""
        return {"deltas": self.norms.to_json(), "exchange_ratios": self.exchange_ratios.to_json(),
                "merged": self.merged_by, "reference": self.reference_norm, "voices": self.voices}

    def calibrate(self, tokens: torch.Tensor) -> float:
        """Train the coordinator's own reference round once per run: reference_steps AdamW steps of
        the run's initial model at the peak lr (no warm-up) on `tokens` (a training shard), batches
        drawn from the run's seed; its pseudo-gradient's norm, scaled up linearly to the round's H
        steps, is an upper bound of an honest round's (steps in a consistent direction add up
        linearly at most; measured honest dense rounds reach 0.92x it, sparse ones with error
        feedback carry more: robust.reference_scale) that no worker can shape. Kept in
        the checkpoint: computed once, the same after any restart."""
        inner = self.config.inner
        k = min(inner.steps, self.config.robust.reference_steps)
        model = build_model(self.config.model, seed=self.config.seed)
        base = get_params(model)
        opt = make_optimizer(model, inner)
        cfg = inner.model_copy(update={"warmup_steps": 0})
        self.guard_tokens = tokens
        run_steps(model, opt, tokens, cfg, lr=inner.lr, steps=k,
                  generator=torch.Generator().manual_seed(self.config.seed))
        pg = pseudo_gradient(base, get_params(model))
        norm = math.sqrt(sum(float(torch.sum(t.double() * t.double())) for t in pg.values()))
        self.reference_norm = norm * inner.steps / k
        flat = torch.zeros_like(self.outer.m)
        for name, off in self.outer.offsets.items():
            flat[off:off + pg[name].numel()] = pg[name].reshape(-1)
        self.reference_delta = flat
        return self.reference_norm

    @property
    def state(self) -> OuterState:
        """The merge rule's state in its plain form (a materialised copy: read it, don't write it)."""
        return self.outer.to_state()

    @state.setter
    def state(self, state: OuterState) -> None:
        self.outer = FlatOuter.from_state(state, self.schema)

    @classmethod
    def fresh(cls, *, run_id: int, config: RunConfig, storage: Storage) -> RunRuntime:
        params = get_params(build_model(config.model, seed=config.seed))
        return cls(run_id=run_id, config=config, storage=storage, state=OuterState.fresh(params), version=0)

    # -- snapshots and checkpoints -------------------------------------------------------------

    def write_snapshot(self) -> tuple[str, int]:
        """Write the published model (outer.published_flat) as version `self.version`; returns (sha256, size)."""
        t0 = time.monotonic()
        weights = self.outer.published_flat(self.config.outer)
        # in parts, never joined: a 460 MB join would hold the GIL (every request of this process waits)
        parts = run_snapshot_parts(weights, self.outer.shapes, run=self.config.name, version=self.version,
                                   model=self.config.model.to_dict())
        self.storage.write(self.storage.snapshot(self.run_id, self.version), parts)
        self.snapshot_done_at = time.monotonic()
        self.snapshot_cost_s, self.snapshot_version = self.snapshot_done_at - t0, self.version
        return parts_sha256(parts), sum(len(part) for part in parts)

    SNAPSHOT_FREE_S = 0.25  # snapshots quicker than this are never held back

    def snapshot_allowed(self, duty: float, now: float | None = None) -> bool:
        """Whether a snapshot may be written now and keep snapshots within `duty` of the merger's
        time: the last one's cost must be at most `duty` of the time from its start to now. A 124M
        model's snapshot takes seconds (encode and write ~0.5 GB); written every few versions under
        load it would take all the merger's time. Quick ones (small models) always may."""
        if self.snapshot_cost_s < self.SNAPSHOT_FREE_S:
            return True
        now = time.monotonic() if now is None else now
        # a microsecond's slack: `now - done_at` loses bits at a large monotonic clock, and the rule
        # must hold at its own boundary (cost exactly `duty` of the time) whatever the clock reads
        return now - self.snapshot_done_at >= self.snapshot_cost_s * (1.0 / duty - 1.0) - 1e-6

    # -- merging and evaluation ----------------------------------------------------------------

    def merge(self, *, seq: int, base_version: int, write_snapshot: bool = True,
              worker: int | None = None, voice: str | None = None) -> MergeOutcome:
        """Process the delta stored as `seq` (which must be version + 1) and write its snapshot.

        Replay on restart passes write_snapshot=False: those versions already have their snapshot
        files and recorded hashes (written before the version was committed), so rewriting them is
        wasted work; they would come out byte-identical (shared/snapshot.py encodes deterministically).
        worker: the id of the worker that sent it (its record sets the ramp and its norms count as
        its own); None: unknown, the delta counts as a worker of its own at full weight."""
        if seq != self.version + 1:
            raise RuntimeError(f"merge order broken: next version is {self.version + 1}, got seq {seq}")
        out = self._merge_one(seq, base_version, self._read_decode, worker, voice)
        return self._finish(out, write_snapshot)

    def merge_batch(self, items: Sequence[tuple[int, ...]], *,
                    write_snapshot: bool = True, prefetch: bool = False) -> list[MergeOutcome]:
        """Process several stored deltas in order: items = [(seq, base_version), ...], seqs consecutive
        from version + 1, or [(seq, base_version, worker id[, voice]), ...] (see merge). The same outcomes as
        calling merge() on each in turn (the same decisions and arithmetic), but only the last version
        gets a snapshot (write_snapshot=True) -- the others carry snapshot_sha256 "" and size 0, as
        merge(write_snapshot=False) does. prefetch: read and decode
        the next deltas on a helper thread meanwhile (off by default: on the 2-core reference machine
        it did not pay, docs/BENCHMARKS.md). The caller holds `lock`."""
        items = [(it[0], it[1], it[2] if len(it) > 2 else None, it[3] if len(it) > 3 else None) for it in items]
        for i, (seq, *_) in enumerate(items):
            if seq != self.version + 1 + i:
                raise RuntimeError(f"merge order broken: item {i} should be seq {self.version + 1 + i}, got {seq}")
        if not items:
            return []
        outcomes: list[MergeOutcome] = []
        if not prefetch:
            outcomes = [self._merge_one(seq, base, self._read_decode, worker, voice) for seq, base, worker, voice in items]
            outcomes[-1] = self._finish(outcomes[-1], write_snapshot)
            return outcomes
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="idletrain-decode") as pool:
            futures = {seq: pool.submit(self._read_decode, seq) for seq, *_ in items}
            for seq, base, worker, voice in items:
                outcomes.append(self._merge_one(seq, base, lambda s: futures[s].result(), worker, voice))
        outcomes[-1] = self._finish(outcomes[-1], write_snapshot)
        return outcomes

    def _read_decode(self, seq: int) -> codec.FlatDelta | Exception:
        """The stored delta `seq`, decoded onto the flat layout, or the error that stopped it."""
        try:
            blob = self.storage.read(self.storage.delta(self.run_id, seq))
            return codec.decode_flat(blob, schema=self.schema, offsets=self.outer.offsets)
        except (OSError, DeltaFormatError) as exc:
            return exc

    def _merge_one(self, seq: int, base_version: int, fetch, worker: int | None = None,
                   voice: str | None = None) -> MergeOutcome:
        staleness = self.version - base_version
        cfg = self.config.outer
        weight = staleness_weight(max(0, staleness), cfg)
        reason, merged, verdict, why, applied = None, False, None, None, 0.0
        if staleness < 0:
            reason = f"base version {base_version} is newer than the model ({self.version})"
            why = robust.Rejection.STALE
        elif staleness > cfg.max_staleness:
            reason = f"{staleness} versions stale, above the limit of {cfg.max_staleness}"
            why = robust.Rejection.STALE
        else:
            delta = fetch(seq)
            if isinstance(delta, Exception):
                reason, why = f"stored delta unreadable: {delta}", robust.Rejection.UNREADABLE
            elif delta.n_entries == 0:  # a sparta round's end: changes nothing, not even the group count
                merged = True
                if worker is not None:  # but it is a round of the worker's record (its exchanges' ramp and reach)
                    self.merged_by[str(worker)] = self.merged_by.get(str(worker), 0) + 1
            else:
                # the outer momentum is the recent consensus direction (all zeros before the first group);
                # the flat state keeps it as m = s M, and the cosine is the same against M
                norm, cosine, agreement = robust_stats.flat_delta_direction(delta, self.outer.m)
                if cosine is not None:  # the momentum speaks: the reference round's direction is done with
                    self.reference_delta = None
                elif self.reference_delta is not None:
                    norm, cosine, agreement = robust_stats.flat_delta_direction(delta, self.reference_delta)
                rcfg = self.config.robust
                # an unknown sender counts as a worker of its own, at full weight (unit tests, old rows); the
                # screen's record is its voice's (tokens of one address share one: coordinator/voices.py)
                key = f"#{seq}" if worker is None else str(worker)
                share = self._voice_share(voice, key)
                verdict = robust.decide(norm, cosine, history=self.norms, cfg=rcfg, bound=self.adam_bound,
                                        peak=robust_stats.flat_max_abs(delta), elements=self.element_bound,
                                        reference_norm=self.reference_norm, agreement=agreement,
                                        reference_scale=self.reference_scale)
                reason, merged, why = verdict.reason, verdict.merged, verdict.rejection
                if merged:
                    ramp = 1.0 if worker is None else robust.ramp_weight(self.merged_by.get(key, 0), rcfg)
                    full = weight * verdict.scale * ramp * share
                    applied = full * self.outer.open_share(cfg)
                    self.outer.apply(delta, weight=full, cfg=cfg)
                    if worker is not None:
                        self.merged_by[key] = self.merged_by.get(key, 0) + 1
                robust.remember(self.norms, verdict, rcfg, worker=voice or key)
        self.version = seq
        return MergeOutcome(seq, merged, staleness, weight, reason, "", 0,
                            norm=verdict.norm if verdict else None, cosine=verdict.cosine if verdict else None,
                            clipped=bool(verdict and verdict.action == "clip"), rejection=why, applied=applied)

    def compensate(self, seq: int, applied: float) -> None:
        """Take back merged delta `seq` (FlatOuter.compensate), found false after it merged (a failed
        spot-check), from its kept bytes (Storage.compensation; FileNotFoundError when they are gone):
        before the merge of the next version, so that the replay on a restart does the same at the
        same place (coordinator/queries/compensations.py). The caller holds `lock`."""
        blob = self.storage.read(self.storage.compensation(self.run_id, seq))
        delta = codec.decode_flat(blob, schema=self.schema, offsets=self.outer.offsets)
        self.outer.compensate(delta, applied=applied, cfg=self.config.outer)
        log.info("run %s: delta %d compensated before version %d (it had moved the weights by %.3g x its values)",
                 self.config.name, seq, self.version + 1, applied)

    VOICE_MEMBERS = 64  # a voice's recent deltas whose senders count as its members

    def _voice_share(self, voice: str | None, worker: str) -> float:
        """The share of a full merge weight a delta of `worker` speaking in `voice` gets: 1 in its own
        voice, else 1 / the distinct workers among that voice's recent deltas (this one's included), so
        that tokens of one address together weigh as one worker."""
        if voice is None:
            return 1.0
        members = self.voices.setdefault(voice, [])
        members.append(worker)
        del members[:-self.VOICE_MEMBERS]
        return 1.0 / len(set(members))

    def _finish(self, out: MergeOutcome, write_snapshot: bool) -> MergeOutcome:
        if not write_snapshot:
            return out
        sha, size = self.write_snapshot()
        return dataclasses.replace(out, snapshot_sha256=sha, snapshot_size=size)

    def eval_tokens(self) -> torch.Tensor:
        if self._eval_tokens is None:
            raw = self.storage.read(self.storage.eval_tokens(self.run_id))
            width = np.dtype(self.config.tokens.dtype).itemsize
            self._eval_tokens = tokens_from_bytes(raw[: self.config.eval_tokens * width], self.config.tokens.dtype)
        return self._eval_tokens

    def evaluate(self) -> float:
        set_params(self.model, self.outer.views(self.outer.published_flat(self.config.outer)))
        return evaluate_loss(self.model, self.eval_tokens(), context=self.config.model.context)
