"""`python -m bench merge`: deltas merged per second, stage by stage, against a bound measured alongside.

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

import datetime
import json
import logging
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from bench.merge_report import goals, markdown, plot
from bench.merge_stages import (INDEX_KINDS, BoundProbe, Stage, Timed, delta_k, in_memory_stages, make_delta,
                                pseudo_gradient, runtime_stages)
from bench.numbers import sig
from shared import codec
from shared.config import CompressionConfig, RunConfig
from shared.model import ModelConfig, build_model, get_params, param_schema

log = logging.getLogger(__name__)

PARAM_MODELS = {
    "gpt2-124m": ModelConfig(vocab_size=50257, n_layer=12, n_head=12, d_model=768, context=1024),  # 124,439,808
    "small": ModelConfig(),  # the default run model, 644,224 params
    "tiny": ModelConfig(n_layer=1, n_head=2, d_model=16, context=16),  # tests
}


# -- (g): Merger.step on a coordinator -------------------------------------------------------

def measure_merger(mcfg: ModelConfig, *, n: int, fraction: float, root: Path, seed: int) -> dict[str, list[float]]:
    """Merger.step on a SQLite coordinator: lease, upload and merge `n` deltas one after another,
    timing each step and, inside it, RunRuntime.merge and its snapshot. Evaluation and
    checkpoints are turned off (they are periodic, not per merge)."""
    from coordinator.merger import Merger
    from coordinator.services.coordinator import Coordinator
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
        coord.runs.create(cfg)
        registered = coord.workers.register(cfg.name, protocol.RegisterRequest(name="bench"))
        worker = coord.workers.authenticate(registered.token)
        rt = coord.live.runtime_list()[0]
        merges, snapshots = Timed(rt, "merge_batch"), Timed(rt, "write_snapshot")
        merger = Merger(coord)
        pg = pseudo_gradient(rt.state.params, seed=seed + 1)
        steps: list[float] = []
        for i in range(n):
            lease = coord.leases.grant(cfg.name, worker)
            if lease is None:
                raise RuntimeError("the benchmark's run handed out no lease")
            # the lease's own seed: the coordinator takes random indices only where the lease's seed draws them
            body = codec.encode(make_delta(pg, kind="random", fraction=fraction, base_version=lease.base_version,
                                           round_seed=lease.seed))
            coord.uploads.accept(lease.lease_id, worker, body)
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
            lease = coord.leases.grant(cfg.name, worker)
            coord.uploads.accept(lease.lease_id, worker, codec.encode(make_delta(
                pg, kind="random", fraction=fraction, base_version=lease.base_version, round_seed=lease.seed)))
            merger.step(rt)
        batched: list[float] = []
        for b in range(max(1, n // Merger.BATCH)):
            for i in range(Merger.BATCH):
                lease = coord.leases.grant(cfg.name, worker)
                body = codec.encode(make_delta(pg, kind="random", fraction=fraction, base_version=lease.base_version,
                                               round_seed=lease.seed))
                coord.uploads.accept(lease.lease_id, worker, body)
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
    blobs = _deltas(params, index_kinds=index_kinds, n=n, fraction=fraction, seed=seed)
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
    stages[:0] = _bound_stages(probe, k=k, n_params=n_params)
    bound_bursts = probe.bursts
    del probe

    # (g) Merger.step with its database transaction, on SQLite
    db_name = None
    if db_model is not None and db_deltas > 0:
        dcfg = PARAM_MODELS[db_model] if isinstance(db_model, str) else db_model
        db_name = db_model if isinstance(db_model, str) else "custom"
        stages += merger_stages(dcfg, name=db_name, n=db_deltas, fraction=fraction, seed=seed)

    rows = [s.row(bound_ms) for s in stages]
    goal = goals(rows, bound_ms)
    meta = {"model": model_name, "model_config": mcfg.to_dict(), "n_params": n_params, "fraction": fraction,
            "k": k, "deltas_per_index": n, "index_kinds": list(index_kinds), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "cpus": os.cpu_count(), "outer_group": run_cfg.outer.group,
            "snapshot_merges": snapshot_merges, "db_model": db_name, "db_deltas": db_deltas if db_name else 0,
            "delta_store_ms_mean": sig(1000 * statistics.fmean(store_t)) if store_t else None,
            "per_index": meta_kinds, "date": datetime.date.today().isoformat(),
            "bound_burst_medians_ms": [sig(b) for b in bound_bursts], "load_average_start": load_start,
            "load_average_end": [round(x, 2) for x in os.getloadavg()],
            "THP_MEM_ALLOC_ENABLE": os.environ.get("THP_MEM_ALLOC_ENABLE"),
            "total_wall_s": round(time.perf_counter() - t_start, 1)}
    result = {"meta": meta, "goal": goal, "rows": rows}
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "results.md").write_text(markdown(result) + "\n")
    plot(result, out / "stages.png")
    return result


def _deltas(params: dict[str, torch.Tensor], *, index_kinds: tuple[str, ...], n: int, fraction: float,
            seed: int) -> dict[str, list[bytes]]:
    """N deltas per index kind, encoded as they travel; stored later as the coordinator stores them."""
    t0 = time.perf_counter()
    pg = pseudo_gradient(params, seed=seed + 1)
    blobs = {kind: [codec.encode(make_delta(pg, kind=kind, fraction=fraction, base_version=j * n + i,
                                            round_seed=seed + 10_000 * j + i)) for i in range(n)]
             for j, kind in enumerate(index_kinds)}
    del pg
    log.info("built %d deltas in %.1f s", n * len(index_kinds), time.perf_counter() - t0)
    return blobs


def _bound_stages(probe: BoundProbe, *, k: int, n_params: int) -> list[Stage]:
    """(a) the bound's rows, from every burst of the probe; numpy's scatter beside it."""
    return [Stage("(a) bound: bare index_add_ of k random into n fp32", "-", probe.index_add, central="median",
                  note=f"k = {k:,}, n = {n_params:,}; median of {len(probe.index_add)} calls in 4 bursts "
                       f"over the run (burst medians {', '.join(f'{b:.3g}' for b in probe.bursts)} ms)"),
            Stage("reference: numpy a[idx] += v, same k and n", "-", probe.numpy, central="median",
                  note="another kernel for the same scatter (median)")]
