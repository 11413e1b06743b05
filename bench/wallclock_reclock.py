"""`python -m bench wallclock --reclock DIR --step-ms MS`: an earlier wallclock run's curves on new clocks.

Training does not depend on the links or on the step time charged, so a run's results.json holds all
a clock needs: each row's curve of loss against tokens and its traffic (bench/wallclock_clock.py
RowTraffic). This puts those curves on the links given now, charging `step_ms` per worker step: for
a step time measured on a quiet machine when the run itself was timed under load, or another
machine's. The compressors' own times (ddp's per step, diloco's per round), measured in the same run
under the same load as its step, are scaled by the same factor as the step (new step / old step).
"""

from __future__ import annotations

import json
from pathlib import Path

from bench.links import Link
from bench.sim import Method, Result
from bench.wallclock import DATACENTER, Row, link_sets
from bench.wallclock_clock import Compute, RowTraffic, clock_all
from bench.wallclock_report import summarise, write_outputs


def _traffic(d: dict, scale: float) -> RowTraffic:
    return RowTraffic(**{**d, "exchange_bytes": tuple(d["exchange_bytes"]), "extra_step_s": d["extra_step_s"] * scale,
                         "extra_round_s": d["extra_round_s"] * scale})


def rows_from(results: dict, *, scale: float = 1.0) -> list[tuple[Row, list[dict]]]:
    """summarise's input, before the clocks, rebuilt from a wallclock results.json; the compressors'
    measured times multiplied by `scale`."""
    trained = []
    for r in results["rows"]:
        kind = {"ddp": "ddp", "alone": "alone"}.get(r["pattern"], "diloco")
        row = Row(r["row"], Method(r["row"], kind), r["pattern"], compressor=r["compressor"])
        runs = []
        for x in r["runs"]:
            curve = [(int(t), float(loss)) for t, loss in x["curve_tokens"]]
            result = Result(r["row"], curve, x["final_loss"], x["bytes_up_per_worker"], x["bytes_down_per_worker"],
                            x["train_wall_s"])
            runs.append({"lr": x["lr"], "result": result, "traffic": _traffic(x["traffic"], scale)})
        trained.append((row, runs))
    return trained


def run(*, source: Path, out: Path, step_ms: float, up_mbps: tuple[float, ...] = (10.0, 100.0, 1000.0),
        down_ratio: float = 5.0, rtt_ms: float = 30.0, hetero: float = 1.0,
        coordinator_mbps: float | None = 1000.0, command: str = "") -> dict:
    path = source / "results.json"
    if not path.exists():
        raise FileNotFoundError(f"no wallclock results in {source}: run `python -m bench wallclock --out {source}` first")
    old = json.loads(path.read_text())
    m = old["meta"]
    scale = step_ms / 1000 / m["step_s"]
    trained = rows_from(old, scale=scale)
    coordinator = Link.mbit(coordinator_mbps, coordinator_mbps, 0.0) if coordinator_mbps else None
    links = link_sets(up_mbps=list(up_mbps), down_ratio=down_ratio, rtt_ms=rtt_ms, workers=m["workers"], hetero=hetero)
    compute = Compute(step_s=step_ms / 1000, tokens_per_step=m["batch_per_worker"] * m["context"], workers=m["workers"])
    clock_all(trained, compute, links, coordinator=coordinator)
    meta = {**m, "step_s": round(step_ms / 1000, 5), "step_s_from": f"--step-ms, re-clocked from {source}",
            "compressor_times_scaled_by": round(scale, 4),
            "links": [ls[0].label() for ls in links], "datacenter_panel": DATACENTER.label(),
            "hetero_link_spread": hetero, "coordinator_mbps": coordinator_mbps,
            "command": command or m.get("command", ""), "trained_by": m.get("command", "")}
    results = summarise(trained, links=links, meta=meta)
    write_outputs(results, out)
    return results
