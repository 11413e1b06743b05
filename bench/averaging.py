"""`python -m bench averaging`: where the loss of averaging AdamW workers comes from, measured.

The convergence benchmark finds no low-communication method within 2% of ddp, and synchronous
DiLoCo no closer at H = 1 than at H = 40. This benchmark takes that apart. Its M workers step in
lock-step, so it can also compute what no real run sees without communicating every step: the
gradient of the combined batch (the mean of the workers' gradients). Every row trains the same
model on the same batches (worker i draws from its own seeded stream; ddp takes all M at once):

- `ddp`: one AdamW on the combined batch.
- `average H`: synchronous DiLoCo at outer lr 1 without momentum: each worker keeps its own AdamW
  moments and every H steps the workers' weights are averaged.
- `gain H`: the same, with the averaged pseudo-gradient scaled per coordinate by AdaScale's gain
  ratio sqrt(mean_i v_i / v) (Johnson et al., 2020), v being the AdamW second moment of the
  combined gradient, clamped to [1, sqrt(M)]: a worker's second moment holds its small batch's
  noise, so its normalised step is up to sqrt(M) smaller than ddp's wherever noise dominates, and
  averaging does not give that back. The gain is an oracle (v needs every step's gradients).
- `shared v H`: every worker normalises by that v (the oracle) instead of its own.
- `alone`: worker 0 by itself (its own batches, nothing averaged): what communicating has to beat.

With clipping off, `shared v` at H = 1 is ddp exactly (the updates are linear in the first
moments; tests/bench/test_averaging.py checks it), so any gap between `average 1` and ddp is the
normalisation alone, and the rows at larger H show what the workers' drift adds. The `full`
profile adds the same at 4x the steps and at 4x the batch per worker (4x the tokens, each with its
own ddp). The `batch` profile asks where the convergence benchmark's 1000x goal could be met at
all: at 16, 64 and 256 sequences per worker, ddp, a lone worker, and averaging every 40 steps or
once at the end (1000x less traffic than ddp leaves a dense int4 exchange at most every 125 steps).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from pathlib import Path

import torch

from bench.convergence import PROFILES as CONVERGENCE_PROFILES
from shared.algorithms.inner import scheduled_lr
from shared.config import InnerConfig
from shared.data import load_corpus, sample_batch
from shared.model import ModelConfig, build_model, evaluate_loss

log = logging.getLogger(__name__)

MODES = ("ddp", "average", "gain", "shared v")
ALONE = "alone"  # worker 0 by itself: the no-communication reference
EPS = 1e-8


@dataclasses.dataclass(frozen=True)
class Regime:
    """What one ddp and the rows measured against it share."""

    name: str
    model: ModelConfig
    inner: InnerConfig  # batch_size is per worker; lr, warm-up, betas, weight decay, clipping
    workers: int
    steps: int
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class Row:
    regime: Regime
    mode: str  # one of MODES
    H: int = 1

    @property
    def name(self) -> str:
        return self.mode if self.mode in ("ddp", ALONE) else f"{self.mode} H={self.H}"


class FlatAdamW:
    """torch.optim.AdamW's arithmetic on one flat vector that the model's parameters are views of,
    so the bench can read and replace the moments (and average the weights) in one place."""

    def __init__(self, model: torch.nn.Module, cfg: InnerConfig) -> None:
        self.model, self.cfg = model, cfg
        params = list(model.parameters())
        self.flat = torch.cat([p.detach().reshape(-1) for p in params]).clone()
        decay, pos = [], 0
        for p in params:
            p.data = self.flat[pos:pos + p.numel()].view_as(p)
            decay.append(torch.full((p.numel(),), float(p.dim() >= 2)))  # make_optimizer's groups
            pos += p.numel()
        self.decay = torch.cat(decay) * cfg.weight_decay
        self.m = torch.zeros_like(self.flat)
        self.v = torch.zeros_like(self.flat)
        self.t = 0

    def grad(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The flat gradient of the batch's mean loss at the current weights (not clipped)."""
        _, loss = self.model(x, y)
        self.model.zero_grad(set_to_none=True)
        loss.backward()
        return torch.cat([p.grad.reshape(-1) for p in self.model.parameters()])

    def moments(self, g: torch.Tensor) -> None:
        self.t += 1
        self.m.lerp_(g, 1 - self.cfg.beta1)  # as torch.optim.AdamW does it
        self.v.mul_(self.cfg.beta2).addcmul_(g, g, value=1 - self.cfg.beta2)

    def step(self, lr: float, v: torch.Tensor | None = None) -> None:
        """The AdamW step from the moments (v: normalise by this second moment instead of our own)."""
        v = self.v if v is None else v
        self.flat.mul_(1 - lr * self.decay)
        denom = (v.sqrt() / math.sqrt(1 - self.cfg.beta2 ** self.t)).add_(EPS)
        self.flat.addcdiv_(self.m, denom, value=-lr / (1 - self.cfg.beta1 ** self.t))


def clip(g: torch.Tensor, max_norm: float) -> torch.Tensor:
    """clip_grad_norm_'s rule on a flat gradient (0: no clipping)."""
    if not max_norm:
        return g
    return g * min(1.0, max_norm / (float(g.norm()) + 1e-6))


def train(row: Row, tokens: torch.Tensor) -> torch.Tensor:
    """Train one row; returns the final (averaged) flat weights."""
    r, cfg = row.regime, row.regime.inner
    gens = [torch.Generator().manual_seed(r.seed * 1000 + i + 1) for i in range(r.workers)]
    n_models = 1 if row.mode in ("ddp", ALONE) else r.workers
    opts = [FlatAdamW(build_model(r.model, seed=r.seed), cfg) for _ in range(n_models)]
    shared = torch.zeros_like(opts[0].flat)  # the combined gradient's second moment (the oracle)
    base = opts[0].flat.clone()
    per_step = cfg.batch_size * r.model.context * r.workers
    for t in range(r.steps):
        ramp = min(1.0, (t + 1) / cfg.warmup_steps) if cfg.warmup_steps else 1.0
        lr = ramp * scheduled_lr(cfg, tokens_done=t * per_step, schedule_tokens=r.steps * per_step)
        batches = [sample_batch(tokens, batch_size=cfg.batch_size, context=r.model.context, generator=g)
                   for g in (gens[:1] if row.mode == ALONE else gens)]  # alone: worker 0's stream
        if row.mode in ("ddp", ALONE):  # one AdamW on every batch drawn (alone: worker 0's only)
            g = opts[0].grad(torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches]))
            opts[0].moments(clip(g, cfg.grad_clip))
            opts[0].step(lr)
            continue
        raw = [o.grad(x, y) for o, (x, y) in zip(opts, batches)]
        combined = clip(torch.stack(raw).mean(0), cfg.grad_clip)
        shared.mul_(cfg.beta2).addcmul_(combined, combined, value=1 - cfg.beta2)
        for o, g in zip(opts, raw):
            o.moments(clip(g, cfg.grad_clip))
            o.step(lr, shared if row.mode == "shared v" else None)
        if (t + 1) % row.H == 0 or t + 1 == r.steps:
            pseudo = base - torch.stack([o.flat for o in opts]).mean(0)
            if row.mode == "gain":
                v_workers = torch.stack([o.v for o in opts]).mean(0)
                pseudo.mul_((v_workers / shared.clamp_min(1e-30)).sqrt().clamp_(1.0, math.sqrt(r.workers)))
            base = base - pseudo
            for o in opts:
                o.flat.copy_(base)
    return opts[0].flat.clone()


def eval_loss(regime: Regime, flat: torch.Tensor, tokens: torch.Tensor) -> float:
    model = build_model(regime.model, seed=regime.seed)
    torch.nn.utils.vector_to_parameters(flat, model.parameters())
    return evaluate_loss(model, tokens, context=regime.model.context)


QUICK = CONVERGENCE_PROFILES["quick"]  # the convergence benchmark's quick setup: model, steps, lr, corpus
PROFILES = ("quick", "full", "batch")
H_SWEEP = (1, 2, 5, 10, 40)
FULL_SEEDS = (0, 1, 2)
BATCHES = (16, 64, 256)  # sequences per worker, the batch profile


def rows_for(profile: str, *, workers: int = 8) -> list[Row]:
    """quick: the H sweep on the convergence benchmark's quick setup (160 steps of 16 sequences per
    worker), one seed; full: the sweep with three seeds (each its own init and batches: a single
    run's loss moves by about 1% with float rounding alone), then ddp, average 1 and average 40 at 4x
    the steps and at 4x the batch; batch: ddp, alone, average 40 and average once at the end, at each
    of BATCHES sequences per worker (the same steps and lr; seed 0)."""
    if profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r}: pick {', '.join(PROFILES)}")
    inner = InnerConfig(lr=QUICK.lr, warmup_steps=QUICK.warmup_steps)
    base = Regime(f"{QUICK.steps_per_worker} steps x {inner.batch_size} sequences per worker", QUICK.model, inner,
                  workers, steps=QUICK.steps_per_worker)
    if profile == "batch":
        rows = []
        for b in BATCHES:
            regime = dataclasses.replace(base, name=f"{base.steps} steps x {b} sequences per worker",
                                         inner=inner.model_copy(update={"batch_size": b}))
            rows += [Row(regime, "ddp"), Row(regime, ALONE), Row(regime, "average", 40),
                     Row(regime, "average", base.steps)]
        return rows
    rows = []
    for seed in (FULL_SEEDS if profile == "full" else (0,)):
        regime = dataclasses.replace(base, seed=seed)
        rows += [Row(regime, "ddp")] + [Row(regime, mode, h) for mode in MODES[1:] for h in H_SWEEP]
    if profile == "full":
        longer = dataclasses.replace(base, name=f"{4 * base.steps} steps x {inner.batch_size} sequences per worker",
                                     steps=4 * base.steps)
        wider = dataclasses.replace(base, name=f"{base.steps} steps x {4 * inner.batch_size} sequences per worker",
                                    inner=inner.model_copy(update={"batch_size": 4 * inner.batch_size}))
        for regime in (longer, wider):
            rows += [Row(regime, "ddp"), Row(regime, "average", 1), Row(regime, "average", 40)]
    return rows


def run(*, profile: str = "quick", out: Path = Path("bench-results/averaging"), workers: int = 8,
        threads: int | None = 1, rows: list[Row] | None = None, corpus_max_bytes: int = QUICK.corpus_max_bytes,
        eval_tokens: int = QUICK.eval_tokens) -> list[dict]:
    if threads:
        torch.set_num_threads(threads)
    rows = rows_for(profile, workers=workers) if rows is None else rows
    corpus = load_corpus(max_bytes=corpus_max_bytes)
    train_tokens = torch.from_numpy(corpus.train)
    held_out = torch.from_numpy(corpus.eval[:eval_tokens])
    out.mkdir(parents=True, exist_ok=True)
    results: list[dict] = []
    ddp: dict[tuple[str, int], float] = {}  # each row against the ddp of its own regime and seed
    t0 = time.perf_counter()
    for row in rows:
        start = time.perf_counter()
        loss = eval_loss(row.regime, train(row, train_tokens), held_out)
        key = (row.regime.name, row.regime.seed)
        if row.mode == "ddp":
            ddp[key] = loss
        results.append({"regime": row.regime.name, "seed": row.regime.seed, "row": row.name, "mode": row.mode,
                        "H": row.H, "workers": row.regime.workers, "steps": row.regime.steps,
                        "batch_per_worker": row.regime.inner.batch_size, "eval_loss": round(loss, 4),
                        "loss_ratio_vs_ddp": round(loss / ddp[key], 4) if key in ddp else None,
                        "wall_s": round(time.perf_counter() - start, 1)})
        log.info("%s, seed %d, %s: eval loss %.4f (%.0f s)", row.regime.name, row.regime.seed, row.name, loss,
                 results[-1]["wall_s"])
    meta = {"profile": profile, "workers": workers, "torch_threads": torch.get_num_threads(),
            "total_wall_s": round(time.perf_counter() - t0, 1), "model": dataclasses.asdict(QUICK.model)}
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    write_markdown(results, out / "results.md", workers=workers)
    (plot_batch if profile == "batch" else plot)(results, out / "ratio.png")
    return results


def summarise(results: list[dict]) -> list[dict]:
    """One line per (regime, row) over its seeds: mean eval loss, mean / min / max ratio to ddp."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in results:
        groups.setdefault((r["regime"], r["row"]), []).append(r)
    out = []
    for (regime, row), rs in groups.items():
        ratios = [r["loss_ratio_vs_ddp"] for r in rs if r["loss_ratio_vs_ddp"] is not None]
        out.append({"regime": regime, "row": row, "mode": rs[0]["mode"], "H": rs[0]["H"], "seeds": len(rs),
                    "eval_loss": sum(r["eval_loss"] for r in rs) / len(rs),
                    "ratio": sum(ratios) / len(ratios) if ratios else None,
                    "ratio_min": min(ratios, default=None), "ratio_max": max(ratios, default=None),
                    "wall_s": sum(r["wall_s"] for r in rs) / len(rs)})
    return out


def write_markdown(results: list[dict], path: Path, *, workers: int) -> None:
    lines = [f"# Averaging AdamW workers against ddp ({workers} workers in lock-step)", "",
             "Each row against the ddp of its own regime and seed; mean over the seeds, with the range.", "",
             "| regime | row | seeds | eval loss | x ddp | x ddp min-max | wall s |", "|---|---|---|---|---|---|---|"]
    for r in summarise(results):
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
        spread = "-" if r["ratio"] is None or r["seeds"] == 1 else f"{r['ratio_min']:.3f}-{r['ratio_max']:.3f}"
        lines.append(f"| {r['regime']} | {r['row']} | {r['seeds']} | {r['eval_loss']:.3f} | {ratio} | {spread} | "
                     f"{r['wall_s']:.0f} |")
    path.write_text("\n".join(lines) + "\n")


def plot_batch(results: list[dict], path: Path) -> None:
    """The batch profile: eval loss / ddp's against the sequences per worker, a line per row."""
    lines = summarise(results)
    batch = {r["regime"]: r["batch_per_worker"] for r in results}
    fig, ax = _figure()
    for name in dict.fromkeys(r["row"] for r in lines if r["mode"] != "ddp"):
        pts = sorted((batch[r["regime"]], r["ratio"]) for r in lines if r["row"] == name and r["ratio"] is not None)
        ax.plot(*zip(*pts), marker="o", label={ALONE: "worker 0 alone"}.get(name, name))
    _finish(fig, ax, path, ticks=sorted(set(batch.values())), xlabel="sequences per worker per step (ddp: x workers)",
            title=f"averaging AdamW workers at larger batches ({results[0]['steps']} steps)")


def plot(results: list[dict], path: Path) -> None:
    first = results[0]["regime"]
    lines = summarise(results)
    fig, ax = _figure()
    for mode in MODES[1:]:
        pts = sorted((r["H"], r["ratio"], r["ratio_min"], r["ratio_max"]) for r in lines
                     if r["regime"] == first and r["mode"] == mode)
        if pts:
            h, mean, lo, hi = zip(*pts)
            ax.errorbar(h, mean, yerr=[[m - a for m, a in zip(mean, lo)], [b - m for m, b in zip(mean, hi)]],
                        marker="o", capsize=3, label=mode)
    _finish(fig, ax, path, ticks=sorted({r["H"] for r in results if r["regime"] == first and r["mode"] != "ddp"}),
            xlabel="H: local steps between averages", title=f"averaging AdamW workers ({first})")


def _figure():
    """A new figure and axes for either plot (matplotlib drawn off-screen)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(7, 4.5))


def _finish(fig, ax, path: Path, *, ticks: list[int], xlabel: str, title: str) -> None:
    """What both plots share: the ddp and ddp + 2% lines, a log x axis with these ticks, the file."""
    import matplotlib.pyplot as plt

    ax.axhline(1.0, color="black", linewidth=1, label="ddp")
    ax.axhline(1.02, color="grey", linestyle="--", linewidth=1, label="ddp + 2%")
    ax.set_xscale("log")
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.set_xlabel(xlabel)
    ax.set_ylabel("eval loss / ddp's")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
