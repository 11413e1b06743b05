"""The developer's commands: `idletrain demo` (a coordinator and local workers on this machine) and
`idletrain bench ...`, a forwarder to the benchmarks. Those live in a source checkout (`python -m
bench NAME`), not in the package volunteers install: the forwarder runs them when `bench` imports,
and says where to find them when it does not."""

from __future__ import annotations

import argparse
import importlib
import sys

BENCH_ELSEWHERE = ("the benchmarks live in the source repository, not in the installed package; run them from "
                   "a checkout: git clone <idletrain's repository> && cd idletrain && pip install -e '.[bench]' && "
                   "python -m bench convergence")


def cmd_demo(args: argparse.Namespace) -> int:
    from idletrain.cli.common import without_server
    from idletrain.demo import run_demo

    if (missing := without_server("idletrain demo")) is not None:
        return missing
    return run_demo(workers=args.workers, minutes=args.minutes, as_json=args.json, keep=args.keep)


def cmd_bench(args: argparse.Namespace) -> int:
    """`idletrain bench ARGS...` = `python -m bench ARGS...` in a source checkout."""
    try:  # imported by name: bench is an optional neighbour of this package, never a dependency of it
        bench_main = importlib.import_module("bench.__main__")
    except ModuleNotFoundError as exc:
        if exc.name not in ("bench", "bench.__main__"):
            raise  # bench is there and lacks something: its own error says what
        print(f"idletrain: {BENCH_ELSEWHERE}", file=sys.stderr)
        return 2
    return bench_main.main(["--log-level", args.log_level, *args.bench_args], prog="idletrain bench")


def register(sub) -> None:
    """`idletrain demo`, `idletrain bench ...`."""
    demo = sub.add_parser("demo", help="a coordinator and local workers on this machine, over real HTTP")
    demo.add_argument("--workers", type=int, default=3)
    demo.add_argument("--minutes", type=float, default=3.0, help="training time (startup and summary add ~30 s)")
    demo.add_argument("--json", action="store_true", help="end with the summary as one JSON line")
    demo.add_argument("--keep", action="store_true", help="keep the temporary data dir")
    demo.set_defaults(func=cmd_demo)

    # every word after `bench` is the benchmarks' own, --help included: no option of this parser's
    bench = sub.add_parser("bench", add_help=False, prefix_chars="+",
                           help="benchmarks, from a source checkout (python -m bench)")
    bench.add_argument("bench_args", nargs=argparse.REMAINDER, metavar="ARGS")
    bench.set_defaults(func=cmd_bench)
