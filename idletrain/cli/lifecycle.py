"""A run's lifecycle from the operator's side: `idletrain run set|finish|archive|delete`, and the
token counts `run create --token-budget` reads (2e9, 500M, 1.5G, 2_000_000)."""

from __future__ import annotations

import argparse
import re

from idletrain.cli.client import OperatorClient
from idletrain.cli.common import ADMIN_TOKEN_HELP, DATA_DIR_HELP, DEFAULT_COORDINATOR, fail

_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "b": 10**9, "t": 10**12}
_COUNT = re.compile(r"^\s*([0-9][0-9_]*(?:\.[0-9]*)?(?:e[0-9]+)?)\s*([kmgbt]?)\s*$", re.IGNORECASE)


def token_count(text: str) -> int:
    """A token count as an operator writes it: 2000000000, 2_000_000_000, 2e9, 500M, 1.5G, 10k
    (k, M, G or B, T: thousands, millions, billions, trillions). argparse's error for anything else."""
    m = _COUNT.match(text)
    if m is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a token count: write e.g. 2000000000, 2e9, 500M or 1.5G")
    value = float(m.group(1).replace("_", "")) * _SUFFIX[m.group(2).lower()]
    if value < 1 or value != int(value) or value > 2**62:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of tokens from 1 to 2^62")
    return int(value)


def _budget_or_none(text: str) -> int | str:
    """A token count, or "none" (no budget)."""
    return "none" if text.strip().lower() in ("none", "off") else token_count(text)


def describe(summary: dict) -> str:
    """One line of a run's lifecycle: state, tokens of the budget, epoch of the epochs, priority."""
    budget = summary.get("token_budget")
    tokens = f"{summary.get('tokens_trained', 0):,}" + (f" of {budget:,}" if budget else "") + " tokens"
    epochs = summary.get("max_epochs")
    epoch = f"epoch {summary.get('epoch', 0) + 1} of {epochs}" if epochs else "epochs repeat"
    return f"run {summary['name']} is {summary['state']}: {tokens}, {epoch}, priority {summary.get('priority', 0)}"


def cmd_run_set(args: argparse.Namespace) -> int:
    body = {}
    if args.priority is not None:
        body["priority"] = args.priority
    if args.token_budget is not None:
        body["token_budget"] = None if args.token_budget == "none" else args.token_budget
    if args.epochs is not None:
        body["epochs"] = args.epochs
    if not body:
        return fail("say what to change: --priority, --token-budget or --epochs")
    rc, summary = OperatorClient(args).call("PATCH", f"/runs/{args.name}", admin=True, json=body)
    if rc:
        return rc
    print(describe(summary))
    return 0


def cmd_run_finish(args: argparse.Namespace) -> int:
    if args.grace is not None and args.grace < 0:
        return fail("--grace is a number of seconds, 0 or more")
    params = {"grace_s": args.grace} if args.grace is not None else None
    rc, summary = OperatorClient(args).call("POST", f"/runs/{args.name}/finish", admin=True, params=params)
    if rc:
        return rc
    print(describe(summary))
    print("it hands out no more leases; once the leases out are in"
          + (f" (at most {args.grace:g} s from now)" if args.grace is not None else "")
          + ", the coordinator evaluates the final model and exports it into the run's data dir "
            "(runs/<id>/exports/final/); `idletrain run show` says when it is finished")
    return 0


def cmd_run_archive(args: argparse.Namespace) -> int:
    rc, summary = OperatorClient(args).call("POST", f"/runs/{args.name}/archive", admin=True)
    if rc:
        return rc
    print(describe(summary))
    print("kept: the final model (its snapshot, a checkpoint, exports/final/), the evaluations and the "
          "workers' records; deleted: shards, deltas, model updates, older snapshots and checkpoints")
    return 0


def cmd_run_delete(args: argparse.Namespace) -> int:
    if not args.yes:
        return fail(f"deleting run {args.name!r} removes every row and file of it (its model and exports too) and "
                    f"cannot be undone: pass --yes to go ahead (`idletrain run archive {args.name}` keeps the final "
                    "model)")
    params = {"force": "true"} if args.force else None
    rc, deleted = OperatorClient(args).call("DELETE", f"/runs/{args.name}", admin=True, params=params)
    if rc:
        return rc
    print(f"run {deleted['name']} deleted: {sum(deleted['rows'].values()):,} rows, {deleted['files']:,} files")
    return 0


def register(run) -> None:
    """`idletrain run set|finish|archive|delete` on the `run` subcommands (operator.register_runs)."""
    rset = run.add_parser("set", help="change a run's token budget, epochs or priority")
    rset.add_argument("--priority", type=int, default=None,
                      help="workers following the coordinator train the active run of highest priority")
    rset.add_argument("--token-budget", type=_budget_or_none, default=None, metavar="N|none",
                      help="finish once N tokens are trained (2e9, 500M ...); none: no budget")
    rset.add_argument("--epochs", type=int, default=None, help="finish after N epochs; 0: repeat until finished")
    rset.set_defaults(func=cmd_run_set)
    fin = run.add_parser("finish", help="stop handing out leases; finish (final eval and export) once the "
                                        "leases out are in")
    fin.add_argument("--grace", type=float, default=None, metavar="SECONDS",
                     help="give up the leases still out after this long (default: wait until they are delivered "
                          "or expire)")
    fin.set_defaults(func=cmd_run_finish)
    arc = run.add_parser("archive", help="keep a finished (or paused) run's final model and records, delete the rest")
    arc.set_defaults(func=cmd_run_archive)
    rdel = run.add_parser("delete", help="remove a run: every row and file of it")
    rdel.add_argument("--yes", action="store_true", help="yes, delete it (there is no undo)")
    rdel.add_argument("--force", action="store_true", help="an active or finishing run too")
    rdel.set_defaults(func=cmd_run_delete)
    for sp in (rset, fin, arc, rdel):
        sp.add_argument("name")
        sp.add_argument("--coordinator", default=DEFAULT_COORDINATOR)
        sp.add_argument("--admin-token", default=None, help=ADMIN_TOKEN_HELP)
        sp.add_argument("--data-dir", default=None, help=DATA_DIR_HELP)
