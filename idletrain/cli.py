"""`idletrain …`: every subcommand with --help. Errors print what to do and exit 2."""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import os
import sys
import tomllib
from pathlib import Path

import httpx
from pydantic import ValidationError

from shared.config import RunConfig

log = logging.getLogger("idletrain")


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper()), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    # One line per HTTP request drowns the worker's own progress lines.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, getattr(logging, level.upper())))
    logging.getLogger("alembic").setLevel(max(logging.WARNING, getattr(logging, level.upper())))


def _fail(msg: str) -> int:
    print(f"idletrain: {msg}", file=sys.stderr)
    return 2


# -- coordinator ------------------------------------------------------------------------------

def proxy_options(settings) -> dict:
    """uvicorn's X-Forwarded-For handling for `serve`: off unless the operator names the proxies
    (settings.forwarded_allow_ips). uvicorn's default believes the header from 127.0.0.1, so any
    request through loopback (a local process, a proxy passing it on) chose its own client address:
    200 registrations under spoofed addresses went past the per-address limit."""
    if not settings.forwarded_allow_ips:
        return {"proxy_headers": False}
    return {"proxy_headers": True, "forwarded_allow_ips": settings.forwarded_allow_ips}


MAX_HEADER_BYTES = 16 << 10  # a request line and headers of ours are well under 1 KB; h11's default, stated


def limit_options(settings) -> dict:
    """uvicorn's bounds for `serve` (both the one-process and the --processes N path): connections and
    requests in flight per process (settings.limit_concurrency; past it, 503), idle keep-alive
    (keep_alive_s), and the size of a request's head with the h11 protocol (the httptools one has its
    own fixed limits). Bodies are bounded by the app itself (max_json_bytes, max_upload_bytes and
    body_timeout_s: coordinator/limits.py, coordinator/api/workers.py)."""
    return {"limit_concurrency": settings.limit_concurrency, "timeout_keep_alive": settings.keep_alive_s,
            "h11_max_incomplete_event_size": MAX_HEADER_BYTES}


def cmd_coordinator_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from coordinator.app import NoDelayHTTP, create_app
    from coordinator.settings import CoordinatorSettings

    from coordinator import admin

    overrides = {k: v for k, v in {"host": args.host, "port": args.port, "data_dir": args.data_dir,
                                   "database_url": args.database_url, "admin_token": args.admin_token,
                                   "processes": args.processes, "forwarded_allow_ips": args.forwarded_allow_ips,
                                   "corpus_dirs": ",".join(args.corpus_dir) if args.corpus_dir else None,
                                   "allowed_hosts": ",".join(args.allowed_host) if args.allowed_host else None}.items()
                 if v is not None}
    try:
        settings = CoordinatorSettings(**overrides)
    except ValidationError as exc:
        return _fail("; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()))
    shared_db = settings.resolved_database_url.startswith("postgresql")
    if settings.processes > 1 and not shared_db:
        return _fail("several coordinator processes need PostgreSQL (SQLite serves one process): pass "
                     "--database-url postgresql+psycopg://USER@HOST/DB")
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    try:  # here, once, before any process starts: the processes read the file this writes
        token, created = admin.ensure_token(settings.data_dir, settings.admin_token)
    except (OSError, ValueError) as exc:
        return _fail(str(exc))
    if created:
        path = admin.token_path(settings.data_dir).resolve()
        print(f"idletrain: admin token (shown once; kept in {path}, mode 0600): {token}\n"
              f"idletrain: operator commands on this machine read it with --data-dir {settings.data_dir}; "
              "elsewhere pass --admin-token or set IDLETRAIN_ADMIN_TOKEN", file=sys.stderr)
    log.info("coordinator on http://%s:%d, data in %s, %d process(es)", settings.host, settings.port,
             settings.data_dir.resolve(), settings.processes)
    level, access = args.log_level.lower(), args.log_level.upper() == "DEBUG"
    if settings.processes == 1:
        settings = settings.model_copy(update={"relay": shared_db})  # other coordinators may join the database
        uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level=level, access_log=access,
                    http=NoDelayHTTP, **proxy_options(settings), **limit_options(settings))
        return 0
    # uvicorn's supervisor starts the processes (and restarts one that dies); each builds its app
    # from the environment, so the settings travel as IDLETRAIN_* variables.
    for key, value in {**overrides, "data_dir": str(settings.data_dir.resolve()), "relay": "true"}.items():
        os.environ[f"IDLETRAIN_{key.upper()}"] = str(value)
    # uvicorn's supervisor kills a process that leaves its health ping unanswered for 5 s; a process
    # busy with a 124M model (creating a run, a snapshot, a checkpoint) can hold the GIL that long
    # on a loaded machine, and such a kill drops its requests mid-answer. Give it a minute.
    patient = ({"timeout_worker_healthcheck": 60}
               if "timeout_worker_healthcheck" in inspect.signature(uvicorn.run).parameters else {})
    uvicorn.run("coordinator.app:app_from_environment", factory=True, workers=settings.processes, host=settings.host,
                port=settings.port, log_level=level, access_log=access, http=NoDelayHTTP, **patient,
                **proxy_options(settings), **limit_options(settings))
    return 0


def cmd_coordinator_migrate(args: argparse.Namespace) -> int:
    from coordinator import migrate
    from coordinator.db import make_engine
    from coordinator.settings import CoordinatorSettings

    overrides = {k: v for k, v in {"data_dir": args.data_dir, "database_url": args.database_url}.items()
                 if v is not None}
    try:
        settings = CoordinatorSettings(**overrides)
    except ValidationError as exc:
        return _fail("; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()))
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    engine = make_engine(settings.resolved_database_url)
    try:
        before = migrate.current(engine)
        if args.check:
            ok = before == migrate.head()
            print(f"database at {before or 'no schema'}, newest is {migrate.head()}: "
                  + ("up to date" if ok else "run `idletrain coordinator migrate`"))
            return 0 if ok else 1
        after = migrate.upgrade(engine)
    except Exception as exc:  # the driver's own errors: a wrong URL, a server that is down
        return _fail(f"cannot migrate {engine.url.render_as_string(hide_password=True)}: {exc}")
    finally:
        engine.dispose()
    print(f"database {engine.url.render_as_string(hide_password=True)}: {before or 'empty'} -> {after}")
    return 0


# -- runs -------------------------------------------------------------------------------------

def _set(d: dict, dotted: str, value) -> None:
    *parents, leaf = dotted.split(".")
    for p in parents:
        d = d.setdefault(p, {})
    d[leaf] = value


RUN_FLAGS = [  # (flag, dotted config key, type, help)
    ("--algorithm", "algorithm", str, "diloco (default) | sparta | sparta+diloco"),
    ("--n-layer", "model.n_layer", int, "transformer layers"),
    ("--n-head", "model.n_head", int, "attention heads"),
    ("--d-model", "model.d_model", int, "model width"),
    ("--context", "model.context", int, "tokens per training sequence"),
    ("--corpus", "corpus", str, "builtin:stdlib, or a text file/folder on the coordinator's disk"),
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


def _admin_headers(token: str | None) -> dict:
    return {"Authorization": f"Bearer {token}"} if token else {}


def _admin_token(args: argparse.Namespace) -> str | None:
    """The operator's token: --admin-token, else IDLETRAIN_ADMIN_TOKEN, else the coordinator's own
    token file in --data-dir (default: IDLETRAIN_DATA_DIR, else ./idletrain-data) when this machine
    has it, so the operator next to the coordinator types nothing. None when none is found."""
    from coordinator import admin

    token = getattr(args, "admin_token", None) or os.environ.get("IDLETRAIN_ADMIN_TOKEN")
    if token:
        return token
    data_dir = getattr(args, "data_dir", None) or os.environ.get("IDLETRAIN_DATA_DIR") or "./idletrain-data"
    return admin.read_token(admin.token_path(Path(data_dir)))


def _admin_hint(args: argparse.Namespace) -> str:
    data_dir = getattr(args, "data_dir", None) or os.environ.get("IDLETRAIN_DATA_DIR") or "./idletrain-data"
    return (f"operator commands need the coordinator's admin token: pass --admin-token, set IDLETRAIN_ADMIN_TOKEN, "
            f"or run this on the coordinator's machine with --data-dir pointing at its data dir (looked in "
            f"{Path(data_dir) / 'admin_token'})")


def _error_detail(resp: httpx.Response) -> str:
    try:
        detail = resp.json().get("detail")
    except ValueError:
        return resp.text
    return detail if isinstance(detail, str) else json.dumps(detail)


def cmd_run_create(args: argparse.Namespace) -> int:
    flags = {key: getattr(args, flag.lstrip("-").replace("-", "_")) for flag, key, _, _ in RUN_FLAGS}
    try:
        cfg = build_run_config(args.name, args.config, flags)
    except ValidationError as exc:
        lines = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        return _fail(f"bad run config: {lines}")
    except ValueError as exc:
        return _fail(str(exc))
    try:
        token = _admin_token(args)
    except ValueError as exc:  # a token file open to others, or empty
        return _fail(str(exc))
    try:
        resp = httpx.post(f"{args.coordinator}/api/v1/runs", json=json.loads(cfg.model_dump_json()),
                          headers=_admin_headers(token), timeout=600)
    except httpx.TransportError as exc:
        return _fail(f"cannot reach the coordinator at {args.coordinator} ({exc}); is it running?")
    if resp.status_code in (401, 403):
        return _fail(f"coordinator refused the run ({resp.status_code}: {_error_detail(resp)}); {_admin_hint(args)}")
    if resp.status_code != 201:
        return _fail(f"coordinator refused the run ({resp.status_code}): {_error_detail(resp)}")
    print(json.dumps(resp.json(), indent=2))
    return 0


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


def _flagged_lines(args: argparse.Namespace, st: dict) -> list[str]:
    """Throttled and banned workers: who and why with the admin token (the public status has only
    their counts), else the counts and how to see more."""
    if not st.get("workers_throttled") and not st.get("workers_banned"):
        return []
    try:
        token = _admin_token(args)
    except ValueError:
        token = None
    if token is not None:
        rc, workers = _call(args, "GET", f"/runs/{st['name']}/workers", admin=True)
        if rc == 0:
            return [f"  worker {w['worker_id']} ({w['name'] or 'unnamed'}) is {w['standing']}: {w['standing_reason']}"
                    for w in workers if w["standing"] != "ok"]
    return [f"  {st.get('workers_throttled', 0)} worker(s) throttled, {st.get('workers_banned', 0)} banned "
            "(who and why: `idletrain worker list`, with the admin token)"]


def _call(args: argparse.Namespace, method: str, path: str, *, admin: bool = False) -> tuple[int, object]:
    """One request to the coordinator: (0, JSON answer) or (exit code, None) after printing why."""
    try:
        token = _admin_token(args) if admin else None
    except ValueError as exc:  # a token file open to others, or empty
        return _fail(str(exc)), None
    try:
        resp = httpx.request(method, f"{args.coordinator}/api/v1{path}", timeout=60,
                             headers=_admin_headers(token) if admin else {})
    except httpx.TransportError as exc:
        return _fail(f"cannot reach the coordinator at {args.coordinator} ({exc}); is it running?"), None
    if resp.status_code in (401, 403) and admin:
        return _fail(f"{resp.status_code}: {_error_detail(resp)}; {_admin_hint(args)}"), None
    if resp.status_code >= 400:
        return _fail(f"{resp.status_code}: {_error_detail(resp)}"), None
    return 0, resp.json()


def cmd_run_list(args: argparse.Namespace) -> int:
    rc, runs = _call(args, "GET", "/runs")
    if rc:
        return rc
    if args.json:
        print(json.dumps(runs, indent=2))
    for r in [] if args.json else runs:
        print(f"{r['name']:<24} {r['state']:<8} version {r['version']:<8} created {r['created_at']}")
    return 0


def cmd_run_show(args: argparse.Namespace) -> int:
    rc, st = _call(args, "GET", f"/runs/{args.name}/status")
    if rc:
        return rc
    rc, cfg = _call(args, "GET", f"/runs/{args.name}/config")
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
    for line in _flagged_lines(args, st):
        print(line)
    return 0


def cmd_run_set_state(args: argparse.Namespace) -> int:
    rc, summary = _call(args, "POST", f"/runs/{args.name}/{args.action}", admin=True)
    if rc:
        return rc
    print(f"run {summary['name']} is {summary['state']}")
    return 0


def cmd_worker_list(args: argparse.Namespace) -> int:
    rc, workers = _call(args, "GET", f"/runs/{args.run}/workers", admin=True)
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
    rc, w = _call(args, "POST", f"/runs/{args.run}/workers/{args.worker_id}/{args.action}", admin=True)
    if rc:
        return rc
    print(f"worker {w['worker_id']} ({w['name'] or 'unnamed'}): "
          + ("revoked" if w["revoked"] else f"standing {w['standing']}"))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    rc, st = _call(args, "GET", f"/runs/{args.run}/status")
    if rc:
        return rc
    print(json.dumps(st, indent=2) if args.json else "\n".join([format_status(st), *_flagged_lines(args, st)]))
    return 0


def _fetch_model(args: argparse.Namespace, version: str):
    """(params, metadata, ModelConfig) of a run's snapshot, checked like a worker checks it."""
    import hashlib

    from shared.model import ModelConfig, build_model, param_schema
    from shared.snapshot import decode_snapshot

    rc, cfg = _call(args, "GET", f"/runs/{args.run}/config")
    if rc:
        return rc, None
    try:
        resp = httpx.get(f"{args.coordinator}/api/v1/runs/{args.run}/snapshots/{version}", timeout=600)
    except httpx.TransportError as exc:
        return _fail(f"cannot reach the coordinator at {args.coordinator} ({exc}); is it running?"), None
    if resp.status_code != 200:
        return _fail(f"{resp.status_code}: {_error_detail(resp)}"), None
    if hashlib.sha256(resp.content).hexdigest() != resp.headers.get("x-content-sha256"):
        return _fail("the snapshot does not match its X-Content-SHA256 header; try again"), None
    model_cfg = ModelConfig.from_dict(cfg["model"])
    params, meta = decode_snapshot(resp.content, schema=param_schema(build_model(model_cfg)))
    return 0, (params, {**meta, "version": resp.headers.get("x-model-version", meta.get("version", "?"))}, model_cfg)


def cmd_export(args: argparse.Namespace) -> int:
    import safetensors.torch

    from shared.snapshot import snapshot_metadata

    out = Path(args.out)
    if out.suffix != ".safetensors":
        return _fail(f"write the model to a .safetensors file, not {out.name!r}")
    rc, got = _fetch_model(args, args.version)
    if rc:
        return rc
    params, meta, model_cfg = got
    metadata = {**snapshot_metadata(args.run, int(meta["version"]), model_cfg.to_dict()),
                "format": "idletrain TransformerLM (byte-level); shared.model.build_model(ModelConfig(**model))"}
    out.parent.mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_file({n: t.contiguous() for n, t in params.items()}, str(out), metadata=metadata)
    n = sum(t.numel() for t in params.values())
    print(f"wrote {out}: run {args.run} version {meta['version']}, {n:,} parameters")
    return 0


def cmd_sample(args: argparse.Namespace) -> int:
    import torch

    from shared.model import build_model, generate, set_params

    if args.tokens < 1 or args.tokens > 100_000:
        return _fail("--tokens must be between 1 and 100000")
    if args.temperature < 0:
        return _fail("--temperature must be 0 (greedy) or more")
    rc, got = _fetch_model(args, args.version)
    if rc:
        return rc
    params, meta, model_cfg = got
    model = build_model(model_cfg)
    set_params(model, params)
    gen = torch.Generator().manual_seed(args.seed)
    text = generate(model, args.prompt.encode(), max_new_tokens=args.tokens, temperature=args.temperature,
                    top_k=args.top_k or None, generator=gen)
    print(f"# run {args.run}, version {meta['version']}", file=sys.stderr)
    sys.stdout.write(args.prompt + text.decode("utf-8", errors="replace") + "\n")
    return 0


# -- worker -----------------------------------------------------------------------------------

WORKER_FLAGS = ["coordinator", "run", "token", "device", "threads", "state_dir", "name", "team", "join_key",
                "max_rounds", "max_params", "checkpoint_every_steps", "when", "idle_minutes", "on_battery",
                "max_other_load", "max_upload_kbps", "max_download_kbps", "daily_transfer_mb"]


def cmd_worker_run(args: argparse.Namespace) -> int:
    from worker.loop import run_worker
    from worker.settings import describe_errors, load_settings

    try:  # flags > IDLETRAIN_WORKER_* > worker.toml > defaults
        settings = load_settings({k: getattr(args, k) for k in WORKER_FLAGS}, config=args.config)
    except ValidationError as exc:
        return _fail(describe_errors(exc))
    except ValueError as exc:
        return _fail(str(exc))
    try:
        rounds = run_worker(settings)
    except KeyboardInterrupt:
        log.warning("interrupted")
        return 130
    except httpx.TransportError as exc:
        return _fail(f"cannot reach the coordinator at {settings.coordinator} ({exc}); is it running?")
    except RuntimeError as exc:
        return _fail(str(exc))
    except Exception as exc:
        from worker.client import CoordinatorError
        if isinstance(exc, CoordinatorError):
            return _fail(f"coordinator said {exc.status}: {exc.detail}")
        raise
    if rounds is None:
        log.info("worker done (a follower rank of a torchrun worker: rank 0 delivers the rounds)")
    else:
        log.info("worker done: %d rounds delivered", rounds)
    return 0


def cmd_worker_local(args: argparse.Namespace) -> int:
    """`idletrain worker pause|resume|status`: the running worker's control and status files (no network)."""
    from worker.control import ControlFile, StatusFile, is_live, run_folders
    from worker.progress import describe
    from worker.settings import resolve_state_dir

    try:
        state_dir = resolve_state_dir(args.state_dir, config=args.config)
    except ValueError as exc:
        return _fail(str(exc))
    folders = run_folders(state_dir, coordinator=args.coordinator, run=args.run)
    if not folders:
        return _fail(f"no worker has run under {state_dir}" + (f" for run {args.run!r}" if args.run else "")
                     + "; pass --state-dir, or --coordinator and --run")
    if args.action == "status":
        found = [(folder, StatusFile(folder).read()) for folder in folders]
        if args.json:
            print(json.dumps([{**vars(st), "live": is_live(st)} for _, st in found if st is not None], indent=2))
            return 0
        for folder, st in found:
            if st is None:
                print(f"{folder}: no worker has reported here yet")
                continue
            alive = "" if is_live(st) else f" [not running; last report {st.updated_at}]"
            print(f"run {st.run} at {st.coordinator} (pid {st.pid}){alive}\n  {describe(st)}")
        return 0
    paused = args.action == "pause"
    for folder in folders:
        ControlFile(folder).request(paused=paused)
        st = StatusFile(folder).read()
        who = f"run {st.run} at {st.coordinator}" if st is not None else str(folder)
        running = st is not None and is_live(st)
        print(f"{who}: {'paused' if paused else 'resumed'}"
              + ("" if running else " (no worker running now; it applies when one starts)"))
    return 0


# -- demo and bench ---------------------------------------------------------------------------

def cmd_demo(args: argparse.Namespace) -> int:
    from idletrain.demo import run_demo

    return run_demo(workers=args.workers, minutes=args.minutes, as_json=args.json, keep=args.keep)


def _can_plot() -> bool:
    """Whether matplotlib (the bench extra) is installed: every benchmark writes a plot."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def cmd_bench_convergence(args: argparse.Namespace) -> int:
    if not _can_plot():
        return _fail("the benchmark plots with matplotlib: pip install 'idletrain[bench]'")
    from bench.convergence import PROFILES, run

    if args.profile not in PROFILES:
        return _fail(f"unknown profile {args.profile!r}: pick one of {', '.join(sorted(PROFILES))}")
    if args.workers < 2:
        return _fail("--workers must be at least 2")
    if args.hetero < 1:
        return _fail("--hetero is the fastest worker's speed over the slowest's: 1 or more")
    out = Path(args.out or f"bench-results/convergence-{args.profile}")
    rows = run(profile=args.profile, out=out, workers=args.workers, hetero=args.hetero, only=args.only,
               threads=args.threads)
    print((out / "results.md").read_text())
    print(f"wrote {out / 'results.json'}, {out / 'results.md'}, {out / 'loss.png'}")
    return 0 if rows else 1


def cmd_bench_averaging(args: argparse.Namespace) -> int:
    if not _can_plot():
        return _fail("the benchmark plots with matplotlib: pip install 'idletrain[bench]'")
    from bench.averaging import PROFILES, run

    if args.profile not in PROFILES:
        return _fail(f"unknown profile {args.profile!r}: pick {', '.join(PROFILES)}")
    if args.workers < 2:
        return _fail("--workers must be at least 2")
    if args.threads is not None and args.threads < 1:
        return _fail("--threads must be at least 1")
    out = Path(args.out or f"bench-results/averaging-{args.profile}")
    run(profile=args.profile, out=out, workers=args.workers, threads=args.threads)
    print((out / "results.md").read_text())
    print(f"wrote {out / 'results.json'}, {out / 'results.md'}, {out / 'ratio.png'}")
    return 0


def cmd_bench_merge(args: argparse.Namespace) -> int:
    if not _can_plot():
        return _fail("the benchmark plots with matplotlib: pip install 'idletrain[bench]'")
    from bench.merge import INDEX_KINDS, PARAM_MODELS, run

    for name in (args.params_model, args.db_model):
        if name not in PARAM_MODELS:
            return _fail(f"unknown model {name!r}: pick one of {', '.join(PARAM_MODELS)}")
    if not 0 < args.fraction <= 1:
        return _fail("--fraction must be in (0, 1]")
    if args.deltas < 1 or args.snapshot_merges < 0 or args.db_deltas < 0:
        return _fail("--deltas must be at least 1; --snapshot-merges and --db-deltas at least 0")
    if args.threads is not None and args.threads < 1:
        return _fail("--threads must be at least 1")
    bad = [k for k in args.index if k not in INDEX_KINDS]
    if bad or not args.index:
        return _fail(f"--index takes one or more of {', '.join(INDEX_KINDS)}")
    out = Path(args.out or "bench-results/merge")
    result = run(params_model=args.params_model, fraction=args.fraction, deltas=args.deltas, threads=args.threads,
                 out=out, index_kinds=args.index, snapshot_merges=args.snapshot_merges, db_model=args.db_model,
                 db_deltas=args.db_deltas)
    print((out / "results.md").read_text())
    print(f"wrote {out / 'results.json'}, {out / 'results.md'}, {out / 'stages.png'}")
    return 0 if result["rows"] else 1


def cmd_bench_load(args: argparse.Namespace) -> int:
    if not _can_plot():
        return _fail("the benchmark plots with matplotlib: pip install 'idletrain[bench]'")
    from bench.load import DEFAULT_PG_URL, PULL_MODES, model_configs, run

    if args.model not in model_configs():
        return _fail(f"unknown model {args.model!r}: pick one of {', '.join(model_configs())}")
    if not args.workers or min(args.workers) < 1:
        return _fail("--workers takes one or more positive counts")
    if args.think_s <= 0 or args.duration_s <= 0 or (args.warmup_s is not None and args.warmup_s < 0):
        return _fail("--think-s and --duration-s must be positive, --warmup-s at least 0")
    if not 0 < args.fraction <= 1:
        return _fail("--fraction must be in (0, 1]")
    if args.pull not in PULL_MODES:
        return _fail(f"--pull takes one of {', '.join(PULL_MODES)}")
    if args.processes < 1 or (args.processes > 1 and args.sqlite):
        return _fail("--processes takes 1 or more, and several processes need PostgreSQL (drop --sqlite)")
    if (args.clients is not None and args.clients < 1) or (args.shards is not None and args.shards < 1):
        return _fail("--clients and --shards must be at least 1")
    out = Path(args.out or "bench-results/load")
    result = run(workers=args.workers, think_s=args.think_s, duration_s=args.duration_s, warmup_s=args.warmup_s,
                 database_url=None if args.sqlite else (args.database_url or DEFAULT_PG_URL), model=args.model,
                 fraction=args.fraction, pull=args.pull, clients=args.clients, shards=args.shards, out=out,
                 update_probe=not args.no_update_probe, keep=args.keep, processes=args.processes)
    print((out / "results.md").read_text())
    print(f"wrote {out / 'results.json'}, {out / 'results.md'}, {out / 'p99.png'}")
    return 0 if result["rows"] else 1


def cmd_bench_utilisation(args: argparse.Namespace) -> int:
    if not _can_plot():
        return _fail("the benchmark plots with matplotlib: pip install 'idletrain[bench]'")
    from bench.utilisation import MODES, run

    bad = [m for m in args.modes if m not in MODES]
    if bad or not args.modes:
        return _fail(f"--modes takes one or more of {', '.join(MODES)}")
    if min(args.rounds, args.repeats, args.steps, args.batch, args.threads) < 1 or args.upload_kbps <= 0:
        return _fail("--rounds, --repeats, --steps, --batch and --threads must be at least 1, --upload-kbps positive")
    out = Path(args.out or "bench-results/utilisation")
    command = (f"idletrain bench utilisation --rounds {args.rounds} --repeats {args.repeats} --steps {args.steps} "
               f"--batch {args.batch} --upload-kbps {args.upload_kbps:g} --threads {args.threads} "
               f"--modes {' '.join(args.modes)}"
               + (f" --values {args.values}" if args.values else "")
               + (f" --update-values {args.update_values}" if args.update_values else ""))
    result = run(out=out, rounds=args.rounds, repeats=args.repeats, steps=args.steps, batch=args.batch,
                 upload_kbps=args.upload_kbps, threads=args.threads, modes=tuple(args.modes), values=args.values,
                 update_values=args.update_values, command=command)
    print((out / "results.md").read_text())
    print(f"wrote {out / 'results.json'}, {out / 'results.md'}, {out / 'utilisation.png'}")
    return 0 if result["modes"] else 1


ADMIN_TOKEN_HELP = "default: $IDLETRAIN_ADMIN_TOKEN, else the token file in --data-dir"
DATA_DIR_HELP = ("the coordinator's data dir, where `serve` keeps admin_token (default: $IDLETRAIN_DATA_DIR, else "
                 "./idletrain-data)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="idletrain", description="Train one model on many idle machines.")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = p.add_subparsers(dest="command", required=True)

    coord = sub.add_parser("coordinator", help="run the coordinator").add_subparsers(dest="action", required=True)
    serve = coord.add_parser("serve", help="serve the HTTP API and merge deltas")
    serve.add_argument("--host", default=None, help="listen address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=None, help="port (default 8000)")
    serve.add_argument("--data-dir", default=None, help="blobs and the SQLite database (default ./idletrain-data)")
    serve.add_argument("--database-url", default=None, help="SQLAlchemy URL (default: SQLite in the data dir)")
    serve.add_argument("--admin-token", default=None, help="token operator actions require (default: the one in "
                                                           "DATA_DIR/admin_token, generated on first start)")
    serve.add_argument("--corpus-dir", action="append", default=None, metavar="DIR",
                       help="a folder run corpora may come from, besides DATA_DIR/corpora (repeatable)")
    serve.add_argument("--allowed-host", action="append", default=None, metavar="NAME",
                       help="a Host name to answer besides the loopback names and --host, e.g. the public name "
                            "behind a reverse proxy (repeatable; *.example.org for subdomains)")
    serve.add_argument("--processes", type=int, default=None,
                       help="HTTP processes on one port (PostgreSQL only): all answer workers, one at a time "
                            "merges (the holder of the merger lock; another takes over when it dies)")
    serve.add_argument("--forwarded-allow-ips", default=None,
                       help="comma-separated addresses of reverse proxies whose X-Forwarded-For is believed "
                            "(e.g. 127.0.0.1 for nginx on this machine); default: none")
    serve.set_defaults(func=cmd_coordinator_serve)
    mig = coord.add_parser("migrate", help="bring the database schema to the newest version (serve does it too)")
    mig.add_argument("--data-dir", default=None, help="where the SQLite database lives (default ./idletrain-data)")
    mig.add_argument("--database-url", default=None, help="SQLAlchemy URL (default: SQLite in the data dir)")
    mig.add_argument("--check", action="store_true", help="only say whether it is up to date (exit 1 if not)")
    mig.set_defaults(func=cmd_coordinator_migrate)

    run = sub.add_parser("run", help="manage training runs").add_subparsers(dest="action", required=True)
    create = run.add_parser("create", help="create a training run")
    create.add_argument("name")
    create.add_argument("--coordinator", default="http://127.0.0.1:8000")
    create.add_argument("--config", help="TOML file with RunConfig fields ([inner], [compression], [outer]…)")
    create.add_argument("--admin-token", default=None, help=ADMIN_TOKEN_HELP)
    create.add_argument("--data-dir", default=None, help=DATA_DIR_HELP)
    for flag, _, typ, hlp in RUN_FLAGS:
        create.add_argument(flag, type=typ, default=None, help=hlp)
    create.set_defaults(func=cmd_run_create)
    rlist = run.add_parser("list", help="every run on the coordinator")
    rshow = run.add_parser("show", help="a run's progress, config and flagged workers")
    rshow.add_argument("name")
    for sp in (rlist, rshow):
        sp.add_argument("--coordinator", default="http://127.0.0.1:8000")
        sp.add_argument("--json", action="store_true")
    for sp in (rshow,):  # the flagged workers' names and reasons need the admin token; without it, counts
        sp.add_argument("--admin-token", default=None, help=ADMIN_TOKEN_HELP)
        sp.add_argument("--data-dir", default=None, help=DATA_DIR_HELP)
    rlist.set_defaults(func=cmd_run_list)
    rshow.set_defaults(func=cmd_run_show)
    for action, hlp in (("pause", "stop handing out leases (live leases may still deliver)"),
                        ("resume", "hand out leases again")):
        sp = run.add_parser(action, help=hlp)
        sp.add_argument("name")
        sp.add_argument("--coordinator", default="http://127.0.0.1:8000")
        sp.add_argument("--admin-token", default=None, help=ADMIN_TOKEN_HELP)
        sp.add_argument("--data-dir", default=None, help=DATA_DIR_HELP)
        sp.set_defaults(func=cmd_run_set_state)

    wk = sub.add_parser("worker", help="run a worker").add_subparsers(dest="action", required=True)
    wrun = wk.add_parser("run", help="train for a run until Ctrl-C (once: finish the lease; twice: now)",
                         description="Every option may also come from IDLETRAIN_WORKER_<OPTION> or from "
                                     "~/.config/idletrain/worker.toml (option = value, with underscores); "
                                     "flags win over the environment, which wins over the file.")
    wrun.add_argument("--config", default=None,
                      help="TOML file of worker settings (default ~/.config/idletrain/worker.toml, if it exists)")
    wrun.add_argument("--coordinator", default=None, help="coordinator base URL (required here, in the environment "
                                                          "or in the config file)")
    wrun.add_argument("--run", default=None, help="the run to train (required, likewise)")
    wrun.add_argument("--token", default=None, help="worker token (default: register once, then reuse)")
    wrun.add_argument("--join-key", default=None)
    wrun.add_argument("--device", default=None, choices=["auto", "cpu", "cuda", "mps"])
    wrun.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    wrun.add_argument("--state-dir", default=None, help="token and cache (default ~/.config/idletrain)")
    wrun.add_argument("--name", default=None, help="contributor name for the leaderboard")
    wrun.add_argument("--team", default=None)
    wrun.add_argument("--max-rounds", type=int, default=None, help="stop after N delivered rounds")
    wrun.add_argument("--max-params", type=int, default=None,
                      help="refuse runs whose model is larger (default: what this machine's available "
                           "memory holds for training)")
    wrun.add_argument("--checkpoint-every-steps", type=int, default=None,
                      help="save the round in flight every N local steps so a kill resumes it (default 25; 0: "
                           "only at round end)")
    wrun.add_argument("--when", default=None, choices=["always", "idle"],
                      help="train always (default), or only while nobody uses the machine")
    wrun.add_argument("--idle-minutes", type=float, default=None,
                      help="with --when idle: minutes without input (or CPU load) before training (default 5)")
    wrun.add_argument("--on-battery", default=None, choices=["pause", "run"],
                      help="on battery power (default: pause with --when idle, run with --when always)")
    wrun.add_argument("--max-other-load", type=float, default=None,
                      help="with --when idle where input idle time is unknown: busy while other processes use "
                           "more than this share of the CPUs (default 0.3)")
    wrun.add_argument("--max-upload-kbps", type=float, default=None, help="upload limit in kilobits/s")
    wrun.add_argument("--max-download-kbps", type=float, default=None, help="download limit in kilobits/s")
    wrun.add_argument("--daily-transfer-mb", type=float, default=None,
                      help="MB sent + received per UTC day (kept across restarts); when reached, pause until "
                           "00:00 UTC")
    wrun.set_defaults(func=cmd_worker_run)
    for action, hlp in (("pause", "pause the worker(s) on this machine at the next local step (saved first)"),
                        ("resume", "let paused worker(s) on this machine go on"),
                        ("status", "what the worker(s) on this machine are doing")):
        sp = wk.add_parser(action, help=hlp, description=hlp + ". Talks to the running worker through files in "
                                                               "its state dir, never over the network.")
        sp.add_argument("--state-dir", default=None, help="the worker's state dir (default: as `worker run`)")
        sp.add_argument("--config", default=None, help="worker.toml to take the state dir from")
        sp.add_argument("--coordinator", default=None, help="only the worker of this coordinator ...")
        sp.add_argument("--run", default=None, help="... and/or of this run (default: every worker under the "
                                                    "state dir)")
        if action == "status":
            sp.add_argument("--json", action="store_true")
        sp.set_defaults(func=cmd_worker_local)
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
        sp.add_argument("--coordinator", default="http://127.0.0.1:8000")
        sp.add_argument("--admin-token", default=None, help=ADMIN_TOKEN_HELP)
        sp.add_argument("--data-dir", default=None, help=DATA_DIR_HELP)

    exp = sub.add_parser("export", help="save a run's model as a .safetensors file")
    exp.add_argument("out", metavar="OUT.safetensors")
    smp = sub.add_parser("sample", help="generate text from a run's current model")
    smp.add_argument("--prompt", default="def ", help="text to continue (default 'def ')")
    smp.add_argument("--tokens", type=int, default=300, help="bytes to generate (default 300)")
    smp.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    smp.add_argument("--top-k", type=int, default=40, help="sample among the k likeliest bytes; 0 = all")
    smp.add_argument("--seed", type=int, default=0)
    for sp, func in ((exp, cmd_export), (smp, cmd_sample)):
        sp.add_argument("--run", required=True)
        sp.add_argument("--version", default="latest", help="a version number or 'latest' (default)")
        sp.add_argument("--coordinator", default="http://127.0.0.1:8000")
        sp.set_defaults(func=func)

    st = sub.add_parser("status", help="print a run's progress")
    st.add_argument("--coordinator", default="http://127.0.0.1:8000")
    st.add_argument("--run", required=True)
    st.add_argument("--json", action="store_true")
    st.add_argument("--admin-token", default=None, help=ADMIN_TOKEN_HELP + " (to name flagged workers and why)")
    st.add_argument("--data-dir", default=None, help=DATA_DIR_HELP)
    st.set_defaults(func=cmd_status)

    demo = sub.add_parser("demo", help="a coordinator and local workers on this machine, over real HTTP")
    demo.add_argument("--workers", type=int, default=3)
    demo.add_argument("--minutes", type=float, default=3.0, help="training time (startup and summary add ~30 s)")
    demo.add_argument("--json", action="store_true", help="end with the summary as one JSON line")
    demo.add_argument("--keep", action="store_true", help="keep the temporary data dir")
    demo.set_defaults(func=cmd_demo)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="action", required=True)
    conv = bench.add_parser("convergence", help="ddp vs diloco vs sparta vs compressed, same tokens, side by side")
    conv.add_argument("--profile", default="quick", help="quick (< 10 min on 2 cores) or full (< 60 min)")
    conv.add_argument("--out", default=None, help="output folder (default bench-results/convergence-PROFILE)")
    conv.add_argument("--workers", type=int, default=8)
    conv.add_argument("--hetero", type=float, default=1.0,
                      help="worker speeds spread geometrically up to this factor (4 = fastest is 4x the slowest)")
    conv.add_argument("--only", nargs="*", default=None, help="run only methods whose name contains one of these "
                                                              "(ddp always runs: it is the reference)")
    conv.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    conv.set_defaults(func=cmd_bench_convergence)
    avg = bench.add_parser("averaging", help="where averaging AdamW workers loses against ddp: workers in "
                                             "lock-step against oracles only every-step communication could know")
    avg.add_argument("--profile", default="quick", help="quick (the H sweep, one seed: ~9 min on one core) or full "
                                                        "(three seeds, 4x the steps, 4x the batch: ~42 min) or batch "
                                                        "(ddp, one worker alone, averaging every 40 steps and once, "
                                                        "at 16, 64, 256 sequences per worker: ~60 min)")
    avg.add_argument("--out", default=None, help="output folder (default bench-results/averaging-PROFILE)")
    avg.add_argument("--workers", type=int, default=8)
    avg.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    avg.set_defaults(func=cmd_bench_averaging)
    merge = bench.add_parser("merge", help="deltas merged per second, stage by stage, against a bare index_add_ "
                                           "of the same size measured in the same run")
    merge.add_argument("--params-model", default="gpt2-124m", help="gpt2-124m (124,439,808 params) or small")
    merge.add_argument("--fraction", type=float, default=0.001, help="share of each tensor a delta carries (p)")
    merge.add_argument("--deltas", type=int, default=200, help="deltas per index kind")
    merge.add_argument("--threads", type=int, default=1,
                       help="torch CPU threads (default 1: the coordinator's eval_threads default)")
    merge.add_argument("--out", default=None, help="output folder (default bench-results/merge)")
    merge.add_argument("--index", nargs="+", default=["random", "topk"],
                       help="index kinds: random (seeded, only a seed travels), topk (packed indices)")
    merge.add_argument("--snapshot-merges", type=int, default=3,
                       help="merges timed with a snapshot written each (the live path; ~13 s each at 124M)")
    merge.add_argument("--db-model", default="small", help="model of the Merger.step + SQLite stage")
    merge.add_argument("--db-deltas", type=int, default=50, help="merges timed through Merger.step (0: skip)")
    merge.set_defaults(func=cmd_bench_merge)
    load = bench.add_parser("load", help="N simulated workers (lease, pull, push over loopback HTTP) against a "
                                         "coordinator subprocess: latency percentiles per N")
    load.add_argument("--workers", type=int, nargs="+", default=[10, 100, 1000], help="worker counts N, one step each")
    load.add_argument("--think-s", type=float, default=10.0,
                      help="seconds a worker holds its lease between pull and push (the training), jittered x0.5-1.5")
    load.add_argument("--duration-s", type=float, default=60.0, help="measured seconds per N")
    load.add_argument("--warmup-s", type=float, default=None, help="seconds before measuring (default think + 5)")
    dbg = load.add_mutually_exclusive_group()
    dbg.add_argument("--database-url", default=None, help="PostgreSQL URL; the benchmark works in a fresh schema "
                                                          "and drops it (default $IDLETRAIN_TEST_POSTGRES or "
                                                          "postgresql+psycopg://postgres@127.0.0.1:5432/test)")
    dbg.add_argument("--sqlite", action="store_true", help="SQLite in the coordinator's data dir instead")
    load.add_argument("--model", default="gpt2-124m", help="gpt2-124m (124,439,808 params) or small")
    load.add_argument("--fraction", type=float, default=0.001, help="share of each tensor a delta carries (p)")
    load.add_argument("--pull", default="304", help="304: revalidate the snapshot (If-None-Match); update: GET the "
                                                    "int8 update between versions (heavy at 124M)")
    load.add_argument("--clients", type=int, default=None, help="client processes (default one per 500 workers)")
    load.add_argument("--shards", type=int, default=None, help="shards of the run (default: no epoch ends during "
                                                               "the benchmark)")
    load.add_argument("--no-update-probe", action="store_true", help="skip timing one update GET at the end")
    load.add_argument("--processes", type=int, default=1, help="coordinator processes (serve --processes; "
                                                                  "PostgreSQL only)")
    load.add_argument("--keep", action="store_true", help="keep the temporary data dir (coordinator log, blobs)")
    load.add_argument("--out", default=None, help="output folder (default bench-results/load)")
    load.set_defaults(func=cmd_bench_load)
    util = bench.add_parser("utilisation", help="the share of wall time a real worker computes, its upload "
                                                "throttled, overlap off and on side by side")
    util.add_argument("--rounds", type=int, default=16, help="rounds per worker run (default 16)")
    util.add_argument("--repeats", type=int, default=2, help="runs per mode, interleaved (default 2)")
    util.add_argument("--steps", type=int, default=20, help="local steps per round (default 20)")
    util.add_argument("--batch", type=int, default=8, help="sequences per local step (default 8)")
    util.add_argument("--upload-kbps", type=float, default=10_000.0, help="upload limit, kbit/s (default 10000)")
    util.add_argument("--threads", type=int, default=1, help="the worker's torch CPU threads (default 1)")
    util.add_argument("--modes", nargs="+", default=["off", "on", "ahead"],
                      help="off (worker setting overlap = false), on (overlap, today's coordinator), ahead "
                           "(overlap and the next lease fetched during the upload, against a coordinator patched "
                           "to keep that lease)")
    util.add_argument("--values", default=None, choices=["fp32", "fp16", "int8", "int4"],
                      help="the run's delta values (default: a run's default, int4)")
    util.add_argument("--update-values", default=None, choices=["int8", "int4"],
                      help="the run's model-update values (default: a run's default, int4)")
    util.add_argument("--out", default=None, help="output folder (default bench-results/utilisation)")
    util.set_defaults(func=cmd_bench_utilisation)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _setup_logging(args.log_level)
    return args.func(args)
