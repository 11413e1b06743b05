"""The operator's commands against a running coordinator, all through one OperatorClient:
`idletrain run create|list|show|pause|resume`, `idletrain worker list|revoke|readmit`,
`idletrain status`, and the model: `idletrain export` (.safetensors, or a Hugging Face folder:
idletrain/export.py) and `idletrain sample` (text, through the run's tokenizer)."""

from __future__ import annotations

import argparse
import json
import sys
import tomllib
from pathlib import Path

from pydantic import ValidationError

from idletrain.cli.client import OperatorClient
from idletrain.cli.common import ADMIN_TOKEN_HELP, DATA_DIR_HELP, DEFAULT_COORDINATOR, describe_validation, fail
from shared.algorithms.registry import NAMES
from shared.config import RunConfig
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
    ("--steps", "inner.steps", int, "H: local steps per round"),
    ("--batch-size", "inner.batch_size", int, "sequences per local step"),
    ("--lr", "inner.lr", float, "peak inner learning rate"),
    ("--compression", "compression.index", str, "topk | random | dense"),
    ("--fraction", "compression.fraction", float, "share of elements sent per round"),
    ("--values", "compression.values", str, "fp32 | fp16 | int8 | int4"),
    ("--update-values", "update_values", str, "int8 | int4: the values of the model updates workers download"),
    ("--outer-lr", "outer.lr", float, "outer learning rate"),
    ("--outer-momentum", "outer.momentum", float, "outer Nesterov momentum"),
    ("--group", "outer.group", int, "deltas per outer momentum step (about the number of workers)"),
    ("--max-staleness", "outer.max_staleness", int, "versions a delta may lag before refusal"),
    ("--sparta-p", "sparta.p", float, "sparta: fraction of each tensor exchanged per exchange"),
    ("--sparta-every", "sparta.every", int, "sparta: local steps between exchanges"),
]


def build_run_config(name: str, config_path: str | None, flags: dict) -> RunConfig:
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
    return RunConfig.model_validate(data)


def cmd_run_create(args: argparse.Namespace) -> int:
    flags = {key: getattr(args, flag.lstrip("-").replace("-", "_")) for flag, key, _, _ in RUN_FLAGS}
    try:
        cfg = build_run_config(args.name, args.config, flags)
    except ValidationError as exc:
        return fail(f"bad run config: {describe_validation(exc)}")
    except ValueError as exc:
        return fail(str(exc))
    rc, created = OperatorClient(args).create_run(json.loads(cfg.model_dump_json()))
    if rc:
        return rc
    print(json.dumps(created, indent=2))
    print(worker_needs(cfg), file=sys.stderr)
    return 0


def worker_needs(cfg: RunConfig) -> str:
    """What a worker needs to take the run's leases (a worker skips, saying why, a model its
    --max-params cannot hold: worker/memory.py)."""
    from worker.memory import free_ram_for, min_max_params

    m, batch = cfg.model, cfg.inner.batch_size
    rows = getattr(cfg.inner, "micro_batch_size", None) or 1
    low, whole = min_max_params(m, batch_size=rows), min_max_params(m, batch_size=batch)

    def gb(n: int) -> str:
        return f"about {n / 1e9:.1f} GB" if n >= 1e8 else "under 0.1 GB"

    passes = "one sequence at a time" if rows == 1 else f"micro-batches of {rows}"
    return (f"model: {m.arch}, {m.n_params():,} parameters. A worker trains it with --max-params >= {low:,} "
            f"({passes}), {whole:,} for whole batches of {batch}; a worker's default cap comes from its free "
            f"memory: {gb(free_ram_for(low))} and {gb(free_ram_for(whole))} free on a CPU")


def format_status(st: dict) -> str:
    hist = st["eval_history"]
    first = f"{hist[0]['loss']:.3f}" if hist else "-"
    last = f"{hist[-1]['loss']:.3f}" if hist else "-"
    ratio = st.get("traffic_ratio_vs_dense")
    return (f"run {st['name']} [{st['state']}] version {st['version']}: {st['merged_deltas']} merged, "
            f"{st['pending_deltas']} queued, {st['rejected_deltas']} rejected | workers {st['workers_active']} active "
            f"/ {st['workers_total']} | tokens {st['tokens_trained']:,} | eval loss {first} -> {last} | "
            f"up {st['bytes_up'] / 1e6:.1f} MB, down {st['bytes_down'] / 1e6:.1f} MB"
            + (f" | {ratio:.0f}x less traffic than dense" if ratio else ""))


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
        print(f"{r['name']:<24} {r['state']:<8} version {r['version']:<8} created {r['created_at']}")
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
    print(f"  shards {st['shards_done']}/{st['shards_total']} done (epoch {st['epoch']}), "
          f"{st['clipped_deltas']} deltas clipped by robust merging")
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
        print(f"{w['worker_id']:>5} {(w['name'] or '-')[:16]:<16} {(w['team'] or '-')[:12]:<12} "
              f"{(w['device'] or '-'):<6} {standing:<10} {w['tokens_trained']:>12,} {w['deltas_accepted']:>8} "
              f"{w['deltas_rejected']:>8}  {w['last_seen']}")
        if w["standing_reason"]:
            print(f"      why: {w['standing_reason']}")
    return 0


def cmd_worker_admin(args: argparse.Namespace) -> int:
    rc, w = OperatorClient(args).call("POST", f"/runs/{args.run}/workers/{args.worker_id}/{args.action}", admin=True)
    if rc:
        return rc
    print(f"worker {w['worker_id']} ({w['name'] or 'unnamed'}): "
          + ("revoked" if w["revoked"] else f"standing {w['standing']}"))
    return 0


# -- the model --------------------------------------------------------------------------------

def _fetch_model(args: argparse.Namespace, version: str):
    """(params, metadata, ModelConfig) of a run's snapshot, checked like a worker checks it."""
    import hashlib

    from shared.model import ModelConfig, build_model, param_schema
    from shared.snapshot import decode_snapshot

    client = OperatorClient(args)
    rc, cfg = client.call("GET", f"/runs/{args.run}/config")
    if rc:
        return rc, None
    rc, resp = client.snapshot(args.run, version)
    if rc:
        return rc, None
    if hashlib.sha256(resp.content).hexdigest() != resp.headers.get("x-content-sha256"):
        return fail("the snapshot does not match its X-Content-SHA256 header; try again"), None
    model_cfg = ModelConfig.from_dict(cfg["model"])
    params, meta = decode_snapshot(resp.content, schema=param_schema(build_model(model_cfg)))
    return 0, (params, {**meta, "version": resp.headers.get("x-model-version", meta.get("version", "?"))}, model_cfg)


def cmd_export(args: argparse.Namespace) -> int:
    import safetensors.torch

    from idletrain import export
    from shared.snapshot import snapshot_metadata

    out = Path(args.out)
    if args.format == "safetensors" and out.suffix != ".safetensors":
        return fail(f"write the model to a .safetensors file, not {out.name!r} (or a folder with --format hf)")
    rc, got = _fetch_model(args, args.version)
    if rc:
        return rc
    params, meta, model_cfg = got
    metadata = snapshot_metadata(args.run, int(meta["version"]), model_cfg.to_dict())
    n = sum(t.numel() for t in params.values())
    if args.format == "hf":
        try:
            tok = export.fetch_tokenizer(args.coordinator, args.run)
            export.write_hf_folder(out, model_cfg, params, tok, metadata)
        except (ValueError, OSError) as exc:
            return fail(f"cannot export to {out}: {exc}")
        print(f"wrote {out}/: run {args.run} version {meta['version']}, {n:,} parameters, a Hugging Face "
              f"{export.hf_config(model_cfg, tok)['architectures'][0]} with its {tok.kind} tokenizer "
              f"({tok.vocab_size:,} tokens); load it with transformers.AutoModelForCausalLM.from_pretrained")
        return 0
    metadata["format"] = "idletrain model; shared.model.build_model(ModelConfig.from_dict(model))"
    out.parent.mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_file({n: t.contiguous() for n, t in params.items()}, str(out), metadata=metadata)
    print(f"wrote {out}: run {args.run} version {meta['version']}, {n:,} parameters")
    return 0


def cmd_sample(args: argparse.Namespace) -> int:
    import torch

    from idletrain.export import fetch_tokenizer
    from shared.model import build_model, generate_ids, set_params

    if args.tokens < 1 or args.tokens > 100_000:
        return fail("--tokens must be between 1 and 100000")
    if args.temperature < 0:
        return fail("--temperature must be 0 (greedy) or more")
    rc, got = _fetch_model(args, args.version)
    if rc:
        return rc
    params, meta, model_cfg = got
    try:
        tok = fetch_tokenizer(args.coordinator, args.run)
    except ValueError as exc:
        return fail(str(exc))
    model = build_model(model_cfg)
    set_params(model, params)
    # an empty prompt starts from the document separator (a BPE's), or a newline (bytes)
    prompt = tok.encode(args.prompt) or ([tok.eot_id] if tok.eot_id is not None else tok.encode("\n"))
    ids = generate_ids(model, prompt, max_new_tokens=args.tokens, temperature=args.temperature,
                       top_k=args.top_k or None, generator=torch.Generator().manual_seed(args.seed),
                       allowed=min(tok.vocab_size, model_cfg.vocab_size))  # only ids the tokenizer decodes
    print(f"# run {args.run}, version {meta['version']}, {tok.kind} tokenizer", file=sys.stderr)
    sys.stdout.write(args.prompt + tok.decode(ids) + "\n")
    return 0


# -- the parsers ------------------------------------------------------------------------------

def _token_options(sp, extra_help: str = "") -> None:
    sp.add_argument("--admin-token", default=None, help=ADMIN_TOKEN_HELP + extra_help)
    sp.add_argument("--data-dir", default=None, help=DATA_DIR_HELP)


def register_runs(sub) -> None:
    """`idletrain run create|list|show|pause|resume`."""
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


def register_model_and_status(sub) -> None:
    """`idletrain export`, `idletrain sample`, `idletrain status`."""
    exp = sub.add_parser("export", help="save a run's model: a .safetensors file, or a Hugging Face folder")
    exp.add_argument("out", metavar="OUT", help="OUT.safetensors, or a folder with --format hf")
    exp.add_argument("--format", choices=("safetensors", "hf"), default="safetensors",
                     help="safetensors: our tensors and config (default); hf: a folder transformers loads "
                          "(config.json, model.safetensors, the run's tokenizer)")
    smp = sub.add_parser("sample", help="generate text from a run's current model")
    smp.add_argument("--prompt", default="def ", help="text to continue (default 'def ')")
    smp.add_argument("--tokens", type=int, default=300, help="tokens to generate (default 300)")
    smp.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    smp.add_argument("--top-k", type=int, default=40, help="sample among the k likeliest tokens; 0 = all")
    smp.add_argument("--seed", type=int, default=0)
    for sp, func in ((exp, cmd_export), (smp, cmd_sample)):
        sp.add_argument("--run", required=True)
        sp.add_argument("--version", default="latest", help="a version number or 'latest' (default)")
        sp.add_argument("--coordinator", default=DEFAULT_COORDINATOR)
        sp.set_defaults(func=func)

    st = sub.add_parser("status", help="print a run's progress")
    st.add_argument("--coordinator", default=DEFAULT_COORDINATOR)
    st.add_argument("--run", required=True)
    st.add_argument("--json", action="store_true")
    _token_options(st, " (to name flagged workers and why)")
    st.set_defaults(func=cmd_status)
