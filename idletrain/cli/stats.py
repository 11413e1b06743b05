"""`idletrain stats export`: a run's daily summary into a file, in the manner of Folding@home's
daily_user_summary.txt: one line per contributor name and team, with the day's tokens, deltas and
credit and the totals up to and including it (columns: coordinator/stats.SUMMARY_COLUMNS), and
`idletrain stats daily`: every day's rows by contributor or team. Public numbers: no token needed."""

from __future__ import annotations

import argparse
import json
import sys
from datetime import date
from pathlib import Path
from urllib.parse import quote

from pydantic import ValidationError

from coordinator import stats
from idletrain.cli.client import OperatorClient
from idletrain.cli.common import DEFAULT_COORDINATOR, describe_validation, fail


def _day(text: str) -> date:
    try:
        return date.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a day: use YYYY-MM-DD (UTC)") from None


def _write(out: str, text: str) -> int:
    """Write `text` to the file `out` ('-': standard output)."""
    if out == "-":
        sys.stdout.write(text)
        return 0
    try:
        Path(out).write_text(text, encoding="utf-8")
    except OSError as exc:
        return fail(f"cannot write {out}: {exc.strerror or exc}; choose a path in a folder you can write")
    print(f"wrote {out}", file=sys.stderr)
    return 0


def cmd_stats_export(args: argparse.Namespace) -> int:
    rc, body = OperatorClient(args).call("get", f"/runs/{quote(args.run, safe='')}/stats/summary",
                                         params={"day": args.day.isoformat()} if args.day else None)
    if rc:
        return rc
    try:
        summary = stats.DailySummary.model_validate(body)
    except ValidationError as exc:
        return fail(f"the coordinator answered an unexpected summary ({describe_validation(exc)}); "
                    "is it the same idletrain version?")
    if args.format == "json":
        return _write(args.out, json.dumps(summary.model_dump(mode="json"), indent=1) + "\n")
    return _write(args.out, stats.to_csv(stats.SUMMARY_COLUMNS, summary.lines))


def cmd_stats_daily(args: argparse.Namespace) -> int:
    params = {"by": args.by, **{k: getattr(args, k).isoformat() for k in ("since", "until") if getattr(args, k)}}
    rc, body = OperatorClient(args).call("get", f"/runs/{quote(args.run, safe='')}/stats/daily", params=params)
    if rc:
        return rc
    try:
        rows = [stats.DailyRow.model_validate(row) for row in body]
    except (ValidationError, TypeError) as exc:
        return fail(f"the coordinator answered unexpected rows ({exc}); is it the same idletrain version?")
    if args.format == "json":
        return _write(args.out, json.dumps([r.model_dump(mode="json") for r in rows], indent=1) + "\n")
    return _write(args.out, stats.to_csv(stats.TEAM_COLUMNS if args.by == "team" else stats.DAILY_COLUMNS, rows))


def register(sub) -> None:
    st = sub.add_parser("stats", help="contributors' stats of a run: the daily summary, the daily rows")
    actions = st.add_subparsers(dest="action", required=True)
    exp = actions.add_parser(
        "export", help="a day's summary, one line per contributor (like Folding@home's daily_user_summary.txt)",
        description="One line per contributor name and team: " + ", ".join(stats.SUMMARY_COLUMNS) + " (the day's "
                    "numbers, then the totals up to and including it), most credit in total first. Unnamed "
                    "workers count together as 'anonymous'.")
    exp.add_argument("--day", type=_day, default=None, help="YYYY-MM-DD, UTC (default: today so far)")
    exp.set_defaults(func=cmd_stats_export)
    daily = actions.add_parser("daily", help="every day's rows, by contributor name and team or by team",
                               description="Columns: " + ", ".join(stats.DAILY_COLUMNS) + " (by team: no name).")
    daily.add_argument("--by", choices=("contributor", "team"), default="contributor")
    daily.add_argument("--since", type=_day, default=None, help="first day, YYYY-MM-DD (UTC)")
    daily.add_argument("--until", type=_day, default=None, help="last day, YYYY-MM-DD (UTC)")
    daily.set_defaults(func=cmd_stats_daily)
    for sp in (exp, daily):
        sp.add_argument("--run", required=True)
        sp.add_argument("--out", required=True, help="the file to write ('-': standard output)")
        sp.add_argument("--format", choices=("csv", "json"), default="csv", help="default: csv")
        sp.add_argument("--coordinator", default=DEFAULT_COORDINATOR)
