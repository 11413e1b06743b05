"""`python -m bench spotcheck`: how often the replay spot-check passes honest rounds and fails false ones,
every lease checked (rate 1), on first and later leases, in fp32 and under bf16 autocast.

Two workers train a tiny model in lockstep with the worker's own code (worker.trainer.LocalTrainer, the
default int4 compression with error feedback): each round both start from the global model, which
then moves by half the sum of their deltas. Worker A's every lease is checked as the coordinator
checks it (coordinator/services/spotchecks.py's pieces: start_state.decode / incomplete / implausible,
spotcheck.replay_round from the committed start state, the second-moment screen, compare on the
delta's support with the delta's own rounding, EXACT bounds, and the control replay's test of what
the round's data added: spotcheck.compare_committed), against:

    honest      A's own delta, committing to the state its round started from
    replayed    A's first delta, re-encoded for this lease and scaled by 1 + 1e-3 x lease (the issue's)
    borrowed    B's delta of the same base (another shard, another worker's state)
    stale       A's delta of its previous lease, sent again for this one
    crafted     B's delta, committing to A's state with its first moment turned towards B's delta as far
                as AdamW's moments allow (|m| = moment_bound x sqrt(v)), the second moment as it is
                and raised 50x (so that the state, not the round's gradients, steers the replay)

A false delta may commit to any state: it counts as passing if any of the states it could name passes
(A's own, a fresh AdamW, A's previous one). `before` is the check as it was without a commitment (a
later lease against a fresh-AdamW replay, CARRIED bounds). Writes results.json, results.md and
pass.png under --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

from shared import codec, protocol
from shared.algorithms import spotcheck as sc
from shared.algorithms import start_state
from shared.algorithms.compress import compress_with_feedback
from shared.config import CompressionConfig, InnerConfig
from shared.model import ModelConfig, build_model, get_params, param_schema
from worker.fit import FitOptions
from worker.trainer import LocalTrainer

MODEL = ModelConfig(n_layer=1, d_model=32, n_head=2, context=32)  # 23,008 parameters
INNER = InnerConfig(steps=20, batch_size=4, warmup_steps=10)
LR = 2e-3
WORDS = ("the of and to in is that for it with as was on be by this are def return self import class none "
         "true false if else while for try except lambda yield").split()
KINDS = ("honest", "replayed", "borrowed", "stale", "crafted")


def shard(i: int) -> torch.Tensor:
    rng = random.Random(i)
    text = " ".join(rng.choice(WORDS) for _ in range(3000)).encode()[:12288]
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).clone()


def lease(*, lease_id: int, seed: int, version: int) -> protocol.Lease:
    return protocol.Lease(lease_id=lease_id, run="b", shard_id=lease_id, shard_sha256="0" * 64, base_version=version,
                          seed=seed, lr=LR, inner=INNER, compression=CompressionConfig(), model=MODEL.to_dict(),
                          deadline=datetime(2030, 1, 1, tzinfo=UTC))


@dataclasses.dataclass
class Round:
    lease: protocol.Lease
    base: dict[str, torch.Tensor]
    tokens: torch.Tensor
    body: bytes
    start: bytes
    control: torch.Tensor  # the shard the coordinator's control replay runs on (another one)


SCHEMA = param_schema(build_model(MODEL))


def decoded(body: bytes) -> codec.Delta:
    return codec.decode(body, schema=SCHEMA)


def reencoded(body: bytes, *, version: int, seed: int, scale: float) -> bytes:
    """A delta's values, scaled, encoded again for another lease (the bytes differ)."""
    dense = {n: torch.from_numpy(v).reshape(SCHEMA[n]) * scale for n, v in decoded(body).to_dense(SCHEMA).items()}
    delta, _ = compress_with_feedback(dense, None, CompressionConfig(), base_version=version, round_seed=seed)
    return codec.encode(delta)


def trial(t: int, *, rounds: int, precision: str) -> list[tuple[Round, Round]]:
    """Two workers' rounds in lockstep: [(A's round k, B's round k)]."""
    a, b = (LocalTrainer(torch.device("cpu"), fit=FitOptions(precision=precision)) for _ in range(2))
    base = get_params(build_model(MODEL, seed=1000 + t))
    out = []
    for k in range(rounds):
        pair = []
        for w, trainer in enumerate((a, b)):
            lz = lease(lease_id=2 * k + w + 1, seed=(t * 7919 + k * 31 + w) % 2**31, version=k)
            tokens = shard(t * 1000 + 2 * k + w)
            starts: list[bytes] = []
            result = trainer.train_round(lz, dict(base), tokens, on_start=starts.append)
            pair.append(Round(lz, dict(base), tokens, result.body, starts[0], shard(t * 1000 + 900 + 2 * k + w)))
        out.append(tuple(pair))
        moved = [decoded(r.body).to_dense(SCHEMA) for r in pair]
        base = {n: base[n] - 0.5 * sum(torch.from_numpy(m[n]).reshape(SCHEMA[n]) for m in moved) for n in base}
    return out


def crafted(state: bytes, toward: bytes, *, v_scale: float) -> bytes:
    """`state` with its first moment turned towards `toward`'s direction as far as AdamW's moments allow."""
    st = start_state.decode(state, schema=SCHEMA, limit=start_state.max_bytes(SCHEMA))
    if st.fresh:
        return state
    c = start_state.moment_bound(INNER.beta1, INNER.beta2)
    d = {n: torch.from_numpy(v).reshape(SCHEMA[n]) for n, v in decoded(toward).to_dense(SCHEMA).items()}
    top = max(float(x.abs().max()) for x in d.values()) or 1.0
    tensors = {}
    for name, per in st.optimizer.tensors.items():
        v = per["exp_avg_sq"] * v_scale
        tensors[name] = {**per, "exp_avg_sq": v, "exp_avg": c * v.sqrt() * (d[name] / top)}
    opt = dataclasses.replace(st.optimizer, tensors=tensors)
    return start_state.encode(opt, st.residual, steps_done=st.steps_done)


class Checker:
    """The coordinator's check of one lease, its replays cached by (lease, state)."""

    def __init__(self) -> None:
        self.replays: dict[tuple[int, str], tuple[dict, str | None]] = {}

    def replay(self, r: Round, state: bytes | None) -> tuple[dict | None, str | None]:
        key = (r.lease.lease_id, start_state.sha256(state) if state is not None else "")
        if key not in self.replays:
            self.replays[key] = self._replay(r, state)
        return self.replays[key]

    def _replay(self, r: Round, blob: bytes | None):
        st = None
        if blob is not None:
            st = start_state.judge(blob, schema=SCHEMA, group=False, replica=False, beta1=INNER.beta1,
                                   beta2=INNER.beta2)
            if isinstance(st, str):
                return None, st
        pg = sc.replay_round(MODEL, INNER, r.base, r.tokens, lr=LR, seed=r.lease.seed, start=st)
        control = None if st is None else sc.replay_round(MODEL, INNER, r.base, r.control, lr=LR,
                                                          seed=r.lease.seed ^ sc.CONTROL_SEED, start=st)
        return (pg, control), None

    def verdict(self, r: Round, body: bytes, state: bytes | None, bounds=sc.EXACT) -> tuple[bool, float]:
        replays, why = self.replay(r, state)
        if replays is None:
            return False, math.nan
        pg, control = replays
        sent = decoded(body)
        values, ref = sc.on_support(sent, pg)
        rounded = sc.rounded_on_support(sent, pg)
        if control is None:
            cmp = sc.compare(values, ref, bounds, rounded=rounded)
        else:
            cmp = sc.compare_committed(values, ref, rounded, sc.on_support(sent, control)[1])
        return cmp.passed, cmp.cosine


def check_trial(pairs: list[tuple[Round, Round]], checker: Checker) -> list[dict]:
    rows = []
    first_a = pairs[0][0]
    for k, (a, b) in enumerate(pairs):
        own, fresh = a.start, start_state.encode(None, {}, steps_done=0)
        prev = pairs[k - 1][0].start if k else own
        bodies = {
            "honest": (a.body, [own]),
            "replayed": (reencoded(first_a.body, version=a.lease.base_version, seed=a.lease.seed,
                                   scale=1 + 1e-3 * k) if k else None, [own, fresh, prev]),
            "borrowed": (b.body, [own, fresh, prev]),
            "stale": (pairs[k - 1][0].body if k else None, [own, fresh, prev]),
            "crafted": (b.body, [crafted(own, b.body, v_scale=1.0), crafted(own, b.body, v_scale=50.0)]),
        }
        for kind, (body, states) in bodies.items():
            if body is None:
                continue
            verdicts = [checker.verdict(a, body, s) for s in states]
            passed = any(p for p, _ in verdicts)
            before, cos_before = checker.verdict(a, body, None, sc.EXACT if k == 0 else sc.CARRIED)
            rows.append({"lease": k, "later": k > 0, "kind": kind, "passed": passed,
                         "cosine": max(c for _, c in verdicts if not math.isnan(c)) if any(
                             not math.isnan(c) for _, c in verdicts) else None,
                         "passed_before": before, "cosine_before": cos_before})
    return rows


def interval(k: int, n: int) -> tuple[float, float]:
    """The 95% Wilson interval of a share k / n."""
    if n == 0:
        return (math.nan, math.nan)
    z, p = 1.96, k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def summarise(rows: list[dict]) -> list[dict]:
    out = []
    for precision in sorted({r["precision"] for r in rows}):
        for kind in KINDS:
            for later in (False, True):
                sel = [r for r in rows if r["precision"] == precision and r["kind"] == kind and r["later"] == later]
                if not sel:
                    continue
                k, kb = sum(r["passed"] for r in sel), sum(r["passed_before"] for r in sel)
                out.append({"precision": precision, "kind": kind, "lease": "later" if later else "first",
                            "checks": len(sel), "passed": k, "pass_rate": k / len(sel),
                            "pass_interval": interval(k, len(sel)), "passed_before": kb,
                            "pass_rate_before": kb / len(sel)})
    return out


def run(*, trials: int, rounds: int, precisions: list[str], out: Path, threads: int = 1) -> dict:
    torch.set_num_threads(threads)
    rows, checker, t0 = [], Checker(), time.monotonic()
    for precision in precisions:
        for t in range(trials):
            for row in check_trial(trial(t, rounds=rounds, precision=precision), checker):
                rows.append({**row, "trial": t, "precision": precision})
            checker.replays.clear()
    table = summarise(rows)
    honest = [s for s in table if s["kind"] == "honest"]
    false = [s for s in table if s["kind"] != "honest"]
    result = {
        "goals": {"honest_pass_rate_min": 0.995, "false_fail_rate_min": 0.95},
        "summary": {
            "honest_pass_rate": sum(s["passed"] for s in honest) / max(1, sum(s["checks"] for s in honest)),
            "honest_checks": sum(s["checks"] for s in honest),
            "false_fail_rate": 1 - sum(s["passed"] for s in false) / max(1, sum(s["checks"] for s in false)),
            "false_checks": sum(s["checks"] for s in false),
            "worst_false_pass_rate": max((s["pass_rate"] for s in false), default=0.0),
            "seconds": round(time.monotonic() - t0, 1)},
        "config": {"model": dataclasses.asdict(MODEL), "inner": INNER.model_dump(), "lr": LR, "trials": trials,
                   "rounds": rounds, "precisions": precisions, "threads": threads},
        "table": table, "rows": rows}
    return write_outputs(result, out, report=report, plot=plot)


def write_outputs(result: dict, out: Path, *, report, plot) -> dict:
    """results.json, results.md (report) and pass.png (plot) under `out`; returns `result`."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=1))
    (out / "results.md").write_text(report(result))
    plot(result, out / "pass.png")
    return result


def report(result: dict) -> str:
    s = result["summary"]
    lines = [f"# Spot-check verdicts at rate 1 ({result['config']['trials']} trials x "
             f"{result['config']['rounds']} leases, {s['seconds']} s)", "",
             f"honest passed {s['honest_pass_rate']:.4f} of {s['honest_checks']}; false deltas failed "
             f"{s['false_fail_rate']:.4f} of {s['false_checks']} (worst kind passes {s['worst_false_pass_rate']:.4f}); "
             f"goals: >= 0.995 and >= 0.95", "",
             "| precision | delta | lease | checks | passed | 95% interval | passed before (no commitment) |",
             "|---|---|---|---|---|---|---|"]
    for r in result["table"]:
        lo, hi = r["pass_interval"]
        lines.append(f"| {r['precision']} | {r['kind']} | {r['lease']} | {r['checks']} | {r['pass_rate']:.3f} | "
                     f"{lo:.3f}-{hi:.3f} | {r['pass_rate_before']:.3f} |")
    lines += [""]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    later = [r for r in result["table"] if r["lease"] == "later"]
    labels = [f"{r['kind']}\n{r['precision']}" for r in later]
    x = range(len(later))
    fig, ax = plt.subplots(figsize=(max(6, len(later) * 0.9), 3.6))
    ax.bar([i - 0.2 for i in x], [r["pass_rate_before"] for r in later], 0.4, label="before (no commitment)")
    ax.bar([i + 0.2 for i in x], [r["pass_rate"] for r in later], 0.4, label="committed start state")
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_ylabel("share of later leases passing")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=7)
    ax.set_title("replay spot-check at rate 1, later leases", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_common(p, *, name: str, trials: int, rounds: int, per: str) -> None:
    """The options both spot-check benchmarks take (their defaults, and what a trial is per)."""
    p.add_argument("--trials", type=int, default=trials, help=f"independent pairs of workers per {per}")
    p.add_argument("--rounds", type=int, default=rounds, help="leases per worker (the first is a first lease)")
    p.add_argument("--precision", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None, help=f"output folder (default bench-results/{name})")


def checked_out(args: argparse.Namespace, name: str) -> Path | int:
    """The output folder, or fail()'s exit status when --trials or --rounds is out of range."""
    from idletrain.cli.common import fail

    if args.trials < 1 or args.rounds < 2:
        return fail("--trials must be at least 1 and --rounds at least 2 (a first lease and a later one)")
    return Path(args.out or f"bench-results/{name}")


def show(out: Path) -> int:
    print((out / "results.md").read_text())
    print(f"wrote {out / 'results.json'}, {out / 'results.md'}, {out / 'pass.png'}")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("spotcheck", help="honest and false deltas against the replay spot-check at rate 1: first "
                                         "and later leases, fp32 and bf16 autocast")
    add_common(p, name="spotcheck", trials=40, rounds=6, per="precision")
    p.set_defaults(func=cmd)


def cmd(args: argparse.Namespace) -> int:
    out = checked_out(args, "spotcheck")
    if isinstance(out, int):
        return out
    run(trials=args.trials, rounds=args.rounds, precisions=args.precision, out=out, threads=args.threads)
    return show(out)
