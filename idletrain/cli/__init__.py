"""`idletrain …`: every subcommand with --help. Errors print what to do and exit 2.

One module per audience; each registers its own subcommands on the parser `build_parser` makes:

    volunteer.py   worker run; worker pause|resume|status (the local worker, through its state dir)
    serve.py       the operator's coordinator process: coordinator serve|migrate
    operator.py    the operator against a running coordinator: run create|list|show|pause|resume,
                   worker list|revoke|readmit, status
    model.py       a run's model: export (.safetensors or a Hugging Face folder), sample
    lifecycle.py   a run's lifecycle: run set|finish|archive|delete; token counts (2e9, 500M)
    stats.py       stats export|daily: a run's daily summary (like Folding@home's) and daily rows
    teams.py       team create|list|delete: registered teams (a key, verified members, a lease cap)
    data.py        data prepare: a corpus into token shards and a manifest (shared/dataset.py)
    client.py      OperatorClient: the one HTTP client of operator.py (base URL, admin token, errors)
    developer.py   demo; bench (forwards to `python -m bench` in a source checkout)
    common.py      fail (exit 2 with a line on stderr), logging set-up, shared help texts
"""

from __future__ import annotations

import argparse

from idletrain.cli import data, developer, lifecycle, model, operator, serve, stats, teams, volunteer
from idletrain.cli.common import setup_logging


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="idletrain", description="Train one model on many idle machines.")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = p.add_subparsers(dest="command", required=True)
    serve.register(sub)
    lifecycle.register(operator.register_runs(sub))
    operator.register_workers(volunteer.register(sub))
    operator.register_status(sub)
    model.register(sub)
    stats.register(sub)
    teams.register(sub)
    data.register(sub)
    developer.register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level)
    return args.func(args)
