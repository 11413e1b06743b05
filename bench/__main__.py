"""`python -m bench NAME [...]`: the benchmarks, run from a source checkout (`pip install -e '.[bench]'`;
`idletrain bench NAME` forwards here). Each checks its options, runs, prints its results.md and the
files it wrote (results.json, results.md, a plot) under --out."""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.wallclock_cli import can_plot, wallclock_parser
from idletrain.cli.common import fail, setup_logging


def cmd_bench_convergence(args: argparse.Namespace) -> int:
    if not can_plot():
        return fail("the benchmark plots with matplotlib: pip install -e '.[bench]' (in a source checkout)")
    from bench.convergence import PROFILES, device_problem, run
    from bench.convergence_long import LONG_PROFILES

    if args.profile not in PROFILES and args.profile not in LONG_PROFILES:
        return fail(f"unknown profile {args.profile!r}: pick one of {', '.join(sorted([*PROFILES, *LONG_PROFILES]))}")
    if args.jobs < 1:
        return fail("--jobs must be at least 1")
    if args.profile in LONG_PROFILES:
        return _convergence_long(args)
    if args.workers < 2:
        return fail("--workers must be at least 2")
    if args.hetero < 1:
        return fail("--hetero is the fastest worker's speed over the slowest's: 1 or more")
    if problem := device_problem(args.profile):
        return fail(problem)
    out = Path(args.out or f"bench-results/convergence-{args.profile}")
    rows = run(profile=args.profile, out=out, workers=args.workers, hetero=args.hetero, only=args.only,
               threads=args.threads)
    print((out / "results.md").read_text())
    print(f"wrote {out / 'results.json'}, {out / 'results.md'}, {out / 'loss.png'}")
    return 0 if rows else 1


def cmd_bench_regime(args: argparse.Namespace) -> int:
    if not can_plot():
        return fail("the benchmark plots with matplotlib: pip install -e '.[bench]' (in a source checkout)")
    from bench.regime import PROFILES, run

    if args.profile not in PROFILES:
        return fail(f"unknown profile {args.profile!r}: pick one of {', '.join(sorted(PROFILES))}")
    if args.jobs < 1:
        return fail("--jobs must be at least 1")
    out = Path(args.out or "bench-results/regime")
    run(profile=args.profile, out=out, jobs=args.jobs, keep=args.keep)
    print((out / "results.md").read_text())
    print(f"wrote {out / 'results.json'}, {out / 'results.md'}, {out / 'gain.png'}")
    return 0


def _convergence_long(args: argparse.Namespace) -> int:
    from bench.convergence_long import run

    out = Path(args.out or f"bench-results/convergence-{args.profile}")
    rows = run(profile=args.profile, out=out, jobs=args.jobs, keep=args.keep, only=args.only)
    print((out / "results.md").read_text())
    print(f"wrote {out / 'results.json'}, {out / 'results.md'}, {out / 'loss.png'}")
    return 0 if rows else 1


def cmd_bench_averaging(args: argparse.Namespace) -> int:
    if not can_plot():
        return fail("the benchmark plots with matplotlib: pip install -e '.[bench]' (in a source checkout)")
    from bench.averaging import PROFILES, run

    if args.profile not in PROFILES:
        return fail(f"unknown profile {args.profile!r}: pick {', '.join(PROFILES)}")
    if args.workers < 2:
        return fail("--workers must be at least 2")
    if args.threads is not None and args.threads < 1:
        return fail("--threads must be at least 1")
    out = Path(args.out or f"bench-results/averaging-{args.profile}")
    run(profile=args.profile, out=out, workers=args.workers, threads=args.threads)
    print((out / "results.md").read_text())
    print(f"wrote {out / 'results.json'}, {out / 'results.md'}, {out / 'ratio.png'}")
    return 0


def cmd_bench_merge(args: argparse.Namespace) -> int:
    if not can_plot():
        return fail("the benchmark plots with matplotlib: pip install -e '.[bench]' (in a source checkout)")
    from bench.merge import INDEX_KINDS, PARAM_MODELS, run

    for name in (args.params_model, args.db_model):
        if name not in PARAM_MODELS:
            return fail(f"unknown model {name!r}: pick one of {', '.join(PARAM_MODELS)}")
    if not 0 < args.fraction <= 1:
        return fail("--fraction must be in (0, 1]")
    if args.deltas < 1 or args.snapshot_merges < 0 or args.db_deltas < 0:
        return fail("--deltas must be at least 1; --snapshot-merges and --db-deltas at least 0")
    if args.threads is not None and args.threads < 1:
        return fail("--threads must be at least 1")
    bad = [k for k in args.index if k not in INDEX_KINDS]
    if bad or not args.index:
        return fail(f"--index takes one or more of {', '.join(INDEX_KINDS)}")
    out = Path(args.out or "bench-results/merge")
    result = run(params_model=args.params_model, fraction=args.fraction, deltas=args.deltas, threads=args.threads,
                 out=out, index_kinds=args.index, snapshot_merges=args.snapshot_merges, db_model=args.db_model,
                 db_deltas=args.db_deltas)
    print((out / "results.md").read_text())
    print(f"wrote {out / 'results.json'}, {out / 'results.md'}, {out / 'stages.png'}")
    return 0 if result["rows"] else 1


def cmd_bench_load(args: argparse.Namespace) -> int:
    if not can_plot():
        return fail("the benchmark plots with matplotlib: pip install -e '.[bench]' (in a source checkout)")
    from bench.load import DEFAULT_PG_URL, PULL_MODES, model_configs, run

    if args.model not in model_configs():
        return fail(f"unknown model {args.model!r}: pick one of {', '.join(model_configs())}")
    if not args.workers or min(args.workers) < 1:
        return fail("--workers takes one or more positive counts")
    if args.think_s <= 0 or args.duration_s <= 0 or (args.warmup_s is not None and args.warmup_s < 0):
        return fail("--think-s and --duration-s must be positive, --warmup-s at least 0")
    if not 0 < args.fraction <= 1:
        return fail("--fraction must be in (0, 1]")
    if args.pull not in PULL_MODES:
        return fail(f"--pull takes one of {', '.join(PULL_MODES)}")
    if args.processes < 1 or (args.processes > 1 and args.sqlite):
        return fail("--processes takes 1 or more, and several processes need PostgreSQL (drop --sqlite)")
    if (args.clients is not None and args.clients < 1) or (args.shards is not None and args.shards < 1):
        return fail("--clients and --shards must be at least 1")
    out = Path(args.out or "bench-results/load")
    result = run(workers=args.workers, think_s=args.think_s, duration_s=args.duration_s, warmup_s=args.warmup_s,
                 database_url=None if args.sqlite else (args.database_url or DEFAULT_PG_URL), model=args.model,
                 fraction=args.fraction, pull=args.pull, clients=args.clients, shards=args.shards, out=out,
                 update_probe=not args.no_update_probe, keep=args.keep, processes=args.processes)
    print((out / "results.md").read_text())
    print(f"wrote {out / 'results.json'}, {out / 'results.md'}, {out / 'p99.png'}")
    return 0 if result["rows"] else 1


def cmd_bench_utilisation(args: argparse.Namespace) -> int:
    if not can_plot():
        return fail("the benchmark plots with matplotlib: pip install -e '.[bench]' (in a source checkout)")
    from bench.utilisation import MODES, run

    bad = [m for m in args.modes if m not in MODES]
    if bad or not args.modes:
        return fail(f"--modes takes one or more of {', '.join(MODES)}")
    if min(args.rounds, args.repeats, args.steps, args.batch, args.threads) < 1 or args.upload_kbps <= 0:
        return fail("--rounds, --repeats, --steps, --batch and --threads must be at least 1, --upload-kbps positive")
    out = Path(args.out or "bench-results/utilisation")
    command = (f"python -m bench utilisation --rounds {args.rounds} --repeats {args.repeats} --steps {args.steps} "
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


def cmd_bench_models(args: argparse.Namespace) -> int:
    if not can_plot():
        return fail("the benchmark plots with matplotlib: pip install -e '.[bench]' (in a source checkout)")
    from bench.models import PROFILES, run

    if args.profile not in PROFILES:
        return fail(f"unknown profile {args.profile!r}: pick one of {', '.join(PROFILES)}")
    if args.threads is not None and args.threads < 1:
        return fail("--threads must be at least 1")
    out = Path(args.out or f"bench-results/models-{args.profile}")
    run(profile=args.profile, out=out, threads=args.threads, rows=args.only)
    print((out / "results.md").read_text())
    print(f"wrote {out / 'results.json'}, {out / 'results.md'}, {out / 'bpb.png'}")
    return 0


def _convergence_parser(sub) -> None:
    conv = sub.add_parser("convergence", help="ddp vs diloco vs sparta vs compressed, same tokens, side by side")
    conv.add_argument("--profile", default="quick", help="quick (< 10 min on 2 cores), full (< 60 min), long "
                                                         "(replicas 1-8, 100 rounds: hours on 2 cores, see --jobs), "
                                                         "long-probe (what bounds long's gain: M = 8, 25 rounds, "
                                                         "batch 4 and 16; ~1 h on 2 cores) or gpu (25M parameters on one CUDA device, < 8 min)")
    conv.add_argument("--out", default=None, help="output folder (default bench-results/convergence-PROFILE)")
    conv.add_argument("--workers", type=int, default=8)
    conv.add_argument("--hetero", type=float, default=1.0,
                      help="worker speeds spread geometrically up to this factor (4 = fastest is 4x the slowest)")
    conv.add_argument("--only", nargs="*", default=None, help="run only methods whose name contains one of these "
                                                              "(ddp always runs: it is the reference)")
    conv.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    conv.add_argument("--jobs", type=int, default=2, help="long profile: rows trained at once, one process and one "
                                                          "torch thread each")
    conv.add_argument("--keep", action="store_true", help="long profile: keep the rows already in OUT/results.json "
                                                          "and train only the missing ones (resume)")
    conv.set_defaults(func=cmd_bench_convergence)


def _regime_parser(sub) -> None:
    regime = sub.add_parser("regime", help="the run length from which the long-run defaults win: short-run "
                                           "defaults vs the long-run configuration vs ddp and one worker, 8 workers, "
                                           "runs of 400-3,200 local steps a worker (~12 min in 2 processes)")
    regime.add_argument("--profile", default="default", help="default, or tiny (the tests')")
    regime.add_argument("--out", default=None, help="output folder (default bench-results/regime)")
    regime.add_argument("--jobs", type=int, default=2, help="rows trained at once, one process and one torch "
                                                             "thread each")
    regime.add_argument("--keep", action="store_true", help="keep the rows already in OUT/results.json (resume)")
    regime.set_defaults(func=cmd_bench_regime)


def _averaging_parser(sub) -> None:
    avg = sub.add_parser("averaging", help="where averaging AdamW workers loses against ddp: workers in "
                                             "lock-step against oracles only every-step communication could know")
    avg.add_argument("--profile", default="quick", help="quick (the H sweep, one seed: ~9 min on one core) or full "
                                                        "(three seeds, 4x the steps, 4x the batch: ~42 min) or batch "
                                                        "(ddp, one worker alone, averaging every 40 steps and once, "
                                                        "at 16, 64, 256 sequences per worker: ~60 min)")
    avg.add_argument("--out", default=None, help="output folder (default bench-results/averaging-PROFILE)")
    avg.add_argument("--workers", type=int, default=8)
    avg.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    avg.set_defaults(func=cmd_bench_averaging)


def _merge_parser(sub) -> None:
    merge = sub.add_parser("merge", help="deltas merged per second, stage by stage, against a bare index_add_ "
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


def _load_parser(sub) -> None:
    load = sub.add_parser("load", help="N simulated workers (lease, pull, push over loopback HTTP) against a "
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


def _utilisation_parser(sub) -> None:
    util = sub.add_parser("utilisation", help="the share of wall time a real worker computes, its upload "
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
    util.add_argument("--values", default=None, choices=["fp32", "fp16", "int8", "int4", "int2"],
                      help="the run's delta values (default: a run's default, int4)")
    util.add_argument("--update-values", default=None, choices=["int8", "int4"],
                      help="the run's model-update values (default: a run's default, int4)")
    util.add_argument("--out", default=None, help="output folder (default bench-results/utilisation)")
    util.set_defaults(func=cmd_bench_utilisation)


def _models_parser(sub) -> None:
    models = sub.add_parser("models", help="bytes vs BPE, GPT vs Llama-style: the same training bytes, held-out "
                                             "loss in bits per byte")
    models.add_argument("--profile", default="quick", help="quick (~10 min on 2 idle cores, 23 with one busy) or full (5x the steps, 8192-token BPE: over an hour)")
    models.add_argument("--out", default=None, help="output folder (default bench-results/models-PROFILE)")
    models.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    models.add_argument("--only", nargs="*", default=None,
                        help="run only rows whose name contains one of these (e.g. 'bpe + Llama')")
    models.set_defaults(func=cmd_bench_models)


def build_parser(prog: str = "python -m bench") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Benchmarks: one command each, results + a plot.")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = p.add_subparsers(dest="action", required=True)
    from bench import spotcheck, spotcheck_sparta
    from bench.field import cli as field_cli

    for add in (_convergence_parser, _regime_parser, _averaging_parser, _merge_parser, _load_parser,
                _utilisation_parser, _models_parser, wallclock_parser, spotcheck.add_parser,
                spotcheck_sparta.add_parser, field_cli.add_parser):
        add(sub)
    return p


def main(argv: list[str] | None = None, prog: str = "python -m bench") -> int:
    args = build_parser(prog).parse_args(argv)
    setup_logging(args.log_level)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
