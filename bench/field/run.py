"""`python -m bench field`: the profiles, the order rows run in, the choices, results.json.

Per seed: the lone worker at every lr of the sweep (at once, each on its own capped core share; they also
measure the step time that sizes the idletrain run's schedule), the idletrain row, then the data-parallel
rows: ring fp32 at every lr, and the other variants (ps fp32, ring bf16, PowerSGD, int8) at every lr too
with --sweep-all, else at the lr ring fp32 chose; ring fp32 on unshaped links (the ideal); and with
--hivemind-python, hivemind's Optimizer with local updates at every lr. Every lr is chosen on the
validation slice (its final loss at the row's end); every reported number is on the test slice (the
coordinator's eval tokens).
Every row tried stays in results.json.
"""

from __future__ import annotations

import json
import logging
import statistics
import sys
import threading
from pathlib import Path

from bench.field import report
from bench.field.data import data_spec, field_tokens, slices, stage_shards
from bench.field.net import Field
from bench.field.rows import evaluate_checkpoints, run_ddp, run_idletrain

log = logging.getLogger(__name__)

PROFILES = {
    # a smoke profile: every row kind for a few minutes on one seed (~35 min on 2 cores)
    "quick": {"workers": 8, "duration_s": 180, "seeds": [0], "lrs": [2e-3, 4e-3, 8e-3],
              "ddp_lrs": [2e-3, 4e-3, 8e-3, 16e-3],
              "model": {"n_layer": 2, "n_head": 2, "d_model": 64, "context": 64}, "batch": 8,
              "eval_tokens": 16384, "save_every_s": 10, "powersgd_rank": 4},
    # the issue's: ~1M parameters, 15 minutes a row, three seeds (~10 h on 2 cores)
    "full": {"workers": 8, "duration_s": 900, "seeds": [0, 1, 2], "lrs": [1e-3, 2e-3, 4e-3, 8e-3],
             "model": {"n_layer": 4, "n_head": 4, "d_model": 128, "context": 128}, "batch": 8,
             "eval_tokens": 32768, "save_every_s": 20, "powersgd_rank": 8},
    # the tests': two workers, a tiny model, seconds
    "tiny": {"workers": 2, "duration_s": 25, "seeds": [0], "lrs": [4e-3],
             "model": {"n_layer": 1, "n_head": 2, "d_model": 32, "context": 32}, "batch": 4,
             "eval_tokens": 4096, "save_every_s": 5, "powersgd_rank": 2},
}
VARIANTS = [("ps", "fp32"), ("ring", "bf16"), ("ring", "powersgd"), ("ring", "int8"), ("ps", "int8")]
INNER = {"weight_decay": 0.1, "grad_clip": 1.0, "warmup_steps": 50}  # the run's inner defaults (shared/config.py)


def _run_config(p: dict, *, seed: int, step_s: float, corpus: str) -> dict:
    """The idletrain run: the field's model, batch, data and group; its schedule the tokens the row's time
    allows at the measured step time (so a run of that length gets its regime's defaults); the rest default."""
    planned = int(p["duration_s"] / step_s)
    tokens = p["workers"] * p["batch"] * p["model"]["context"] * planned
    return {"name": f"field{seed}", "corpus": corpus, "corpus_max_bytes": 16 << 20, "shard_tokens": 1 << 16,
            "eval_tokens": p["eval_tokens"], "eval_every": p["workers"], "epochs": 0, "seed": seed,
            "model": p["model"], "inner": {"batch_size": p["batch"]}, "outer": {"group": p["workers"]},
            "schedule_tokens": tokens, "lease_ttl_s": 600}


def _ddp_spec(p: dict, *, mode: str, comm: str, lr: float, seed: int, data: dict, workers: int) -> dict:
    return {"mode": mode, "comm": comm, "lr": lr, "seed": seed, "model_seed": seed, "workers": workers,
            "model": p["model"], "inner": {**INNER, "batch_size": p["batch"]}, "data": data,
            "duration_s": p["duration_s"], "save_every_s": p["save_every_s"], "powersgd_rank": p["powersgd_rank"]}


FREE = "fp32 free links"


def _name(mode: str, comm: str) -> str:
    return {"alone": "alone", "hivemind": "hivemind"}.get(mode, f"{mode} {comm}")


def run(*, profile: str, out: Path, corpus: str = "builtin:stdlib", sweep_all: bool = False,
        cpu_share: float = 0.15, coord_share: float = 0.4, keep: bool = False, keep_checkpoints: bool = False,
        hivemind_python: str | None = None, command: str = "") -> dict:
    p = PROFILES[profile]
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / "results.json"
    before = json.loads(results_path.read_text()) if keep and results_path.exists() else {}
    rows: list[dict] = before.get("rows", [])
    superseded = before.get("superseded", [])  # rows an earlier try ran on code since fixed, and why
    done = {(r["method"], r["lr"], r["seed"]) for r in rows}
    n = p["workers"]
    meta = {"profile": profile, **{k: p[k] for k in ("workers", "duration_s", "seeds", "lrs", "model", "batch",
                                                      "eval_tokens")},
            "corpus": corpus, "cpu_share": cpu_share, "coord_share": coord_share, "links_mbit":
            {"worker_up": 10, "worker_down": 50, "coordinator": 1000}, "latency": "none added (no netem here)",
            "sweep_all": sweep_all, "hivemind": "run" if hivemind_python else "not run (no --hivemind-python)",
            "command": command}

    lock = threading.Lock()

    def save() -> None:
        report.write_outputs({**report.summarise(rows, meta), "superseded": superseded}, out)

    with Field(max(n, len(p["lrs"])), cpu_share=cpu_share) as field:
        for seed in p["seeds"]:
            run_cfg = _run_config(p, seed=seed, step_s=1.0, corpus=corpus)  # data only; the schedule comes later
            data = data_spec(run_cfg)
            shards, held = field_tokens(data)  # the corpus, read and cut once for every row of the seed
            evals = slices(held, data["eval_tokens"])
            staged = stage_shards(shards, out / f"shards-s{seed}.npy")

            def ddp(mode: str, comm: str, lr: float, workers: int, slot: int = 0, extra: dict | None = None,
                    python: str = sys.executable) -> None:
                if (_name(mode, comm), lr, seed) in done:
                    return
                spec = {**_ddp_spec(p, mode=mode, comm=comm, lr=lr, seed=seed, data=data, workers=workers),
                        **(extra or {})}
                where = out / "rows" / f"{_name(mode, comm).replace(' ', '-')}-lr{lr:g}-s{seed}"
                log.info("field: %s lr %g seed %d", _name(mode, comm), lr, seed)
                got = run_ddp(field, {**spec, "slot": slot, "shards": str(staged)}, out=where, coord_share=coord_share,
                              python=python)
                got["curve"] = evaluate_checkpoints(where, p["model"], evals, keep=keep_checkpoints)
                with lock:
                    rows.append({"method": _name(mode, comm), "lr": lr, "seed": seed, **got})
                    save()

            # the lone worker at every lr at once, each on its own namespace and capped share
            if any(("alone", lr, seed) not in done for lr in p["lrs"]):
                threads = [threading.Thread(target=ddp, args=("alone", "fp32", lr, 1, i))
                           for i, lr in enumerate(p["lrs"])]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
            alone = [r for r in rows if r["method"] == "alone" and r["seed"] == seed]
            step_s = statistics.median(r["step_s_mean"] for r in alone)
            if ("idletrain", None, seed) not in done:
                cfg = _run_config(p, seed=seed, step_s=step_s, corpus=corpus)
                log.info("field: idletrain seed %d (%d workers, %.0f s, step %.3f s)", seed, n, p["duration_s"],
                         step_s)
                got = run_idletrain(field, cfg, workers=n, duration_s=p["duration_s"],
                                    out=out / "rows" / f"idletrain-s{seed}", coord_share=coord_share)
                rows.append({"method": "idletrain", "lr": None, "seed": seed, "run": cfg, **got})
                save()
            for lr in p.get("ddp_lrs", p["lrs"]):  # (quick: its best was at the top of the first sweep)
                ddp("ring", "fp32", lr, n)
            chosen = report.choose_lr([r for r in rows if r["method"] == "ring fp32" and r["seed"] == seed])
            for mode, comm in VARIANTS:
                for lr in (p["lrs"] if sweep_all else [chosen]):
                    ddp(mode, comm, lr, n)
            with field.free_links():  # the ideal, beside: data-parallel on unshaped links
                ddp("ring", FREE, chosen, n)
            if hivemind_python:  # the public volunteer-training library, its lr swept too
                ours = next(r for r in rows if r["method"] == "idletrain" and r["seed"] == seed)
                target = n * ours["config"]["inner"]["steps"] * p["batch"]  # samples between averagings
                for lr in p["lrs"]:
                    ddp("hivemind", "fp16", lr, n, extra={"target_batch_size": target}, python=hivemind_python)
    results = {**report.summarise(rows, meta), "superseded": superseded}
    report.write_outputs(results, out)
    return results
