"""Contributors' stats (pure): the rows of the daily stats, a contributor's history, the daily summary
in the manner of Folding@home's daily_user_summary.txt, and a run's progress toward its token budget.

The unit is the contributor name: a volunteer's machines register under one name (with its
contributor key, coordinator/names.py) and count together; unnamed workers count together as
`anonymous` (name None). Days are UTC. What each row counts is the workers' ledger, per day:

    tokens     tokens of the deltas acknowledged that day
    accepted   deltas acknowledged that day (a delta later rejected at merge stays counted here)
    rejected   deltas refused at upload or rejected at merge that day
    credit     credit awarded that day (coordinator/credit.py) less any revoked that day
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterable
from datetime import date

from pydantic import BaseModel, Field

from shared import protocol


class DailyRow(BaseModel):
    day: date
    name: str | None = Field(description="contributor name (None: anonymous workers; always None by team)")
    team: str | None
    workers: int = Field(description="machines that counted that day")
    tokens: int
    deltas_accepted: int
    deltas_rejected: int
    credit: float


class HistoryDay(BaseModel):
    day: date
    workers: int
    tokens: int
    deltas_accepted: int
    deltas_rejected: int
    credit: float


class ContributorHistory(BaseModel):
    name: str
    teams: list[str]
    days: list[HistoryDay] = Field(description="oldest first; days without work are absent")
    tokens: int
    deltas_accepted: int
    deltas_rejected: int
    credit: float


class SummaryLine(BaseModel):
    """One contributor (name and team) in the daily summary: that day's numbers and the totals up to
    and including it."""

    name: str | None
    team: str | None
    tokens_day: int
    deltas_day: int
    credit_day: float
    tokens_total: int
    deltas_total: int
    credit_total: float


class DailySummary(BaseModel):
    run: str
    day: date
    lines: list[SummaryLine] = Field(description="most credit in total first")


DAILY_COLUMNS = ["day", "name", "team", "workers", "tokens", "deltas_accepted", "deltas_rejected", "credit"]
TEAM_COLUMNS = [c for c in DAILY_COLUMNS if c != "name"]  # by team
SUMMARY_COLUMNS = ["name", "team", "tokens_day", "deltas_day", "credit_day", "tokens_total", "deltas_total",
                   "credit_total"]
ANONYMOUS = "anonymous"  # how a CSV names unnamed workers


def daily_rows(rows: Iterable) -> list[DailyRow]:
    """From queries/stats.daily's tuples."""
    return [DailyRow(day=day, name=name, team=team, workers=n, tokens=int(t), deltas_accepted=int(a),
                     deltas_rejected=int(r), credit=float(cr)) for day, name, team, n, t, a, r, cr in rows]


def history(name: str, teams: list[str], rows: Iterable) -> ContributorHistory:
    """From queries/stats.history's tuples."""
    days = [HistoryDay(day=day, workers=n, tokens=int(t), deltas_accepted=int(a), deltas_rejected=int(r),
                       credit=float(cr)) for day, n, t, a, r, cr in rows]
    return ContributorHistory(name=name, teams=teams, days=days, tokens=sum(d.tokens for d in days),
                              deltas_accepted=sum(d.deltas_accepted for d in days),
                              deltas_rejected=sum(d.deltas_rejected for d in days),
                              credit=sum(d.credit for d in days))


def summary(run: str, day: date, of_day: Iterable, up_to_day: Iterable) -> DailySummary:
    """Join a day's numbers to the totals up to it (queries/stats.totals' tuples, each keyed by name
    and team); a contributor with no work that day is listed with zeros for it."""
    today = {(name, team): (int(t), int(a), float(cr)) for name, team, _, t, a, _, cr in of_day}
    lines = [SummaryLine(name=name, team=team, tokens_day=today.get((name, team), (0, 0, 0.0))[0],
                         deltas_day=today.get((name, team), (0, 0, 0.0))[1],
                         credit_day=today.get((name, team), (0, 0, 0.0))[2],
                         tokens_total=int(t), deltas_total=int(a), credit_total=float(cr))
             for name, team, _, t, a, _, cr in up_to_day]
    return DailySummary(run=run, day=day, lines=lines)


def to_csv(columns: list[str], rows: Iterable[BaseModel]) -> str:
    """Rows as CSV with a header line; credit with two decimals, no name as `anonymous`, no team empty.
    Every CSV export goes through here: text cells are neutralised (`spreadsheet_safe`), numbers are
    written as numbers (a negative credit stays a number)."""
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    w.writerow(columns)
    for row in rows:
        values = row.model_dump()
        w.writerow([_cell(col, values[col]) for col in columns])
    return out.getvalue()


FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")  # OWASP's CSV injection list: a spreadsheet evaluates these


def spreadsheet_safe(text: str) -> str:
    """`text` as a CSV cell no spreadsheet evaluates: one that begins with a formula character is
    prefixed with a single quote (OWASP's rule); the csv writer then quotes it as CSV quotes any cell."""
    return "'" + text if text.startswith(FORMULA_STARTS) else text


def _cell(column: str, value) -> str | int:
    if value is None:
        return ANONYMOUS if column == "name" else ""
    if isinstance(value, float):
        return f"{value:.2f}"
    if isinstance(value, int):
        return value
    if isinstance(value, date):
        return value.isoformat()
    return spreadsheet_safe(str(value))


def progress(*, state: str, tokens_done: int, token_budget: int | None, recent_tokens: int,
             window_s: float) -> protocol.RunProgress:
    """How far the run is toward its token budget, and when it gets there at the recent rate
    (`recent_tokens` acknowledged over the last `window_s` seconds). The ETA is None without a
    budget, without recent work, or while the run is not active."""
    rate = recent_tokens / window_s if window_s > 0 and recent_tokens > 0 else None
    fraction = min(1.0, tokens_done / token_budget) if token_budget else None
    eta_s = None
    if token_budget is not None and tokens_done >= token_budget:
        eta_s = 0.0
    elif token_budget is not None and rate is not None and state == "active":
        eta_s = (token_budget - tokens_done) / rate
    return protocol.RunProgress(tokens_trained=tokens_done, token_budget=token_budget, fraction=fraction,
                                tokens_per_s=rate, rate_window_s=window_s, eta_s=eta_s)
