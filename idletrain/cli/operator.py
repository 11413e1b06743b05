"""The operator's commands against a running coordinator, all through one OperatorClient:
`idletrain run create|list|show|pause|resume` (set|finish|archive|delete: lifecycle.py), `idletrain worker
list|revoke|readmit`,
and `idletrain status` (the model's `export` and `sample`: model.py)."""

from __future__ import annotations

import argparse
import json
import sys
import tomllib
from pathlib import Path

from pydantic import ValidationError

from idletrain.cli.client import OperatorClient
from idletrain.cli.common import (ADMIN_TOKEN_HELP, DATA_DIR_HELP, DEFAULT_COORDINATOR, describe_validation, fail,
                                  ticking)
from idletrain.cli.lifecycle import describe, token_count
from shared import protocol
from shared.algorithms.registry import NAMES
from shared.config import LONG_RUN_LR_FACTOR, LONG_RUN_STEPS, RunConfig, choose_regime, planned_worker_steps
from shared.model import PRESETS

# -- runs -------------------------------------------------------------------------------------

def _set(d: dict, dotted: str, value) -> None:
    *parents, leaf = dotted.split(".")
    for p in parents:
        d = d.setdefault(p, {})
    d[leaf] = value


RUN_FLAGS = [  # (flag, dotted config key, type, help)
    ("--algorithm", "algorithm", str, " | ".join(NAMES) + f" (default: {RunConfig.model_fields['algorithm'].default})"),
    ("--model-preset", "model.preset", str, "a named model size: " + ", ".join(PRESETS) + " (the flags below "
     "override its fields)"),
    ("--arch", "model.arch", str, "gpt (GPT-2's block, the default) | llama (RMSNorm, rotary, SwiGLU)"),
    ("--vocab-size", "model.vocab_size", int, "the model's vocabulary: 256 for bytes, else the tokenizer's size"),
    ("--n-layer", "model.n_layer", int, "transformer layers"),
    ("--n-head", "model.n_head", int, "attention heads"),
    ("--d-model", "model.d_model", int, "model width"),
    ("--context", "model.context", int, "tokens per training sequence"),
    ("--corpus", "corpus", str, "builtin:stdlib, or a text file/folder on the coordinator's disk"),
    ("--data", "data", str, "a folder made by `idletrain data prepare`, on the coordinator's disk (instead of "
     "--corpus); --vocab-size must be its tokenizer's"),
    ("--corpus-max-bytes", "corpus_max_bytes", int, "read at most this much of the corpus"),
    ("--shard-tokens", "shard_tokens", int, "tokens per data shard"),
    ("--lease-ttl", "lease_ttl_s", float, "seconds before a lease expires"),
    ("--eval-every", "eval_every", int, "evaluate every N versions"),
    ("--eval-tokens", "eval_tokens", int, "held-out tokens per evaluation"),
    ("--schedule-tokens", "schedule_tokens", int, "tokens over which the inner lr decays"),
    ("--seed", "seed", int, "model init and lease seeds"),
    ("--join-key", "join_key", str, "workers must present this key to register"),
    ("--regime", "regime", str, "auto | short | long: the defaults of a short or a long run (auto: long for a "
     f"diloco run whose --schedule-tokens plan at least {LONG_RUN_STEPS} local steps a worker and that sets none of "
     "the fields the regime decides; docs/how-it-works.md)"),
    ("--steps", "inner.steps", int, "H: local steps per round"),
    ("--batch-size", "inner.batch_size", int, "sequences per local step"),
    ("--lr", "inner.lr", float, "peak inner learning rate"),
    ("--compression", "compression.index", str, "topk | random | dense"),
    ("--fraction", "compression.fraction", float, "share of elements sent per round"),
    ("--values", "compression.values", str, "fp32 | fp16 | int8 | int4 | int2 | int1"),
    ("--feedback-decay", "compression.feedback_decay", float, "the error-feedback residual's decay per round "
     "(default 1; SparseLoCo: 0.95 with --outer-momentum 0)"),
    ("--update-values", "update_values", str, "int8 | int4 | int2 | int1: the values of the model updates workers "
     "download (int2, int1: with --update-feedback true)"),
    ("--update-feedback", "update_feedback", str, "true | false: each model update is the change from the worker's "
     "own copy, kept by the coordinator (one fp32 model per worker on its disk), so rounding does not add up"),
    ("--outer-lr", "outer.lr", float, "outer learning rate"),
    ("--outer-momentum", "outer.momentum", float, "outer Nesterov momentum"),
    ("--outer-warmup", "outer.warmup", int, "momentum steps over which the outer lr ramps up linearly (default 0: "
     "none)"),
    ("--group", "outer.group", int, "deltas per outer momentum step (about the number of workers)"),
    ("--max-staleness", "outer.max_staleness", int, "versions a delta may lag before refusal"),
    ("--sparta-p", "sparta.p", float, "sparta: fraction of each tensor exchanged per exchange"),
    ("--sparta-every", "sparta.every", int, "sparta: local steps between exchanges"),
    ("--token-budget", "token_budget", token_count, "finish once this many tokens are trained (2e9, 500M ...)"),
    ("--epochs", "epochs", int, "finish after this many passes over the data; 0: repeat until the budget or `run "
     "finish` (default: 1 without --token-budget, as many as the budget takes with it)"),
    ("--priority", "priority", int, "workers following the coordinator train the active run of highest priority "
     "(default 0)"),
]


def build_run_config(name: str, config_path: str | None, flags: dict) -> RunConfig:
    return RunConfig.model_validate(run_data(name, config_path, flags))


def run_data(name: str, config_path: str | None, flags: dict) -> dict:
    """The run's fields as given: the TOML file's, then the flags' over them."""
    data: dict = {}
    if config_path:
        try:
            data = tomllib.loads(Path(config_path).read_text())
        except FileNotFoundError:
            raise ValueError(f"config file {config_path} does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"config file {config_path} is not valid TOML: {exc}") from None
    for key, value in flags.items():
        if value is not None:
            _set(data, key, value)
    data["name"] = name
    return data


def regime_note(data: dict, cfg: RunConfig) -> str | None:
    """Which defaults the run's regime gave it, and why (None: a run that did not leave them to it)."""
    regime = choose_regime(data)
    if regime == "long":
        planned = (f"{planned_worker_steps(data):,.0f} local steps a worker planned (at least {LONG_RUN_STEPS})"
                   if data.get("regime") != "long" else "regime long")
        given = "inner" in data and "lr" in (data["inner"] if isinstance(data["inner"], dict) else {})
        lr = (f"lr {cfg.inner.lr:g} as given (the long-run configuration takes {LONG_RUN_LR_FACTOR:g}x what plain "
              "AdamW takes)" if given else f"lr {cfg.inner.lr:g}")
        return (f"long-run defaults ({planned}): rounds of {cfg.inner.steps}, int1 both ways with updates from "
                f"the worker's copy, AdamW normalised for {cfg.inner.second_moment_workers} workers at {lr}, outer "
                f"lr {cfg.outer.lr:g} without momentum; regime = \"short\" keeps the short-run ones")
    steps = planned_worker_steps(data) if "schedule_tokens" in data else None
    if data.get("regime", "auto") == "auto" and cfg.algorithm == "diloco" and steps is not None:
        if steps < LONG_RUN_STEPS:
            return (f"short-run defaults: {steps:,.0f} local steps a worker planned, under the {LONG_RUN_STEPS} "
                    "from which the long-run ones win")
    return None


def cmd_run_create(args: argparse.Namespace) -> int:
    flags = {key: getattr(args, flag.lstrip("-").replace("-", "_")) for flag, key, _, _ in RUN_FLAGS}
    try:
        data = run_data(args.name, args.config, flags)
        cfg = RunConfig.model_validate(data)
    except ValidationError as exc:
        return fail(f"bad run config: {describe_validation(exc)}")
    except ValueError as exc:
        return fail(str(exc))
    with ticking(f"creating run {cfg.name!r}: the coordinator shards its data and trains one reference round "
                 f"of its {cfg.model.n_params():,}-parameter model (minutes for tens of millions on a few CPU cores)"):
        rc, created = OperatorClient(args).create_run(json.loads(cfg.model_dump_json()))
    if rc:
        return rc
    print(json.dumps(created, indent=2))
    if unused := unused_note(created, cfg.shard_tokens):
        print(unused, file=sys.stderr)
    note = regime_note(data, cfg)
    if note:
        print(note, file=sys.stderr)
    print(worker_needs(cfg), file=sys.stderr)
    return 0


def unused_note(created: dict, shard_tokens: int) -> str | None:
    """What run create says when the data's tail past its last whole shard is in no shard."""
    unused, n = created.get("unused_tokens", 0), created["n_shards"]
    if not unused:
        return None
    total = created["train_tokens"] + unused
    return (f"{unused:,} of the data's {total:,} training tokens ({unused / total:.1%}) are in no shard: the tail "
            f"past {n} shards of {shard_tokens:,}. --shard-tokens {total // (n + 1):,} would cut {n + 1} shards and "
            f"leave {total - (n + 1) * (total // (n + 1)):,} out")


def worker_needs(cfg: RunConfig) -> str:
    """What a worker needs to take the run's leases (a worker skips, saying why, a model its
    --max-params cannot hold: worker/memory.py), and the worker API version they need when that is
    above the oldest served (protocol.lease_api_version)."""
    from worker.memory import free_ram_for, min_max_params

    m, batch = cfg.model, cfg.inner.batch_size
    rows = getattr(cfg.inner, "micro_batch_size", None) or 1
    low, whole = min_max_params(m, batch_size=rows), min_max_params(m, batch_size=batch)

    def gb(n: int) -> str:
        return f"about {n / 1e9:.1f} GB" if n >= 1e8 else "under 0.1 GB"

    passes = "one sequence at a time" if rows == 1 else f"micro-batches of {rows}"
    api = protocol.lease_api_version(cfg)
    why = [f"compression values {cfg.compression.values!r}", f"feedback_decay {cfg.compression.feedback_decay:g}"]
    why += ["update_feedback"] if cfg.update_feedback else []
    version = (f" Its leases need workers of API v{api} or later ({', '.join(why)}): older ones are told to upgrade."
               if api > protocol.MIN_API_VERSION else "")
    ram_low, ram_whole = gb(free_ram_for(low)), gb(free_ram_for(whole))
    ram = (f"{ram_low} free for either" if ram_low == ram_whole else f"{ram_low} free for the first, {ram_whole} "
           "for the second")
    return (f"model: {m.arch}, {m.n_params():,} parameters. A worker trains it with --max-params >= {low:,} "
            f"({passes}), {whole:,} for whole batches of {batch}; without --max-params a CPU worker sets its cap "
            f"from its free memory and needs {ram}.{version}")


def format_status(st: dict) -> str:
    hist = st["eval_history"]
    first = f"{hist[0]['loss']:.3f} at v{hist[0]['version']}" if hist else "-"
    last = f"{hist[-1]['loss']:.3f} at v{hist[-1]['version']}" if hist else "-"
    due = st.get("next_eval_version")
    ratio = st.get("traffic_ratio_vs_dense")
    return (f"run {st['name']} [{st['state']}] version {st['version']}: {st['merged_deltas']} merged, "
            f"{st['pending_deltas']} queued, {st['rejected_deltas']} rejected at merge, "
            f"{st.get('refused_at_upload', 0)} refused at upload | workers {st['workers_active']} active "
            f"/ {st['workers_total']} | tokens {st['tokens_trained']:,}"
            + (f" of {st['token_budget']:,}" if st.get("token_budget") else "") + _eta(st.get("progress"))
            + f" | eval loss {first} -> {last}" + (f" (next at v{due})" if due is not None else "") + " | "
            f"up {st['bytes_up'] / 1e6:.1f} MB, down {st['bytes_down'] / 1e6:.1f} MB"
            + (f" | {ratio:.0f}x less traffic than dense" if ratio else ""))


def _eta(progress: dict | None) -> str:
    """", about 2h 05m to go" at the recent rate, when the run has a budget and a rate."""
    eta = (progress or {}).get("eta_s")
    if eta is None or not progress.get("token_budget"):
        return ""
    minutes = int(eta // 60)
    return f" ({progress['fraction']:.0%}, about {minutes // 60}h {minutes % 60:02d}m to go)" if eta else " (done)"


def _flagged_lines(client: OperatorClient, st: dict) -> list[str]:
    """Throttled and banned workers: who and why with the admin token (the public status has only
    their counts), else the counts and how to see more."""
    if not st.get("workers_throttled") and not st.get("workers_banned"):
        return []
    try:
        token = client.token()
    except ValueError:
        token = None
    if token is not None:
        rc, workers = client.call("GET", f"/runs/{st['name']}/workers", admin=True)
        if rc == 0:
            return [f"  worker {w['worker_id']} ({w['name'] or 'unnamed'}) is {w['standing']}: {w['standing_reason']}"
                    for w in workers if w["standing"] != "ok"]
    return [f"  {st.get('workers_throttled', 0)} worker(s) throttled, {st.get('workers_banned', 0)} banned "
            "(who and why: `idletrain worker list`, with the admin token)"]


def cmd_run_list(args: argparse.Namespace) -> int:
    rc, runs = OperatorClient(args).call("GET", "/runs")
    if rc:
        return rc
    if args.json:
        print(json.dumps(runs, indent=2))
    for r in [] if args.json else runs:
        budget = f"{r.get('tokens_trained', 0):,}" + (f"/{r['token_budget']:,}" if r.get("token_budget") else "")
        print(f"{r['name']:<24} {r['state']:<9} priority {r.get('priority', 0):<4} version {r['version']:<8} "
              f"tokens {budget:<24} created {r['created_at']}")
    return 0


def cmd_run_show(args: argparse.Namespace) -> int:
    client = OperatorClient(args)
    rc, st = client.call("GET", f"/runs/{args.name}/status")
    if rc:
        return rc
    rc, cfg = client.call("GET", f"/runs/{args.name}/config")
    if rc:
        return rc
    if args.json:
        print(json.dumps({"status": st, "config": cfg}, indent=2))
        return 0
    print(format_status(st))
    print(f"  algorithm {cfg['algorithm']}, model {cfg['model']}, H={cfg['inner']['steps']}, "
          f"compression {cfg['compression']}, outer {cfg['outer']}")
    print(f"  shards {st['shards_done']}/{st['shards_total']} done, "
          f"{st['clipped_deltas']} deltas clipped by robust merging")
    print("  " + describe(st) + (f", finished at {st['finished_at']}" if st.get("finished_at") else ""))
    for line in _flagged_lines(client, st):
        print(line)
    return 0


def cmd_run_set_state(args: argparse.Namespace) -> int:
    rc, summary = OperatorClient(args).call("POST", f"/runs/{args.name}/{args.action}", admin=True)
    if rc:
        return rc
    print(f"run {summary['name']} is {summary['state']}")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    client = OperatorClient(args)
    rc, st = client.call("GET", f"/runs/{args.run}/status")
    if rc:
        return rc
    print(json.dumps(st, indent=2) if args.json else "\n".join([format_status(st), *_flagged_lines(client, st)]))
    return 0


# -- workers ----------------------------------------------------------------------------------

def cmd_worker_list(args: argparse.Namespace) -> int:
    rc, workers = OperatorClient(args).call("GET", f"/runs/{args.run}/workers", admin=True)
    if rc:
        return rc
    if args.json:
        print(json.dumps(workers, indent=2))
        return 0
    print(f"{'id':>5} {'name':<16} {'team':<12} {'device':<6} {'standing':<10} {'tokens':>12} {'accepted':>8} "
          f"{'rejected':>8}  last seen")
    for w in workers:
        standing = "revoked" if w["revoked"] else w["standing"]
        team = (w["team"] or "-")[:11] + ("*" if w.get("team_verified") else "")
        print(f"{w['worker_id']:>5} {(w['name'] or '-')[:16]:<16} {team:<12} "
              f"{(w['device'] or '-'):<6} {standing:<10} {w['tokens_trained']:>12,} {w['deltas_accepted']:>8} "
              f"{w['deltas_rejected']:>8}  {w['last_seen']}")
        if w["standing_reason"]:
            print(f"      why: {w['standing_reason']}")
        if w.get("spot_checks"):
            print("      spot-checks: " + ", ".join(f"{n} {v}" for v, n in sorted(w["spot_checks"].items())))
    if any(w.get("team_verified") for w in workers):
        print("team*: a verified member of that registered team (it registered with the team's key)")
    return 0


def cmd_worker_admin(args: argparse.Namespace) -> int:
    rc, w = OperatorClient(args).call("POST", f"/runs/{args.run}/workers/{args.worker_id}/{args.action}", admin=True)
    if rc:
        return rc
    print(f"worker {w['worker_id']} ({w['name'] or 'unnamed'}): "
          + ("revoked" if w["revoked"] else f"standing {w['standing']}"))
    return 0


# -- the parsers ------------------------------------------------------------------------------

def _token_options(sp, extra_help: str = "") -> None:
    sp.add_argument("--admin-token", default=None, help=ADMIN_TOKEN_HELP + extra_help)
    sp.add_argument("--data-dir", default=None, help=DATA_DIR_HELP)


def register_runs(sub):
    """`idletrain run create|list|show|pause|resume`; returns the `run` subcommands (lifecycle.py adds its own)."""
    run = sub.add_parser("run", help="manage training runs").add_subparsers(dest="action", required=True)
    create = run.add_parser("create", help="create a training run")
    create.add_argument("name")
    create.add_argument("--coordinator", default=DEFAULT_COORDINATOR)
    create.add_argument("--config", help="TOML file with RunConfig fields ([inner], [compression], [outer]…)")
    _token_options(create)
    for flag, _, typ, hlp in RUN_FLAGS:
        create.add_argument(flag, type=typ, default=None, help=hlp)
    create.set_defaults(func=cmd_run_create)
    rlist = run.add_parser("list", help="every run on the coordinator")
    rshow = run.add_parser("show", help="a run's progress, config and flagged workers")
    rshow.add_argument("name")
    for sp in (rlist, rshow):
        sp.add_argument("--coordinator", default=DEFAULT_COORDINATOR)
        sp.add_argument("--json", action="store_true")
    _token_options(rshow)  # the flagged workers' names and reasons need the admin token; without it, counts
    rlist.set_defaults(func=cmd_run_list)
    rshow.set_defaults(func=cmd_run_show)
    for action, hlp in (("pause", "stop handing out leases (live leases may still deliver)"),
                        ("resume", "hand out leases again")):
        sp = run.add_parser(action, help=hlp)
        sp.add_argument("name")
        sp.add_argument("--coordinator", default=DEFAULT_COORDINATOR)
        _token_options(sp)
        sp.set_defaults(func=cmd_run_set_state)
    return run


def register_workers(wk) -> None:
    """`idletrain worker list|revoke|readmit`, beside the volunteer's `worker run|pause|resume|status`."""
    wlist = wk.add_parser("list", help="a run's workers: contribution, standing and why (operators)")
    wlist.add_argument("--json", action="store_true")
    wlist.set_defaults(func=cmd_worker_list)
    wrevoke = wk.add_parser("revoke", help="revoke a worker's token for good (operators)")
    wreadmit = wk.add_parser("readmit", help="lift a ban or throttle robust merging imposed (operators)")
    for sp in (wrevoke, wreadmit):
        sp.add_argument("worker_id", type=int)
        sp.set_defaults(func=cmd_worker_admin)
    for sp in (wlist, wrevoke, wreadmit):
        sp.add_argument("--run", required=True)
        sp.add_argument("--coordinator", default=DEFAULT_COORDINATOR)
        _token_options(sp)


def register_status(sub) -> None:
    """`idletrain status`."""
    st = sub.add_parser("status", help="print a run's progress")
    st.add_argument("--coordinator", default=DEFAULT_COORDINATOR)
    st.add_argument("--run", required=True)
    st.add_argument("--json", action="store_true")
    _token_options(st, " (to name flagged workers and why)")
    st.set_defaults(func=cmd_status)
