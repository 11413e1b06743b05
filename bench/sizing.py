"""The sizing table of docs/sizing.md: memory, disk and bandwidth per model size, per round, from
the code's own estimators (worker/memory.py, shared/algorithms/compress.round_bound, the
coordinator's settings), so the doc cannot drift from the code: tests/bench/test_sizing.py
recomputes it and compares. `python -m bench.sizing` prints it.

Every figure is for a run's defaults (RunConfig(): batch 16 sequences per step at the model's
context, int4 deltas and model updates, error feedback) and the coordinator's (64 MiB upload cap,
32 snapshots kept, checkpoints.KEPT checkpoints).
"""

from __future__ import annotations

import dataclasses
import math

from coordinator import checkpoints
from coordinator.settings import CoordinatorSettings
from shared.algorithms.compress import round_bound
from shared.config import CompressionConfig, RunConfig
from shared.model import PRESETS, ModelConfig, meta_schema
from worker import memory

# A larger example than the presets: the Llama-style block at 22 layers of width 1024, 32,000 tokens.
EXAMPLES = {"llama-300m (example)": dict(arch="llama", vocab_size=32000, n_layer=22, n_head=16, d_model=1024,
                                         context=1024)}
# What the worker keeps of a round on disk, per parameter (worker/state.py's TrainerState, fp32): its
# weights (4), AdamW's two moments (8), the error-feedback residual (4) and the round's base (4).
WORKER_STATE_BYTES_PER_PARAM = 20
# A checkpoint (coordinator/checkpoints.py): the weights and the outer momentum (FlatOuter.checkpoint)
# and the screen's reference direction, fp32; plus the open group's pending deltas, left out here.
CHECKPOINT_BYTES_PER_PARAM = 12


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    params: int
    mem_fp32: int  # a round at batch 16, fp32 (memory.round_bytes)
    mem_bf16: int  # the same under bf16 autocast: activations halved, weights and AdamW stay fp32
    mem_micro1: int  # fp32 split into micro-batches of one sequence (worker/fit.py goes down to it)
    worker_disk: int  # the trainer's state file and one undelivered delta
    coordinator_disk: int  # snapshots kept, checkpoints kept (without the open group's pending deltas)
    snapshot: int  # a full snapshot download: at join (past version 0) and every sync.MAX_HOPS rounds
    update: int  # the model update a worker downloads per round of the others' (int4)
    delta: int  # a round's delta upload (int4 with its scales)
    fits: bool  # delta <= the default upload cap


def rows() -> list[Row]:
    run, settings = RunConfig(name="sizing"), CoordinatorSettings()
    batch = run.inner.batch_size
    out = []
    for name, fields in {**PRESETS, **EXAMPLES}.items():
        cfg = ModelConfig.from_dict(dict(fields))
        schema = meta_schema(cfg)
        n = sum(math.prod(shape) for shape in schema.values())
        act = memory.activation_bytes(cfg, batch_size=batch)
        delta = round_bound(schema, run.compression)
        snapshot = memory.snapshot_bytes(n) - memory.SNAPSHOT_SLACK_BYTES  # fp32 weights; zstd barely shrinks them
        out.append(Row(
            name=name, params=n, mem_fp32=memory.round_bytes(n, cfg, batch_size=batch),
            mem_bf16=n * memory.BYTES_PER_PARAM + act // 2,
            mem_micro1=memory.round_bytes(n, cfg, batch_size=1),
            worker_disk=n * WORKER_STATE_BYTES_PER_PARAM + delta,
            coordinator_disk=settings.snapshot_keep * snapshot + checkpoints.KEPT * n * CHECKPOINT_BYTES_PER_PARAM,
            snapshot=snapshot, update=round_bound(schema, CompressionConfig(values=run.update_values)),
            delta=delta, fits=delta <= settings.max_upload_bytes))
    return out


def _size(n: int) -> str:
    """Three significant digits in binary units (MiB, GiB: the upload cap's): what the table shows."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            value = n / scale
            return f"{value:.3g} {unit}" if value < 100 else f"{value:.0f} {unit}"
    return f"{n} B"


def table() -> str:
    """The markdown table docs/sizing.md holds between its markers."""
    head = ("| model | parameters | worker memory, fp32 | bf16 | fp32, micro-batch 1 | worker disk | coordinator disk "
            "| snapshot download | update download | delta upload | under the 64 MiB cap |\n"
            "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|")
    lines = [head]
    for r in rows():
        lines.append(f"| `{r.name}` | {r.params:,} | {_size(r.mem_fp32)} | {_size(r.mem_bf16)} | {_size(r.mem_micro1)} "
                     f"| {_size(r.worker_disk)} | {_size(r.coordinator_disk)} | {_size(r.snapshot)} "
                     f"| {_size(r.update)} | {_size(r.delta)} | {'yes' if r.fits else 'no'} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
