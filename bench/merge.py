"""`idletrain bench merge`: deltas merged per second, stage by stage, against a bound measured alongside.

One process, one run, so every ratio compares numbers taken side by side on the same machine:

    (a) the bound: a bare `flat.index_add_(0, idx, vals)` of the delta's size (k = p * n random
        indices into one n-element fp32 tensor), the median of many
    (b) codec.decode of a stored delta (split into zstd, indices, int8 values)
    (c) robust.screen against the outer momentum
    (d) outer.apply_delta without the momentum step (group too large to reach it)
    (e) the momentum step (a dense pass over weights, momentum and accumulator), amortised over
        a group of 1, 4 (the default), 8 and 64 deltas
    (b2)-(d2) the same pieces on the coordinator's flat path: codec.decode_flat, robust's
        flat_delta_stats + decide, and FlatOuter.apply with the run's own group and momentum (its
        lazy momentum steps and folds included, amortised over the deltas)
    (f) the coordinator's own path: coordinator/runtime.py RunRuntime.merge over the deltas
        stored in a data dir as the coordinator stores them, with write_snapshot=False (the replay
        path) and, for a few deltas, write_snapshot=True (the live path: a snapshot per merge);
        RunRuntime.merge_batch over the same deltas in batches, with and without decoding ahead
    (g) coordinator/merger.py Merger.step with its database transaction on SQLite (a small model
        by default), to show what each merge's bookkeeping costs

(b2) and the replay path of (f) are also timed without the compiled kernels (shared/kernels.py,
as IDLETRAIN_NUMBA=0 runs), interleaved with the rows that use them, so their gain is side by side.

Deltas are real: values pass through the int8 codec and the envelope, index kind "random" (seeded:
only a seed travels; built by shared/algorithms/compress.py) and "topk" (packed indices; uniformly
random index sets, which is what top-k of an i.i.d. pseudo-gradient selects, built without a
torch.topk over every tensor per delta). Writes results.json, results.md and stages.png.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from shared import codec, kernels
from shared.algorithms import robust
from shared.algorithms.compress import compress, k_for, quantised, tensor_seed
from shared.algorithms.outer import FlatOuter, OuterState, _momentum_step, apply_delta
from shared.codec import Delta, Entry, IndexKind, ValueKind, seeded_indices
from shared.codec.envelope import HEADER, _decompress
from shared.codec.indices import INDEX_CODECS
from shared.codec.values import VALUE_CODECS
from shared.config import CompressionConfig, OuterConfig, RobustConfig, RunConfig
from shared.model import ModelConfig, build_model, get_params, param_schema

log = logging.getLogger(__name__)

PARAM_MODELS = {
    "gpt2-124m": ModelConfig(vocab_size=50257, n_layer=12, n_head=12, d_model=768, context=1024),  # 124,439,808
    "small": ModelConfig(),  # the default run model, 644,224 params
    "tiny": ModelConfig(n_layer=1, n_head=2, d_model=16, context=16),  # tests
}
INDEX_KINDS = ("random", "topk")
GOAL_MERGES_PER_S = 500.0
GOAL_X_BOUND = 3.0
GROUPS = (1, 4, 8, 64)
NO_MOMENTUM = OuterConfig(group=100_000)  # apply_delta never reaches its momentum step
BATCH = 16  # deltas per RunRuntime.merge_batch call
DELTA_SCALE = 1e-2  # std of the synthetic pseudo-gradient: far inside robust merging's bounds


def _kernel_note() -> str:
    return "" if kernels.ready() else " (compiled kernels unavailable: numpy/torch paths)"


# -- timing ------------------------------------------------------------------------------------

def time_calls(fn: Callable[[], object], reps: int) -> list[float]:
    """Seconds per call, `reps` calls."""
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def time_each(fn: Callable[[object], object], items: Sequence) -> list[float]:
    out = []
    for item in items:
        t0 = time.perf_counter()
        fn(item)
        out.append(time.perf_counter() - t0)
    return out


def _sig(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else float(f"{x:.{digits}g}")


@dataclasses.dataclass
class Stage:
    stage: str
    index: str  # random | topk | - (the same for both)
    times_s: list[float]  # one per call
    per: int = 1  # deltas sharing one call (the momentum step: one per group)
    note: str = ""
    versus_bound: bool = True  # False: another model than the bound's (the database stage)
    central: str = "mean"  # what "ms per delta" is: the mean (throughput) or, for the bound, the median

    def row(self, bound_ms: float) -> dict:
        central = statistics.fmean if self.central == "mean" else statistics.median
        mean = 1000 * central(self.times_s) / self.per
        p50 = 1000 * statistics.median(self.times_s) / self.per
        return {"stage": self.stage, "index": self.index, "ms_per_delta": _sig(mean), "p50_ms": _sig(p50),
                "merges_per_s": _sig(1000 / mean), "x_bound": _sig(mean / bound_ms) if self.versus_bound else None,
                "calls": len(self.times_s), "note": self.note}


class _Timed:
    """Wrap an instance's method (an instance attribute shadows the class's) and time its calls."""

    def __init__(self, obj: object, name: str) -> None:
        self.times: list[float] = []
        inner = getattr(obj, name)

        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.times.append(time.perf_counter() - t0)

        setattr(obj, name, wrapper)

    def take(self) -> list[float]:
        out, self.times = self.times, []
        return out


# -- deltas ------------------------------------------------------------------------------------

def pseudo_gradient(params: dict[str, torch.Tensor], *, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(p.shape, generator=g) * DELTA_SCALE for n, p in params.items()}


def make_delta(pg: dict[str, torch.Tensor], *, kind: str, fraction: float, base_version: int,
               round_seed: int) -> Delta:
    """One delta as a worker sends it (after the int8 value codec), at `fraction` of each tensor."""
    if kind == "random":  # the worker's own compression: seeded indices, only the seed travels
        cfg = CompressionConfig(index="random", fraction=fraction, values="int8", error_feedback=False)
        return quantised(compress(pg, cfg, base_version=base_version, round_seed=round_seed))
    if kind != "topk":
        raise ValueError(f"unknown index kind {kind!r}: pick one of {INDEX_KINDS}")
    entries = []
    for name, t in pg.items():
        flat = t.reshape(-1).numpy()
        k = k_for(flat.size, fraction)
        idx = seeded_indices(tensor_seed(round_seed, "topk:" + name), flat.size, k)  # sorted, distinct
        entries.append(Entry(name, flat.size, IndexKind.PACKED, ValueKind.INT8, flat[idx], idx))
    return quantised(Delta(base_version=base_version, entries=tuple(entries)))


def delta_k(delta: Delta) -> int:
    return sum(e.k for e in delta.entries)


# -- stages ------------------------------------------------------------------------------------

class BoundProbe:
    """The bound: a bare index_add_ of k sorted distinct random indices into one n-element fp32
    tensor (and numpy's a[idx] += v beside it). Measured in bursts spread over the run, so that
    other load on a shared machine weighs on the bound as it weighs on the stages."""

    def __init__(self, n: int, k: int, *, seed: int) -> None:
        self.flat = torch.empty(n, dtype=torch.float32)
        self.flat.fill_(0.5)  # every page mapped before timing
        self.idx = torch.from_numpy(seeded_indices(seed, n, k))
        self.vals = torch.randn(k, generator=torch.Generator().manual_seed(seed))
        self.flat.index_add_(0, self.idx, self.vals)  # warm-up
        self.index_add: list[float] = []
        self.numpy: list[float] = []
        self.bursts: list[float] = []  # the median of each burst, ms

    def burst(self, reps: int) -> None:
        t = time_calls(lambda: self.flat.index_add_(0, self.idx, self.vals), reps)
        a, ni, nv = self.flat.numpy(), self.idx.numpy(), self.vals.numpy()

        def np_add() -> None:
            a[ni] += nv

        self.numpy += time_calls(np_add, reps)
        self.index_add += t
        self.bursts.append(1000 * statistics.median(t))


def decode_breakdown(blobs: Sequence[bytes], decoded: Sequence[Delta], *, kind: str
                     ) -> tuple[list[float], list[float], list[float]]:
    """Per delta: (zstd decompression, index decoding, value decoding) seconds."""
    zstd_t, idx_t, val_t = [], [], []
    for blob, d in zip(blobs, decoded):
        declared = HEADER.unpack_from(blob)[2]
        frame = memoryview(blob)[HEADER.size:]
        zstd_t += time_calls(lambda: _decompress(frame, declared), 1)
        if kind == "random":
            idx_t += time_calls(lambda: [seeded_indices(e.seed, e.numel, e.k) for e in d.entries], 1)
        else:
            packed = INDEX_CODECS[IndexKind.PACKED]
            sections = [(memoryview(packed.encode(e.indices, numel=e.numel, seed=None)), e) for e in d.entries]
            idx_t += time_calls(lambda: [packed.decode(s, numel=e.numel, k=e.k) for s, e in sections], 1)
        int8 = VALUE_CODECS[ValueKind.INT8]
        vsections = [(memoryview(int8.encode(e.values)), e.k) for e in d.entries]
        val_t += time_calls(lambda: [int8.decode(s, k) for s, k in vsections], 1)
    return zstd_t, idx_t, val_t


def measure_merger(mcfg: ModelConfig, *, n: int, fraction: float, root: Path, seed: int) -> dict[str, list[float]]:
    """Merger.step on a SQLite coordinator: lease, upload and merge `n` deltas one after another,
    timing each step and, inside it, RunRuntime.merge and its snapshot. Evaluation and
    checkpoints are turned off (they are periodic, not per merge)."""
    from coordinator.merger import Merger
    from coordinator.service import Coordinator
    from coordinator.settings import CoordinatorSettings
    from shared import protocol

    rng = np.random.default_rng(seed)
    words = np.array("the coordinator merges each delta in order while volunteers train".split())
    corpus = root / "corpus.txt"
    corpus.write_text(" ".join(rng.choice(words, 12_000)))
    settings = CoordinatorSettings(data_dir=root / "data", lease_rate=0, upload_rate=0, register_rate=0,
                                   checkpoint_every=10**9, corpus_dirs=[root])  # corpus.txt's folder
    cfg = RunConfig(name="merge-bench", model=mcfg, corpus=str(corpus), corpus_max_bytes=1 << 16,
                    shard_tokens=1024, eval_every=10**9, eval_tokens=1024, seed=seed,
                    compression=CompressionConfig(index="random", fraction=fraction, values="int8"))
    coord = Coordinator(settings)
    try:
        coord.create_run(cfg)
        worker = coord.authenticate(coord.register_worker(cfg.name, protocol.RegisterRequest(name="bench")).token)
        rt = coord.runtime_list()[0]
        merges, snapshots = _Timed(rt, "merge_batch"), _Timed(rt, "write_snapshot")
        merger = Merger(coord)
        pg = pseudo_gradient(rt.state.params, seed=seed + 1)
        steps: list[float] = []
        for i in range(n):
            lease = coord.grant_lease(cfg.name, worker)
            if lease is None:
                raise RuntimeError("the benchmark's run handed out no lease")
            # the lease's own seed: the coordinator takes random indices only where the lease's seed draws them
            body = codec.encode(make_delta(pg, kind="random", fraction=fraction, base_version=lease.base_version,
                                           round_seed=lease.seed))
            coord.accept_delta(lease.lease_id, worker, body)
            t0 = time.perf_counter()
            if not merger.step(rt):
                raise RuntimeError("Merger.step found nothing to merge")
            steps.append(time.perf_counter() - t0)
        merge_t, snap_t = merges.take(), snapshots.take()
        # The coordinator under load: Merger.BATCH deltas queued, merged by one step (one hold of the
        # lock, one transaction, one snapshot at the end); seconds per delta. A batch ends where a
        # snapshot is due, so this part runs with a snapshot every BATCH versions (the default, 1,
        # writes one per version: no batch).
        coord.settings = coord.settings.model_copy(update={"snapshot_every": Merger.BATCH})
        while rt.version % Merger.BATCH:  # line the batches up with the snapshot interval
            lease = coord.grant_lease(cfg.name, worker)
            coord.accept_delta(lease.lease_id, worker, codec.encode(make_delta(
                pg, kind="random", fraction=fraction, base_version=lease.base_version, round_seed=lease.seed)))
            merger.step(rt)
        batched: list[float] = []
        for b in range(max(1, n // Merger.BATCH)):
            for i in range(Merger.BATCH):
                lease = coord.grant_lease(cfg.name, worker)
                body = codec.encode(make_delta(pg, kind="random", fraction=fraction, base_version=lease.base_version,
                                               round_seed=lease.seed))
                coord.accept_delta(lease.lease_id, worker, body)
            t0 = time.perf_counter()
            done = merger.step(rt)
            if done != Merger.BATCH:
                raise RuntimeError(f"Merger.step merged {done} of {Merger.BATCH} queued deltas")
            batched += [(time.perf_counter() - t0) / done] * done
        return {"step": steps, "merge": merge_t, "snapshot": snap_t,
                "merge_core": [m - s for m, s in zip(merge_t, snap_t)],
                "db": [st - m for st, m in zip(steps, merge_t)], "batched": batched}
    finally:
        coord.close()


# -- the run -----------------------------------------------------------------------------------

def run(*, params_model: str | ModelConfig = "gpt2-124m", fraction: float = 0.001, deltas: int = 200,
        threads: int | None = 1, out: Path = Path("bench-results/merge"), index_kinds: Sequence[str] = INDEX_KINDS,
        snapshot_merges: int = 3, db_model: str | ModelConfig | None = "small", db_deltas: int = 50,
        bound_reps: int = 200, momentum_reps: int = 3, seed: int = 0) -> dict:
    """Run every stage; write results.json, results.md and stages.png under `out`; return the results."""
    mcfg = PARAM_MODELS[params_model] if isinstance(params_model, str) else params_model
    model_name = params_model if isinstance(params_model, str) else "custom"
    for kind in index_kinds:
        if kind not in INDEX_KINDS:
            raise ValueError(f"unknown index kind {kind!r}: pick from {INDEX_KINDS}")
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    if deltas < 1:
        raise ValueError("deltas must be at least 1")
    threads_before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return _run(mcfg, model_name=model_name, fraction=fraction, n=deltas, out=Path(out),
                    index_kinds=tuple(index_kinds), snapshot_merges=snapshot_merges, db_model=db_model,
                    db_deltas=db_deltas, bound_reps=bound_reps, momentum_reps=momentum_reps, seed=seed)
    finally:
        torch.set_num_threads(threads_before)


def _run(mcfg: ModelConfig, *, model_name: str, fraction: float, n: int, out: Path, index_kinds: tuple[str, ...],
         snapshot_merges: int, db_model: str | ModelConfig | None, db_deltas: int, bound_reps: int,
         momentum_reps: int, seed: int) -> dict:
    t_start = time.perf_counter()
    load_start = [round(x, 2) for x in os.getloadavg()]
    run_cfg = RunConfig(name="merge-bench", model=mcfg, seed=seed)
    log.info("building the %s model (%s params)", model_name, f"{mcfg.n_params():,}")
    model = build_model(mcfg, seed=seed)
    params, schema = get_params(model), param_schema(model)
    del model
    n_params = sum(p.numel() for p in params.values())

    # Deltas: N per index kind, encoded as they travel; stored below as the coordinator stores them.
    t0 = time.perf_counter()
    pg = pseudo_gradient(params, seed=seed + 1)
    blobs = {kind: [codec.encode(make_delta(pg, kind=kind, fraction=fraction, base_version=j * n + i,
                                            round_seed=seed + 10_000 * j + i)) for i in range(n)]
             for j, kind in enumerate(index_kinds)}
    del pg
    log.info("built %d deltas in %.1f s", n * len(index_kinds), time.perf_counter() - t0)
    k = delta_k(codec.decode(blobs[index_kinds[0]][0], schema=schema))

    # (a) the bound, in four bursts: now, after (d), after (e), after (f)
    probe = BoundProbe(n_params, k, seed=seed + 7)
    burst = max(1, bound_reps // 4)
    probe.burst(burst)
    log.info("bound: index_add_ of %d into %d: %.3f ms (median of %d)", k, n_params, probe.bursts[-1], burst)
    meta_kinds: dict[str, dict] = {}
    stages = in_memory_stages(params, schema, blobs, run_cfg=run_cfg, probe=probe, burst=burst,
                              momentum_reps=momentum_reps, meta_kinds=meta_kinds)
    probe.burst(burst)
    log.info("in-memory stages done at %.0f s", time.perf_counter() - t_start)
    rt_stages, store_t = runtime_stages(params, blobs, run_cfg=run_cfg, snapshot_merges=snapshot_merges,
                                        meta_kinds=meta_kinds)
    stages += rt_stages
    del params
    probe.burst(burst)
    log.info("RunRuntime stages done at %.0f s", time.perf_counter() - t_start)
    bound_ms = 1000 * statistics.median(probe.index_add)
    stages[:0] = [Stage("(a) bound: bare index_add_ of k random into n fp32", "-", probe.index_add, central="median",
                        note=f"k = {k:,}, n = {n_params:,}; median of {len(probe.index_add)} calls in 4 bursts "
                             f"over the run (burst medians {', '.join(f'{b:.3g}' for b in probe.bursts)} ms)"),
                  Stage("reference: numpy a[idx] += v, same k and n", "-", probe.numpy, central="median",
                        note="another kernel for the same scatter (median)")]
    bound_bursts = probe.bursts
    del probe

    # (g) Merger.step with its database transaction, on SQLite
    db_name = None
    if db_model is not None and db_deltas > 0:
        dcfg = PARAM_MODELS[db_model] if isinstance(db_model, str) else db_model
        db_name = db_model if isinstance(db_model, str) else "custom"
        stages += merger_stages(dcfg, name=db_name, n=db_deltas, fraction=fraction, seed=seed)

    rows = [s.row(bound_ms) for s in stages]
    replay = {r["index"]: r for r in rows if r["stage"].startswith("(f) RunRuntime.merge, replay (")}
    # merge_batch as the coordinator would call it: its default, no helper thread
    batch = {r["index"]: r for r in rows
             if r["stage"].startswith("(f) RunRuntime.merge_batch") and r["stage"].endswith("no helper thread")}
    live = next((r for r in rows if r["stage"].startswith("(f) RunRuntime.merge, live")), None)
    goal = {"target_merges_per_s": GOAL_MERGES_PER_S, "target_x_bound": GOAL_X_BOUND, "bound_ms": _sig(bound_ms),
            "per_index": {kind: {"merges_per_s": r["merges_per_s"], "x_bound": r["x_bound"],
                                 "met": bool(r["merges_per_s"] >= GOAL_MERGES_PER_S and r["x_bound"] <= GOAL_X_BOUND)}
                          for kind, r in replay.items()},
            "batch_per_index": {kind: {"stage": r["stage"], "merges_per_s": r["merges_per_s"], "x_bound": r["x_bound"],
                                       "met": bool(r["merges_per_s"] >= GOAL_MERGES_PER_S
                                                   and r["x_bound"] <= GOAL_X_BOUND)}
                                for kind, r in batch.items()},
            "live_merges_per_s": live["merges_per_s"] if live else None}
    goal["met"] = bool(goal["per_index"]) and all(v["met"] for v in goal["per_index"].values())
    meta = {"model": model_name, "model_config": mcfg.to_dict(), "n_params": n_params, "fraction": fraction,
            "k": k, "deltas_per_index": n, "index_kinds": list(index_kinds), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "cpus": os.cpu_count(), "outer_group": run_cfg.outer.group,
            "snapshot_merges": snapshot_merges, "db_model": db_name, "db_deltas": db_deltas if db_name else 0,
            "delta_store_ms_mean": _sig(1000 * statistics.fmean(store_t)) if store_t else None,
            "per_index": meta_kinds, "date": datetime.date.today().isoformat(),
            "bound_burst_medians_ms": [_sig(b) for b in bound_bursts], "load_average_start": load_start,
            "load_average_end": [round(x, 2) for x in os.getloadavg()],
            "THP_MEM_ALLOC_ENABLE": os.environ.get("THP_MEM_ALLOC_ENABLE"),
            "total_wall_s": round(time.perf_counter() - t_start, 1)}
    result = {"meta": meta, "goal": goal, "rows": rows}
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "results.md").write_text(markdown(result) + "\n")
    plot(result, out / "stages.png")
    return result


def in_memory_stages(params: dict[str, torch.Tensor], schema: dict[str, tuple[int, ...]],
                     blobs: dict[str, list[bytes]], *, run_cfg: RunConfig, probe: BoundProbe, burst: int,
                     momentum_reps: int, meta_kinds: dict[str, dict]) -> list[Stage]:
    """(b) decode, (c) screen, (d) apply without momentum, per index kind; then (e) the momentum step."""
    stages: list[Stage] = []
    state = OuterState.fresh(params)
    g = torch.Generator().manual_seed(12345)
    for m in state.momentum.values():  # mid-run: a dense, non-zero consensus direction to screen against
        m.copy_(torch.randn(m.shape, generator=g) * DELTA_SCALE)
    rcfg = RobustConfig()
    n_params = sum(p.numel() for p in params.values())
    adam = robust.adam_bound(steps=run_cfg.inner.steps, lr=run_cfg.inner.lr, n_params=n_params)
    for kind, kind_blobs in blobs.items():
        dec: list[Delta] = []
        t_dec = time_each(lambda b: dec.append(codec.decode(b, schema=schema)), kind_blobs)
        stages.append(Stage("(b) codec.decode", kind, t_dec))
        sub = min(len(kind_blobs), 20)
        zstd_t, idx_t, val_t = decode_breakdown(kind_blobs[:sub], dec[:sub], kind=kind)
        stages.append(Stage("(b) of which zstd (two bounded passes)", kind, zstd_t, note=f"first {sub} deltas"))
        stages.append(Stage("(b) of which indices " + ("(seeded: regenerate)" if kind == "random"
                                                       else "(packed: unpack bits)"), kind, idx_t,
                            note=f"first {sub} deltas"))
        stages.append(Stage("(b) of which int8 values", kind, val_t, note=f"first {sub} deltas"))
        history = [robust.delta_stats(d, None)[0] for d in dec[: rcfg.window]]
        verdicts: list[robust.Verdict] = []
        t_screen = time_each(lambda d: verdicts.append(robust.screen(d, history=history, reference=state.momentum,
                                                                     cfg=rcfg, bound=adam)), dec)
        stages.append(Stage("(c) robust.screen", kind, t_screen,
                            note=f"against a dense momentum; {sum(v.merged for v in verdicts)}/{len(verdicts)} pass"))
        t_apply = time_each(lambda d: apply_delta(state, d, weight=1.0, cfg=NO_MOMENTUM), dec)
        stages.append(Stage("(d) outer.apply_delta, no momentum step", kind, t_apply,
                            note="two index_add_ per tensor (weights, accumulator)"))
        meta_kinds[kind] = {"delta_bytes_mean": int(statistics.fmean(len(b) for b in kind_blobs)),
                            "entries": len(dec[0].entries), "k": delta_k(dec[0])}
        dec.clear()
        stages += flat_stages(state, schema, kind, kind_blobs, run_cfg=run_cfg, adam=adam, rcfg=rcfg)
    probe.burst(burst)
    # (e) the momentum step: dense over weights, momentum and accumulator
    t_mom = time_calls(lambda: _momentum_step(state, OuterConfig(group=4)), momentum_reps)
    step_ms = 1000 * statistics.median(t_mom)
    for g in GROUPS:
        stages.append(Stage(f"(e) momentum step (dense), amortised over group {g}", "-", t_mom, per=g,
                            note=f"{step_ms:.3g} ms per step" + (", the default group" if g == 4 else "")))
    return stages


def flat_stages(state: OuterState, schema: dict[str, tuple[int, ...]], kind: str, kind_blobs: list[bytes], *,
                run_cfg: RunConfig, adam: float, rcfg: RobustConfig) -> list[Stage]:
    """(b2)-(d2): the coordinator's flat path, piece by piece, on the same deltas and momentum."""
    flat = FlatOuter.from_state(state, schema)  # a copy: the weights and the dense momentum as they stand
    fdec: list[codec.FlatDelta] = []
    t_dec, t_dec_np = [], []
    for b in kind_blobs:  # with the compiled kernels and without them, blob after blob
        t_dec += time_calls(lambda: fdec.append(codec.decode_flat(b, schema=schema, offsets=flat.offsets)), 1)
        with kernels.disabled():
            t_dec_np += time_calls(lambda: codec.decode_flat(b, schema=schema, offsets=flat.offsets), 1)
    history = [robust.flat_delta_stats(d, None)[0] for d in fdec[: rcfg.window]]
    verdicts: list[robust.Verdict] = []

    def screen(d: codec.FlatDelta) -> None:
        norm, cosine = robust.flat_delta_stats(d, flat.m)
        verdicts.append(robust.decide(norm, cosine, history=history, cfg=rcfg, bound=adam))

    t_screen = time_each(screen, fdec)
    cfg = run_cfg.outer
    t_apply = time_each(lambda d: flat.apply(d, weight=1.0, cfg=cfg), fdec)
    out = [Stage("(b2) codec.decode_flat (the coordinator's path)", kind, t_dec,
                 note="every tensor's indices in one pass, global indices" + _kernel_note()),
           Stage("(b2) codec.decode_flat, numpy only (IDLETRAIN_NUMBA=0)", kind, t_dec_np,
                 note="the same deltas, each decoded right after the row above"),
           Stage("(c2) robust.flat_delta_stats + decide", kind, t_screen,
                 note=f"one gather of the momentum; {sum(v.merged for v in verdicts)}/{len(verdicts)} pass"),
           Stage(f"(d2) FlatOuter.apply, group {cfg.group}, momentum {cfg.momentum:g}", kind, t_apply,
                 note=f"lazy={flat.lazy}: momentum steps and folds included (max {1000 * max(t_apply):.3g} ms)")]
    fdec.clear()
    return out


def runtime_stages(params: dict[str, torch.Tensor], blobs: dict[str, list[bytes]], *, run_cfg: RunConfig,
                   snapshot_merges: int, meta_kinds: dict[str, dict]) -> tuple[list[Stage], list[float]]:
    """(f) coordinator/runtime.py RunRuntime.merge over deltas stored in a data dir; (stages, store times)."""
    from coordinator.runtime import RunRuntime
    from coordinator.storage import Storage

    stages: list[Stage] = []
    kinds = list(blobs)
    with tempfile.TemporaryDirectory(prefix="idletrain-merge-bench-") as tmp:
        storage = Storage(Path(tmp) / "data")
        rt = RunRuntime(run_id=1, config=run_cfg, storage=storage, state=OuterState.fresh(params), version=0)
        # the replay path with the compiled kernels and without them, in alternating chunks of 5 groups
        # (the folds fall in both alike), stored in the order they are merged
        chunk = 5 * run_cfg.outer.group
        todo = [(name, blob) for kind in kinds for i in range(0, len(blobs[kind]), chunk)
                for name in (kind, f"numpy-{kind}") for blob in blobs[kind][i:i + chunk]]
        todo += [(f"batch-{kind}-{ahead}", blob) for kind in kinds for ahead in (True, False) for blob in blobs[kind]]
        todo += [("live", blob) for blob in blobs[kinds[0]][:snapshot_merges]]
        seqs: dict[str, list[int]] = {kind: [] for kind, _ in todo}
        store_t: list[float] = []
        for seq, (kind, blob) in enumerate(todo, start=1):
            path = storage.delta(1, seq)
            store_t += time_calls(lambda: storage.write(path, blob), 1)  # what accept_delta does with the bytes
            seqs[kind].append(seq)
        for kind in kinds:
            outcomes: list = []
            outcomes_np: list = []
            t_rt: list[float] = []
            t_np: list[float] = []
            for i in range(0, len(seqs[kind]), chunk):
                t_rt += time_each(lambda s: outcomes.append(rt.merge(seq=s, base_version=s - 1, write_snapshot=False)),
                                  seqs[kind][i:i + chunk])
                with kernels.disabled():
                    t_np += time_each(lambda s: outcomes_np.append(rt.merge(seq=s, base_version=s - 1,
                                                                            write_snapshot=False)),
                                      seqs[f"numpy-{kind}"][i:i + chunk])
            merged = sum(o.merged for o in outcomes)
            stages.append(Stage(f"(f) RunRuntime.merge, replay (write_snapshot=False, group "
                                f"{run_cfg.outer.group})", kind, t_rt,
                                note=f"read file + decode + screen + apply + momentum; {merged}/{len(outcomes)} "
                                     "merged" + _kernel_note()))
            stages.append(Stage("(f) RunRuntime.merge, replay, numpy/torch only (IDLETRAIN_NUMBA=0)", kind, t_np,
                                note=f"chunks of {chunk} alternating with the row above; "
                                     f"{sum(o.merged for o in outcomes_np)}/{len(outcomes_np)} merged"))
            meta_kinds[kind]["runtime_merged"] = merged
        for kind in kinds:
            for ahead in (True, False):
                todo_seqs = seqs[f"batch-{kind}-{ahead}"]
                chunks = [todo_seqs[i:i + BATCH] for i in range(0, len(todo_seqs), BATCH)]
                outcomes = []
                t_b = time_each(lambda c: outcomes.extend(rt.merge_batch([(s, s - 1) for s in c], write_snapshot=False,
                                                                         prefetch=ahead)), chunks)
                per = [t / len(c) for t, c in zip(t_b, chunks) for _ in c]  # per delta, weighted by batch size
                merged = sum(o.merged for o in outcomes)
                stages.append(Stage(f"(f) RunRuntime.merge_batch, replay, {BATCH} per call, "
                                    + ("decoding ahead on a thread" if ahead else "no helper thread"), kind, per,
                                    note=f"{merged}/{len(outcomes)} merged"))
                meta_kinds[kind][f"batch_merged_{'ahead' if ahead else 'serial'}"] = merged
        if seqs["live"]:
            snaps, writes = _Timed(rt, "write_snapshot"), _Timed(storage, "write")
            t_live = time_each(lambda s: rt.merge(seq=s, base_version=s - 1, write_snapshot=True), seqs["live"])
            snap_t, write_t = snaps.take(), writes.take()
            sizes = [p.stat().st_size for p in (Path(tmp) / "data").rglob("*.safetensors.zst")]
            kind0 = kinds[0]
            stages.append(Stage("(f) RunRuntime.merge, live (write_snapshot=True)", kind0, t_live,
                                note=f"a snapshot per merge, {statistics.fmean(sizes) / 1e6:.3g} MB each"))
            stages.append(Stage("(f) of which snapshot encode (encode_snapshot_flat + sha256)", kind0,
                                [s - w for s, w in zip(snap_t, write_t)]))
            stages.append(Stage("(f) of which snapshot write (atomic, fsync)", kind0, write_t))
            stages += snapshot_encode_parts(rt.outer.params(), kind=kind0)
    return stages, store_t


def snapshot_encode_parts(params: dict[str, torch.Tensor], *, kind: str) -> list[Stage]:
    """What shared/snapshot.py's encode is made of, one call each: safetensors, then zstd level 3."""
    import safetensors.torch
    import zstandard

    tensors = {name: t.contiguous() for name, t in params.items()}
    raw: list[bytes] = []
    t_st = time_calls(lambda: raw.append(safetensors.torch.save(tensors)), 1)
    packed: list[bytes] = []
    zc = zstandard.ZstdCompressor(level=3, write_checksum=True, write_content_size=True)
    t_z = time_calls(lambda: packed.append(zc.compress(raw[0])), 1)
    return [Stage("(f) snapshot encode: safetensors.save alone", kind, t_st, note="one call"),
            Stage("(f) snapshot encode: zstd level 3 alone", kind, t_z,
                  note=f"one call; output {len(packed[0]) / len(raw[0]):.1%} of the raw size")]


def merger_stages(dcfg: ModelConfig, *, name: str, n: int, fraction: float, seed: int) -> list[Stage]:
    from coordinator.merger import Merger

    with tempfile.TemporaryDirectory(prefix="idletrain-merge-db-") as tmp:
        m = measure_merger(dcfg, n=n, fraction=fraction, root=Path(tmp), seed=seed)
    label = f"{name} model, {dcfg.n_params():,} params"
    return [Stage(f"(g) Merger.step on SQLite ({label})", "random", m["step"], versus_bound=False,
                  note="merge + snapshot + DB transaction"),
            Stage("(g) of which RunRuntime.merge without snapshot", "random", m["merge_core"], versus_bound=False),
            Stage("(g) of which snapshot", "random", m["snapshot"], versus_bound=False),
            Stage("(g) of which DB: reads, the merge's transaction, bookkeeping", "random", m["db"],
                  versus_bound=False, note="Merger.step minus RunRuntime.merge_batch"),
            Stage(f"(g) Merger.step with {Merger.BATCH} queued ({label})", "random", m["batched"], versus_bound=False,
                  note="per delta, snapshot_every 16: one hold of the lock, one transaction, one snapshot "
                       "per batch")]


# -- output ------------------------------------------------------------------------------------

def _fmt(x: float | None) -> str:
    if x is None:
        return "-"
    if x >= 100:
        return f"{x:,.0f}"
    return f"{x:.3g}"


def markdown(result: dict) -> str:
    meta, goal = result["meta"], result["goal"]
    lines = [f"# Merge throughput, `{meta['model']}` ({meta['n_params']:,} parameters), p = {meta['fraction']:g}",
             "",
             f"k = {meta['k']:,} values per delta, {meta['deltas_per_index']} deltas per index kind, int8 values, "
             f"{meta['torch_threads']} torch thread(s), {meta['cpus']} CPUs, torch {meta['torch']}, "
             f"outer group {meta['outer_group']}; {meta['total_wall_s']:.0f} s in all. "
             "ms per delta is the mean (p50: the median) over the deltas; x bound = ms per delta / the bound "
             "(a bare `index_add_` of the same k into an n-element fp32 tensor, median).",
             "",
             "| stage | index | ms per delta | p50 ms | merges/s | x bound | note |",
             "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['stage']} | {r['index']} | {_fmt(r['ms_per_delta'])} | {_fmt(r['p50_ms'])} | "
                     f"{_fmt(r['merges_per_s'])} | {_fmt(r['x_bound'])} | {r['note']} |")
    lines.append("")
    for kind, v in goal["per_index"].items():
        lines.append(f"- Goal (>= {goal['target_merges_per_s']:.0f} merges/s and within {goal['target_x_bound']:g}x "
                     f"the bound), replay path, {kind} indices: **{'met' if v['met'] else 'not met'}**: "
                     f"{_fmt(v['merges_per_s'])} merges/s, {_fmt(v['x_bound'])}x the bound.")
    for kind, v in goal.get("batch_per_index", {}).items():
        lines.append(f"- Goal, batched replay ({v['stage'].removeprefix('(f) ')}), {kind} indices: "
                     f"**{'met' if v['met'] else 'not met'}**: {_fmt(v['merges_per_s'])} merges/s, "
                     f"{_fmt(v['x_bound'])}x the bound.")
    if goal["live_merges_per_s"] is not None:
        lines.append(f"- Live path (a snapshot per merge): {_fmt(goal['live_merges_per_s'])} merges/s.")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    colors = {"random": "tab:blue", "topk": "tab:orange", "-": "tab:gray"}
    labels = [f"{r['stage']}" + (f" [{r['index']}]" if r["index"] != "-" else "") for r in rows]
    values = [r["ms_per_delta"] for r in rows]
    fig, ax = plt.subplots(figsize=(11, 0.32 * len(rows) + 1.8))
    ax.barh(range(len(rows)), values, color=[colors.get(r["index"], "tab:gray") if r["x_bound"] is not None
                                              else "tab:green" for r in rows])
    ax.set_yticks(range(len(rows)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")
    bound = result["goal"]["bound_ms"]
    ax.axvline(bound, color="black", linestyle="--", linewidth=1, label=f"bound: bare index_add_, {bound:.3g} ms")
    ax.axvline(GOAL_X_BOUND * bound, color="black", linestyle=":", linewidth=1,
               label=f"{GOAL_X_BOUND:g}x the bound")
    ax.axvline(1000 / GOAL_MERGES_PER_S, color="red", linestyle="-.", linewidth=1,
               label=f"goal: {GOAL_MERGES_PER_S:.0f} merges/s")
    ax.set_xlabel("ms per delta (log scale)\nblue: random (seeded) indices, orange: topk (packed), gray: either, "
                  "green: Merger.step on SQLite (its own model, no x bound)", fontsize=8)
    meta = result["meta"]
    ax.set_title(f"idletrain bench merge: {meta['model']} ({meta['n_params']:,} params), p = {meta['fraction']:g}, "
                 f"{meta['torch_threads']} thread(s)", fontsize=10)
    ax.grid(axis="x", alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.09), ncol=3)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
