"""`python -m bench field`'s command line: options checked, then bench.field.run."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from idletrain.cli.common import fail


def cmd(args: argparse.Namespace) -> int:
    from bench.field.net import available
    from bench.field.run import PROFILES, run
    from bench.wallclock_cli import can_plot

    if not can_plot():
        return fail("the benchmark plots with matplotlib: pip install -e '.[bench]' (in a source checkout)")
    if args.profile not in PROFILES:
        return fail(f"unknown profile {args.profile!r}: pick one of {', '.join(PROFILES)}")
    if problem := available():
        return fail(problem)
    if not 0 < args.cpu_share <= 1 or not 0 < args.coord_share <= 1:
        return fail("--cpu-share and --coord-share are fractions of one core: in (0, 1]")
    if args.hivemind_python:
        import subprocess
        probe = subprocess.run([args.hivemind_python, "-c", "import hivemind"], capture_output=True)
        if probe.returncode != 0:
            return fail(f"{args.hivemind_python} cannot import hivemind: python3 -m venv V && V/bin/pip install "
                        "torch==2.13.0 hivemind, then pass --hivemind-python V/bin/python")
    out = Path(args.out or f"bench-results/field-{args.profile}")
    command = "python -m bench " + shlex.join(sys.argv[1:]) if sys.argv[1:2] == ["field"] else "python -m bench field"
    results = run(profile=args.profile, out=out, corpus=args.corpus, sweep_all=args.sweep_all, cpu_share=args.cpu_share,
                  coord_share=args.coord_share, keep=args.keep, keep_checkpoints=args.keep_checkpoints,
                  hivemind_python=args.hivemind_python, command=command)
    print((out / "results.md").read_text())
    print(f"wrote {out / 'results.json'}, {out / 'results.md'}, {out / 'loss.png'}")
    return 0 if results["rows"] else 1


def add_parser(sub) -> None:
    p = sub.add_parser("field", help="the real system on shaped links: a coordinator and N workers in network "
                                     "namespaces at 10/50 Mbit/s against data-parallel (ring, parameter server, "
                                     "compressed) and one worker alone (needs root)")
    p.add_argument("--profile", default="quick", help="quick (one seed, 3 min a row: ~35 min), full (three seeds, "
                                                      "~1M parameters, 15 min a row: ~10 h) or tiny (the tests')")
    p.add_argument("--out", default=None, help="output folder (default bench-results/field-PROFILE)")
    p.add_argument("--corpus", default="builtin:stdlib",
                   help="the run's corpus (a path on this machine, or builtin:stdlib)")
    p.add_argument("--sweep-all", action="store_true", help="sweep the lr of every data-parallel variant (default: "
                                                            "the variants take the lr ring fp32 chose)")
    p.add_argument("--cpu-share", type=float, default=0.15, help="each training process's cap, a fraction of one core")
    p.add_argument("--coord-share", type=float, default=0.4, help="the coordinator's (and parameter server's) cap")
    p.add_argument("--hivemind-python", default=None,
                   help="the python of a venv that holds hivemind (python3 -m venv V && V/bin/pip install "
                        "torch==2.13.0 hivemind): adds hivemind's rows")
    p.add_argument("--keep", action="store_true", help="keep the rows already in OUT/results.json (resume)")
    p.add_argument("--keep-checkpoints", action="store_true", help="keep the data-parallel rows' checkpoints")
    p.set_defaults(func=cmd)
