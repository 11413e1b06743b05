"""`python -m bench wallclock`'s command line: its options checked, then the profile's run, a long profile's
clocks of `bench convergence --profile long`'s curves, or an earlier run's curves on new links (--reclock)."""

from __future__ import annotations

import argparse
from pathlib import Path

from idletrain.cli.common import fail


def can_plot() -> bool:
    """Whether matplotlib (the bench extra) is installed: every benchmark writes a plot."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def cmd_bench_wallclock(args: argparse.Namespace) -> int:
    if not can_plot():
        return fail("the benchmark plots with matplotlib: pip install -e '.[bench]' (in a source checkout)")
    from bench.wallclock import PROFILES, run

    if args.profile not in PROFILES and args.profile != "long":
        return fail(f"unknown profile {args.profile!r}: pick one of {', '.join([*PROFILES, 'long'])}")
    if args.workers is not None and args.workers < 2:
        return fail("--workers must be at least 2")
    if not args.up_mbps or min(args.up_mbps) <= 0 or args.down_ratio <= 0 or args.rtt_ms < 0:
        return fail("--up-mbps takes one or more positive rates, --down-ratio is positive, --rtt-ms 0 or more")
    if args.hetero < 1 or args.coordinator_mbps < 0 or args.rank < 1:
        return fail("--hetero is 1 or more, --coordinator-mbps 0 (no bound) or more, --rank at least 1")
    if (args.threads is not None and args.threads < 1) or (args.step_ms is not None and args.step_ms <= 0):
        return fail("--threads must be at least 1, --step-ms positive")
    out = Path(args.out or f"bench-results/wallclock-{args.profile}")
    ups = " ".join(f"{x:g}" for x in args.up_mbps)
    command = (f"python -m bench wallclock --profile {args.profile} --up-mbps {ups} --down-ratio {args.down_ratio:g} "
               f"--rtt-ms {args.rtt_ms:g} --hetero {args.hetero:g} --coordinator-mbps {args.coordinator_mbps:g} "
               f"--rank {args.rank}"
               + (f" --workers {args.workers}" if args.workers else "")
               + (f" --threads {args.threads}" if args.threads else "")
               + (f" --step-ms {args.step_ms:g}" if args.step_ms else ""))
    if args.reclock:
        return _wallclock_reclock(args, command)
    if args.profile == "long":
        return _wallclock_long(args, out, command)
    result = run(profile=args.profile, out=out, workers=args.workers, up_mbps=tuple(args.up_mbps),
                 down_ratio=args.down_ratio, rtt_ms=args.rtt_ms, hetero=args.hetero,
                 coordinator_mbps=args.coordinator_mbps or None, rank=args.rank, threads=args.threads,
                 only=args.only, step_ms=args.step_ms, command=command)
    print((out / "results.md").read_text())
    print(f"wrote {out / 'results.json'}, {out / 'results.md'}, {out / 'wallclock.png'}")
    return 0 if result["rows"] else 1


def _wallclock_reclock(args: argparse.Namespace, command: str) -> int:
    from bench.wallclock_reclock import run

    source = Path(args.reclock)
    if not args.step_ms:
        return fail("--reclock charges the step time you give: add --step-ms MS (one worker step, measured on a quiet "
                    "machine)")
    if not (source / "results.json").exists():
        return fail(f"no wallclock results in {source}: --reclock takes the folder of an earlier `bench wallclock` run")
    out = Path(args.out or f"{source}-reclocked")
    command = command.replace(f"--profile {args.profile} ", "") + f" --reclock {source}"
    result = run(source=source, out=out, step_ms=args.step_ms, up_mbps=tuple(args.up_mbps),
                 down_ratio=args.down_ratio, rtt_ms=args.rtt_ms, hetero=args.hetero,
                 coordinator_mbps=args.coordinator_mbps or None, command=command)
    print((out / "results.md").read_text())
    print(f"wrote {out / 'results.json'}, {out / 'results.md'}, {out / 'wallclock.png'}")
    return 0 if result["rows"] else 1


def _wallclock_long(args: argparse.Namespace, out: Path, command: str) -> int:
    from bench.wallclock_long import run

    source = Path(args.source or "bench-results/convergence-long")
    if not (source / "results.json").exists():
        return fail(f"no long convergence results in {source}: run `python -m bench convergence --profile long "
                    f"--out {source}` first (hours on 2 cores), or pass --from DIR")
    result = run(source=source, out=out, up_mbps=tuple(args.up_mbps), down_ratio=args.down_ratio, rtt_ms=args.rtt_ms,
                 hetero=args.hetero, coordinator_mbps=args.coordinator_mbps or None, step_ms=args.step_ms,
                 threads=args.threads, command=f"{command} --from {source}")
    print((out / "results.md").read_text())
    print(f"wrote {out / 'results.json'}, {out / 'results.md'}, {out / 'wallclock.png'}")
    return 0 if result["rows"] else 1


def wallclock_parser(sub) -> None:
    wall = sub.add_parser("wallclock", help="loss against simulated wall-clock over home links: ddp (fp32, int8, "
                                              "PowerSGD), one worker alone, the default, the best compressed rows")
    wall.add_argument("--profile", default="quick", help="tiny (seconds), quick (4 workers, 80 steps: 10-20 min on one "
                                                         "core, by the load), default (8 workers, 160 steps: 4x that) "
                                                         "or long (clocks `convergence --profile long`'s curves: "
                                                         "no training, see --from)")
    wall.add_argument("--out", default=None, help="output folder (default bench-results/wallclock-PROFILE)")
    wall.add_argument("--workers", type=int, default=None, help="workers (default: the profile's)")
    wall.add_argument("--up-mbps", type=float, nargs="+", default=[10.0, 100.0, 1000.0],
                      help="uplink rates, one panel each, Mbit/s (default 10 100 1000)")
    wall.add_argument("--down-ratio", type=float, default=5.0, help="downlink / uplink (default 5: 10 up, 50 down)")
    wall.add_argument("--rtt-ms", type=float, default=30.0, help="round-trip time, ms (default 30)")
    wall.add_argument("--hetero", type=float, default=1.0,
                      help="link rates spread geometrically down to 1/this (4: the slowest worker has 1/4 the rates)")
    wall.add_argument("--coordinator-mbps", type=float, default=1000.0,
                      help="the coordinator's link, shared by every worker at once, Mbit/s each way (0: no bound)")
    wall.add_argument("--rank", type=int, default=4, help="PowerSGD's rank (default 4)")
    wall.add_argument("--only", nargs="*", default=None, help="run only rows whose name contains one of these "
                                                              "(ddp fp32 and one worker alone always run)")
    wall.add_argument("--step-ms", type=float, default=None, help="one worker step's compute, ms, charged to every "
                                                                   "row (default: the fastest of 20 timed here)")
    wall.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    wall.add_argument("--reclock", default=None, metavar="DIR",
                      help="train nothing: put the curves of an earlier run's DIR/results.json on these links, "
                           "charging --step-ms per step (default output DIR-reclocked)")
    wall.add_argument("--from", dest="source", default=None,
                      help="long profile: the `bench convergence --profile long` output whose curves it clocks "
                           "(default bench-results/convergence-long)")
    wall.set_defaults(func=cmd_bench_wallclock)
