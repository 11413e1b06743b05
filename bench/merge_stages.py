"""The stages of `python -m bench merge` ((a)-(f) of bench/merge.py), each timed on the same deltas:
the bound (BoundProbe), decoding, screening and applying in memory, the coordinator's flat path,
and RunRuntime.merge over deltas stored as the coordinator stores them. Also the deltas themselves,
as a worker sends them, and the Stage row every stage becomes."""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from bench.numbers import sig
from shared import codec, kernels
from shared.algorithms import robust, robust_stats
from shared.algorithms.compress import compress, k_for, quantised, tensor_seed
from shared.algorithms.flat_outer import FlatOuter
from shared.algorithms.outer import OuterState, apply_delta, momentum_step
from shared.codec import Delta, Entry, IndexKind, ValueKind, seeded_indices
from shared.codec.envelope import HEADER, _decompress
from shared.codec.indices import INDEX_CODECS
from shared.codec.values import VALUE_CODECS
from shared.config import CompressionConfig, OuterConfig, RobustConfig, RunConfig

INDEX_KINDS = ("random", "topk")
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
        return {"stage": self.stage, "index": self.index, "ms_per_delta": sig(mean), "p50_ms": sig(p50),
                "merges_per_s": sig(1000 / mean), "x_bound": sig(mean / bound_ms) if self.versus_bound else None,
                "calls": len(self.times_s), "note": self.note}


class Timed:
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
        history = [robust_stats.delta_stats(d, None)[0] for d in dec[: rcfg.window]]
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
    t_mom = time_calls(lambda: momentum_step(state, OuterConfig(group=4)), momentum_reps)
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
    history = [robust_stats.flat_delta_stats(d, None)[0] for d in fdec[: rcfg.window]]
    verdicts: list[robust.Verdict] = []

    def screen(d: codec.FlatDelta) -> None:
        norm, cosine = robust_stats.flat_delta_stats(d, flat.m)
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
        storage = Storage.local(Path(tmp) / "data")
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
            store_t += time_calls(lambda: storage.write(path, blob), 1)  # what UploadService.accept does with the bytes
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
            snaps, writes = Timed(rt, "write_snapshot"), Timed(storage, "write")
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
