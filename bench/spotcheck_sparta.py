"""`python -m bench spotcheck-sparta`: the replay spot-check of sparta rounds, every lease checked (rate 1),
in fp32 and under bf16 autocast.

Two workers train a tiny model with the worker's own code (worker.trainer.LocalTrainer): sparta rounds
on replicas they keep, exchanging with one centre every `every` steps through the worker's own
exchange path (worker/exchanges.py, its corrections arriving asynchronously), the centre moved by
the coordinator's rule (sparta.mix_into_centre). Worker A's every lease is checked as the coordinator
checks it (coordinator/services/spotchecks.py's pieces: start_state.decode / incomplete(replica) /
implausible, spotcheck.replay_exchanges from the committed state, a control replay on another shard,
exchange_vectors, compare_committed), its exchanges against:

    honest   what A's round sent, committing to the state its round started from
    idle     A trained nothing: its replica's values as the round started, at each exchange's indices
    shifted  A's round trained on another shard (one training passed off for another lease)
    stale    A's round trained from its previous round's start (the state it commits to is the current)
    borrowed B's live values at A's exchanges' indices (another worker's training)

Every false kind commits to A's own state (its best chance). Writes results.json, results.md and
pass.png under --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

from bench.spotcheck import add_common, checked_out, interval, shard, show, write_outputs
from shared import codec, protocol
from shared.algorithms import sparta
from shared.algorithms import spotcheck as sc
from shared.algorithms import start_state
from shared.config import CompressionConfig, InnerConfig, SpartaConfig
from shared.model import ModelConfig, build_model, get_params, param_schema
from worker.fit import FitOptions
from worker.trainer import LocalTrainer

MODEL = ModelConfig(n_layer=1, d_model=32, n_head=2, context=32)  # 23,008 parameters
INNER = InnerConfig(steps=20, batch_size=4, warmup_steps=10)
LR = 2e-3
KINDS = ("honest", "idle", "shifted", "stale", "borrowed")
SCHEMA = param_schema(build_model(MODEL))


def lease(*, lease_id: int, seed: int, cfg: SpartaConfig) -> protocol.Lease:
    return protocol.Lease(lease_id=lease_id, run="b", shard_id=lease_id, shard_sha256="0" * 64, base_version=0,
                          seed=seed, lr=LR, inner=INNER, compression=CompressionConfig(), model=MODEL.to_dict(),
                          deadline=datetime(2030, 1, 1, tzinfo=UTC), algorithm="sparta", sparta=cfg)


class Centre:
    """The global model's exchange side: the coordinator's mixing rule, and what each exchange sent."""

    def __init__(self, params: dict[str, torch.Tensor], cfg: SpartaConfig) -> None:
        self.params, self.cfg = {n: t.clone() for n, t in params.items()}, cfg
        self.sent: dict[int, dict[int, bytes]] = {}  # lease -> step -> body
        self.answers: dict[int, dict[int, bytes]] = {}  # lease -> step -> the correction answered

    def exchange_for(self, lease_id: int):
        def exchange(step: int, body: bytes) -> bytes:
            self.sent.setdefault(lease_id, {})[step] = body
            sent = codec.decode(body, schema=SCHEMA)
            answer = codec.encode(sparta.mix_into_centre(self.params, sent, alpha=self.cfg.alpha,
                                                         values=self.cfg.values))
            self.answers.setdefault(lease_id, {})[step] = answer
            return answer
        return exchange


@dataclasses.dataclass
class Checked:
    lease: protocol.Lease
    tokens: torch.Tensor
    other: torch.Tensor  # another shard: the control's, and the shifted cheat's
    start: bytes  # the committed state
    sent: dict[int, codec.Delta]  # honest exchanges by step
    borrowed: dict[int, codec.Delta]  # B's values at the same indices, same steps
    corrections: dict[int, list[codec.Delta]]  # local step -> the corrections A applied after it


def trial(t: int, *, rounds: int, precision: str, cfg: SpartaConfig) -> list[Checked]:
    a, b = (LocalTrainer(torch.device("cpu"), fit=FitOptions(precision=precision)) for _ in range(2))
    centre = Centre(get_params(build_model(MODEL, seed=1000 + t)), cfg)
    out = []
    for k in range(rounds):
        la = lease(lease_id=2 * k + 1, seed=(t * 7919 + k * 31) % 2**31, cfg=cfg)
        lb = lease(lease_id=2 * k + 2, seed=(t * 7919 + k * 31 + 1) % 2**31, cfg=cfg)
        ta, tb = shard(t * 1000 + 2 * k), shard(t * 1000 + 2 * k + 1)
        starts: list[bytes] = []
        base = dict(centre.params) if a.needs_snapshot(la) else None
        result = a.train_round(la, base, ta, on_start=starts.append, exchange=centre.exchange_for(la.lease_id))
        steps = sorted(centre.sent.get(la.lease_id, {}))
        borrowed: dict[int, codec.Delta] = {}

        def peek(step: int, loss: float) -> None:  # B's weights at A's exchanges' indices
            if step in steps:
                borrowed[step] = sparta.select(dict(b.model.named_parameters()), p=cfg.p,
                                               seed=sparta.exchange_seed(la.seed, step), values="fp32")

        base = dict(centre.params) if b.needs_snapshot(lb) else None
        b.train_round(lb, base, tb, on_step=peek, exchange=centre.exchange_for(lb.lease_id))
        sent = {s: codec.decode(body, schema=SCHEMA) for s, body in centre.sent[la.lease_id].items()}
        corrections: dict[int, list[codec.Delta]] = {}
        for s, after in sorted(result.exchanges_applied_at.items()):
            corrections.setdefault(after, []).append(codec.decode(centre.answers[la.lease_id][s], schema=SCHEMA))
        out.append(Checked(la, ta, shard(t * 1000 + 900 + k), starts[0], sent, borrowed, corrections))
    return out


def state_of(blob: bytes) -> start_state.StartState:
    st = start_state.judge(blob, schema=SCHEMA, group=False, replica=True, beta1=INNER.beta1, beta2=INNER.beta2)
    if isinstance(st, str):
        raise ValueError(st)
    return st


def replayed(c: Checked, st: start_state.StartState, tokens: torch.Tensor, batch_seed: int) -> dict[int, codec.Delta]:
    return sc.replay_exchanges(MODEL, INNER, st.params, tokens, lr=LR, batch_seed=batch_seed,
                               lease_seed=c.lease.seed, steps=sorted(c.sent), cfg=c.lease.sparta, start=st,
                               corrections=c.corrections)


def as_sent(values: dict[int, codec.Delta], cfg: SpartaConfig) -> dict[int, codec.Delta]:
    """Raw values as an exchange carries them (rounded by the run's value codec on the wire)."""
    kind = sparta.VALUE_KINDS[cfg.values]
    return {s: codec.decode(codec.encode(codec.Delta(d.base_version, tuple(dataclasses.replace(e, value_kind=kind)
                                                                         for e in d.entries))), schema=SCHEMA)
            for s, d in values.items()}


def check_trial(checked: list[Checked]) -> list[dict]:
    rows = []
    for k, c in enumerate(checked):
        st = state_of(c.start)
        own = replayed(c, st, c.tokens, c.lease.seed)
        control = replayed(c, st, c.other, c.lease.seed ^ sc.CONTROL_SEED)
        steps = sorted(c.sent)
        idle = {s: sparta.select(st.params, p=c.lease.sparta.p, seed=sparta.exchange_seed(c.lease.seed, s),
                                 values="fp32") for s in steps}
        cheats = {"honest": c.sent, "idle": as_sent(idle, c.lease.sparta),
                  "shifted": as_sent(replayed(c, st, c.other, c.lease.seed), c.lease.sparta),
                  "stale": as_sent(replayed(c, state_of(checked[k - 1].start), c.tokens, c.lease.seed),
                                   c.lease.sparta) if k else None,
                  "borrowed": as_sent(c.borrowed, c.lease.sparta)}
        for kind, sent in cheats.items():
            if sent is None:
                continue
            values, ref, rounded, ctl = sc.exchange_vectors(sent, own, control, st.params)
            verdict = sc.compare_committed(values, ref, rounded, ctl)
            rows.append({"lease": k, "later": k > 0, "kind": kind, "passed": verdict.passed,
                         "cosine": verdict.cosine, "exchanges": len(sent), "reason": verdict.reason})
    return rows


def run(*, trials: int, rounds: int, precisions: list[str], configs: list[SpartaConfig], out: Path,
        threads: int = 1) -> dict:
    torch.set_num_threads(threads)
    rows, t0 = [], time.monotonic()
    for cfg in configs:
        for precision in precisions:
            for t in range(trials):
                for row in check_trial(trial(t, rounds=rounds, precision=precision, cfg=cfg)):
                    rows.append({**row, "trial": t, "precision": precision, "p": cfg.p, "every": cfg.every})
    table = []
    for key in sorted({(r["p"], r["every"], r["precision"], r["kind"]) for r in rows},
                      key=lambda x: (x[0], x[1], x[2], KINDS.index(x[3]))):
        sel = [r for r in rows if (r["p"], r["every"], r["precision"], r["kind"]) == key]
        k = sum(r["passed"] for r in sel)
        cos = sorted(r["cosine"] for r in sel if r["cosine"] == r["cosine"])
        table.append({"p": key[0], "every": key[1], "precision": key[2], "kind": key[3], "checks": len(sel),
                      "passed": k, "pass_rate": k / len(sel), "pass_interval": interval(k, len(sel)),
                      "cosine_min": cos[0] if cos else None, "cosine_max": cos[-1] if cos else None})
    honest = [r for r in rows if r["kind"] == "honest"]
    false = [r for r in rows if r["kind"] != "honest"]
    result = {
        "goals": {"honest_pass_rate_min": 0.995, "false_fail_rate_min": 0.95},
        "summary": {"honest_pass_rate": sum(r["passed"] for r in honest) / max(1, len(honest)),
                    "honest_checks": len(honest),
                    "false_fail_rate": 1 - sum(r["passed"] for r in false) / max(1, len(false)),
                    "false_checks": len(false),
                    "worst_false_pass_rate": max((s["pass_rate"] for s in table if s["kind"] != "honest"), default=0.0),
                    "seconds": round(time.monotonic() - t0, 1)},
        "config": {"model": dataclasses.asdict(MODEL), "inner": INNER.model_dump(), "lr": LR, "trials": trials,
                   "rounds": rounds, "precisions": precisions, "sparta": [c.model_dump() for c in configs],
                   "threads": threads},
        "table": table, "rows": rows}
    return write_outputs(result, out, report=report, plot=plot)


def report(result: dict) -> str:
    s, c = result["summary"], result["config"]
    lines = [f"# Sparta spot-check verdicts at rate 1 ({c['trials']} trials x {c['rounds']} leases per "
             f"configuration, {s['seconds']} s)", "",
             f"honest passed {s['honest_pass_rate']:.4f} of {s['honest_checks']}; false exchanges failed "
             f"{s['false_fail_rate']:.4f} of {s['false_checks']} (worst kind passes {s['worst_false_pass_rate']:.4f}); "
             "goals: >= 0.995 and >= 0.95", "",
             "| p | every | precision | exchanges of | checks | passed | 95% interval | cosine min-max |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["table"]:
        lo, hi = r["pass_interval"]
        cos = f"{r['cosine_min']:.4f}-{r['cosine_max']:.4f}" if r["cosine_min"] is not None else "-"
        lines.append(f"| {r['p']:g} | {r['every']} | {r['precision']} | {r['kind']} | {r['checks']} | "
                     f"{r['pass_rate']:.3f} | {lo:.3f}-{hi:.3f} | {cos} |")
    return "\n".join(lines + [""])


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["table"]
    labels = [f"{r['kind']}\n{r['precision']} p{r['p']:g}/{r['every']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, len(rows) * 0.7), 3.6))
    ax.bar(range(len(rows)), [r["pass_rate"] for r in rows],
           color=["tab:green" if r["kind"] == "honest" else "tab:red" for r in rows])
    ax.set_xticks(range(len(rows)), labels, fontsize=6)
    ax.set_ylabel("share of checks passing")
    ax.set_ylim(0, 1.05)
    ax.set_title("sparta rounds' replay spot-check at rate 1 (green: honest; red: false)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_parser(sub) -> None:
    p = sub.add_parser("spotcheck-sparta", help="honest and false sparta exchanges against the replay spot-check "
                                                "at rate 1, fp32 and bf16 autocast")
    add_common(p, name="spotcheck-sparta", trials=10, rounds=5, per="configuration")
    p.add_argument("--p", nargs="+", type=float, default=[0.001, 0.01], help="sparta.p values to try")
    p.add_argument("--every", nargs="+", type=int, default=[1, 4], help="sparta.every values to try")
    p.set_defaults(func=cmd)


def cmd(args: argparse.Namespace) -> int:
    out = checked_out(args, "spotcheck-sparta")
    if isinstance(out, int):
        return out
    configs = [SpartaConfig(p=p, every=e) for p in args.p for e in args.every]
    run(trials=args.trials, rounds=args.rounds, precisions=args.precision, configs=configs, out=out,
        threads=args.threads)
    return show(out)
