"""`python -m bench convergence`: every method on the same model and the same tokens, side by side.

Per method: final held-out eval loss, its ratio to ddp, bytes each worker sent and received,
the traffic reduction against ddp (dense fp32 gradients both ways every step), wall time.
Writes results.json, results.md and loss.png (eval loss against tokens, one line per method).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path

import torch

from bench.convergence_long import long_run_method, regime_default
from bench.sim import Method, Result, Setup, ddp_bytes_per_worker, run_method
from shared.config import CompressionConfig, InnerConfig, OuterConfig, RunConfig
from shared.data import load_corpus
from shared.model import ModelConfig, build_model, count_params

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Profile:
    model: ModelConfig
    steps_per_worker: int
    corpus_max_bytes: int
    eval_tokens: int
    lr: float
    warmup_steps: int
    H: int  # local steps per round of the default row (the diloco family; H/2 for the int8 and sparta rows)
    # rows that only the quick profile affords: DiLoCo's published outer optimiser, and the int8 row
    # without the look-ahead (the A/B of OuterConfig.lookahead) and with a barrier (synchronous DiLoCo)
    extra_rows: bool = False
    batch_size: int = 16  # sequences per worker step
    device: str = "cpu"  # "cuda": the replicas train on one CUDA device (the gpu profile)
    rows: tuple[str, ...] = ()  # only the rows whose name contains one of these (and ddp); () = all


PROFILES = {
    # Minutes on 2 cores: a smaller model, fewer steps; the same methods and accounting.
    "quick": Profile(ModelConfig(n_layer=2, n_head=4, d_model=64, context=64), steps_per_worker=160,
                     corpus_max_bytes=4 << 20, eval_tokens=1 << 15, lr=3e-3, warmup_steps=20, H=40, extra_rows=True),
    # The shape of the published SPARTA measurements (docs/references.md): 644k params, context 128.
    # 250 steps x 8 workers x 8 methods (and one lone worker) is what fits the hour on 2 cores.
    "full": Profile(ModelConfig(), steps_per_worker=250, corpus_max_bytes=16 << 20, eval_tokens=1 << 16,
                    lr=2e-3, warmup_steps=25, H=50),
    # For a session lent one CUDA device (never needed by the tests): 25.5M parameters (8 layers, width
    # 512, context 256), 8 workers of 16 sequences, 400 steps each (13.1M tokens), H=100, four rows.
    # Sized for < 8 min on one H100/H200-class device: the replicas train on it, compression and merging
    # stay on the CPU as in the real worker and coordinator.
    "gpu": Profile(ModelConfig(n_layer=8, n_head=8, d_model=512, context=256), steps_per_worker=400,
                   corpus_max_bytes=32 << 20, eval_tokens=1 << 17, lr=1e-3, warmup_steps=40, H=100,
                   device="cuda", rows=("alone", "(default)", "int8+EF")),
}


def device_problem(profile: str) -> str | None:
    """Why this machine cannot run the profile's device (None: it can)."""
    if PROFILES[profile].device.startswith("cuda") and not torch.cuda.is_available():
        return (f"the {profile} profile trains on a CUDA device and torch sees none here: run it on a machine with "
                "one (and a CUDA build of torch)")
    return None


def methods_for(p: Profile, *, workers: int, hetero: float = 1.0) -> list[Method]:
    defaults = RunConfig(name="defaults")
    dense32 = CompressionConfig(index="dense", fraction=1.0, values="fp32", error_feedback=False)
    dense8 = CompressionConfig(index="dense", fraction=1.0, values="int8", error_feedback=True)
    dense4 = CompressionConfig(index="dense", fraction=1.0, values="int4", error_feedback=True)
    paper = OuterConfig(lr=0.7, momentum=0.9, group=workers)  # DiLoCo's published outer optimiser
    outer = defaults.outer.model_copy(update={"group": workers})
    default = Method(f"diloco H={p.H} {_label(defaults.compression)}, {defaults.update_values} down (default)",
                     "diloco", H=p.H, compression=defaults.compression, outer=outer,
                     update_values=defaults.update_values)
    # the regime these profiles' lengths call for is the short one (shared/config.py choose_regime): the rows
    # above are variations of its defaults
    default = regime_default(p.model, batch=p.batch_size, workers=workers, steps_per_worker=p.steps_per_worker,
                             short=default)
    short_h, long_h = p.H // 2, p.steps_per_worker // 2  # twice the rounds; two rounds in the whole run
    int8 = Method(f"diloco H={short_h} int8+EF, int8 down", "diloco", H=short_h, compression=dense8, outer=outer,
                  update_values="int8")
    methods = [
        Method("ddp", "ddp"),
        Method(f"1 worker alone (1/{workers} of the tokens, nothing sent)", "alone"),
        int8,
        default,
        Method(f"diloco H={long_h} int4+EF, int4 down", "diloco", H=long_h, compression=dense4, outer=outer,
               update_values="int4"),
        Method("sparta p=0.5%", "sparta", sparta_p=0.005),
        Method("sparta p=0.1%", "sparta", sparta_p=0.001),
        Method(f"sparta p=0.5% + diloco H={short_h}", "sparta+diloco", H=short_h, sparta_p=0.005, compression=dense8,
               outer=outer),
    ]
    if p.extra_rows:  # DiLoCo's published outer optimiser, the A/B of the look-ahead, the group's AdamW
        methods[3:3] = [
            Method(f"diloco H={short_h} (paper outer: lr 0.7, Nesterov 0.9), fp32", "diloco", H=short_h,
                   compression=dense32, outer=paper, update_values="int8"),
            dataclasses.replace(int8, name=f"{int8.name}, no look-ahead",
                                outer=outer.model_copy(update={"lookahead": False})),
            dataclasses.replace(int8, name=f"{int8.name}, synchronous (every round waits for all)", barrier=True),
        ]
        # the long runs' inner optimiser (shared/algorithms/group_adamw.py) in a run of a few rounds
        methods.append(dataclasses.replace(default, name=f"{default.name.removesuffix(' (default)')}, group-normalised "
                                           "AdamW", second_moment_workers=workers))
        # and the whole long-run configuration, the long profile's best row at >= 500x, in a run of a few rounds
        methods.append(long_run_method(default, workers))
    if hetero != 1.0:  # the default method again with workers of unequal speed, side by side, and with
        # each worker's H scaled by its speed (Async Local-SGD's dynamic local steps)
        uneven = dataclasses.replace(default, name=f"{default.name}, speeds 1-{hetero:g}x", speed_spread=hetero)
        methods += [uneven, dataclasses.replace(uneven, name=f"{uneven.name}, dynamic H", dynamic_h=True)]
    return methods


def _label(c: CompressionConfig) -> str:
    kind = "" if c.index == "dense" else f"{c.index}{c.fraction:.0%} "
    return f"{kind}{c.values}{'+EF' if c.error_feedback else ''}"


def result_row(r: Result, *, ddp: Result, dense_bytes: float) -> dict:
    return {
        "method": r.method,
        "eval_loss": round(r.eval_loss, 4),
        "loss_ratio_vs_ddp": round(r.eval_loss / ddp.eval_loss, 4),
        "bytes_up_per_worker": int(r.bytes_up_per_worker),
        "bytes_down_per_worker": int(r.bytes_down_per_worker),
        # None: nothing travelled (the lone worker), no finite factor
        "traffic_reduction_vs_ddp": (round(2 * dense_bytes / (r.bytes_up_per_worker + r.bytes_down_per_worker), 1)
                                     if r.bytes_up_per_worker + r.bytes_down_per_worker > 0 else None),
        "wall_s": round(r.wall_s, 1),
        "curve": [[int(t), round(loss, 4)] for t, loss in r.curve],
    }


def write_markdown(rows: list[dict], path: Path, *, header: str) -> None:
    lines = [header, "", "| method | eval loss | x ddp | up / worker | down / worker | traffic reduction | wall s |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['method']} | {r['eval_loss']:.3f} | {r['loss_ratio_vs_ddp']:.3f} | "
                     f"{r['bytes_up_per_worker'] / 1e6:.2f} MB | {r['bytes_down_per_worker'] / 1e6:.2f} MB | "
                     f"{_reduction(r)} | {r['wall_s']:.0f} |")
    path.write_text("\n".join(lines) + "\n")


def _reduction(row: dict) -> str:
    factor = row["traffic_reduction_vs_ddp"]
    return "nothing sent" if factor is None else f"{factor:.0f}x"


def plot(rows: list[dict], path: Path, *, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for r in rows:
        t, loss = zip(*r["curve"])
        ax.plot([x / 1e6 for x in t], loss, marker="o", markersize=3, label=f"{r['method']} ({_reduction(r)})")
    ax.set_xlabel("tokens trained (millions)")
    ax.set_ylabel("held-out loss (nats/byte)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    lows = [min(loss for _, loss in r["curve"]) for r in rows]
    finals = [r["curve"][-1][1] for r in rows]
    ax.set_ylim(min(lows) * 0.95, max(min(lows) * 1.9, max(finals) * 1.05))  # every final point visible
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(*, profile: str = "quick", out: Path = Path("bench-results/convergence"), workers: int = 8,
        hetero: float = 1.0, only: list[str] | None = None, threads: int | None = None) -> list[dict]:
    if profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r}: pick one of {sorted(PROFILES)}")
    if threads:
        torch.set_num_threads(threads)
    p = PROFILES[profile]
    problem = device_problem(profile)
    if problem:
        raise RuntimeError(problem)
    if p.device.startswith("cuda"):
        torch.set_float32_matmul_precision("high")  # TF32 matmuls: the weights and AdamW stay fp32
    corpus = load_corpus(max_bytes=p.corpus_max_bytes)
    setup = Setup(model=p.model, inner=InnerConfig(lr=p.lr, warmup_steps=p.warmup_steps, batch_size=p.batch_size),
                  workers=workers, steps_per_worker=p.steps_per_worker, train=torch.from_numpy(corpus.train),
                  eval=torch.from_numpy(corpus.eval[: p.eval_tokens]), device=p.device)
    methods = methods_for(p, workers=workers, hetero=hetero)
    for names in (p.rows, only):
        if names:
            methods = [m for m in methods if m.name == "ddp" or any(o in m.name for o in names)]
    out.mkdir(parents=True, exist_ok=True)
    dense = ddp_bytes_per_worker(setup) / 2
    results: list[Result] = []
    t0 = time.perf_counter()
    for m in methods:
        log.info("running %s", m.name)
        r = run_method(setup, m)
        log.info("%s: eval loss %.4f, up %.2f MB, down %.2f MB, %.0f s", m.name, r.eval_loss,
                 r.bytes_up_per_worker / 1e6, r.bytes_down_per_worker / 1e6, r.wall_s)
        results.append(r)
    ddp = results[0]
    rows = [result_row(r, ddp=ddp, dense_bytes=dense) for r in results]
    n_params = count_params(build_model(p.model))
    meta = {"profile": profile, "workers": workers, "hetero_speed_spread": hetero, "n_params": n_params,
            "device": torch.cuda.get_device_name() if p.device.startswith("cuda") else "cpu",
            "steps_per_worker": p.steps_per_worker, "tokens_per_method": setup.total_steps * setup.tokens_per_step,
            "total_wall_s": round(time.perf_counter() - t0, 1), "torch_threads": torch.get_num_threads()}
    (out / "results.json").write_text(json.dumps(rows, indent=1) + "\n")
    (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    header = (f"# Convergence, profile `{profile}`\n\n{workers} workers, {n_params:,} parameters, "
              f"{meta['tokens_per_method']:,} tokens per method, speed spread {hetero:g}x; "
              f"traffic reduction = ddp bytes (dense fp32 gradients up and down every step) / bytes moved.")
    write_markdown(rows, out / "results.md", header=header)
    plot(rows, out / "loss.png", title=f"python -m bench convergence --profile {profile} ({workers} workers)")
    return rows
