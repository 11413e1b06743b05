"""StatsService: the public contributors' stats of a run (daily rows by contributor or team, one
contributor's history, the daily summary) and its progress toward its token budget.

Every number comes from daily_stats, which moves in the transaction that moves each worker's ledger
(coordinator/queries/workers.py), so any coordinator process answers the same, and a restart loses
nothing. Public like the dashboard: names and teams, never tokens or standing reasons."""

from __future__ import annotations

from datetime import date, datetime, timedelta

from sqlalchemy import Connection, Row

from coordinator import names, stats
from coordinator.db import Database
from coordinator.errors import NotFound, Unprocessable
from coordinator.models import utcnow
from coordinator.queries import runs as run_rows
from coordinator.queries import stats as stat_rows
from coordinator.services.common import aware, named_run
from shared import protocol

RATE_WINDOW_S = 3600.0  # the recent rate of the ETA: tokens acknowledged over the last hour
RATE_DELTAS = 20_000  # the newest deltas that rate looks at: bounded work whatever the history


def run_progress(c: Connection, run: Row, *, now: datetime) -> protocol.RunProgress:
    """The run's progress (coordinator/stats.progress) at `now`, its rate over the last hour (or
    since it was created, when younger; or over the newest RATE_DELTAS deltas, when the hour holds
    more)."""
    window_s = min(RATE_WINDOW_S, max(0.0, (now - aware(run.created_at)).total_seconds()))
    tokens, n, oldest = stat_rows.recent_tokens(c, run.id, from_seq=run.next_seq - RATE_DELTAS,
                                                since=now - timedelta(seconds=window_s))
    if n >= RATE_DELTAS and oldest is not None:
        window_s = max(1e-3, (now - aware(oldest)).total_seconds())
    return stats.progress(state=run.state, tokens_done=run.tokens_trained, token_budget=run.token_budget,
                          recent_tokens=tokens, window_s=window_s)


class StatsService:
    MAX_ROWS = 100_000  # rows of one daily answer; ask for fewer days (since, until) past it
    MAX_LINES = 100_000  # contributors in one daily summary

    def __init__(self, db: Database) -> None:
        self.db = db

    def _run(self, c: Connection, run_name: str) -> Row:
        return named_run(run_rows.by_name(c, run_name), run_name)

    def daily(self, run_name: str, *, by_team: bool = False, since: date | None = None,
              until: date | None = None) -> list[stats.DailyRow]:
        if since is not None and until is not None and since > until:
            raise Unprocessable(f"since ({since}) is after until ({until})")
        with self.db.read() as c:
            run = self._run(c, run_name)
            rows = stat_rows.daily(c, run.id, by_team=by_team, since=since, until=until, limit=self.MAX_ROWS + 1)
        if len(rows) > self.MAX_ROWS:
            raise Unprocessable(f"more than {self.MAX_ROWS} rows: ask for fewer days (?since=YYYY-MM-DD"
                                "&until=YYYY-MM-DD)")
        return stats.daily_rows(rows)

    def summary(self, run_name: str, day: date | None = None) -> stats.DailySummary:
        """The daily summary of `day` (default: today, UTC, so far)."""
        day = day or utcnow().date()
        with self.db.read() as c:
            run = self._run(c, run_name)
            of_day = stat_rows.totals(c, run.id, until=day, only_day=True, limit=self.MAX_LINES)
            up_to = stat_rows.totals(c, run.id, until=day, only_day=False, limit=self.MAX_LINES)
        return stats.summary(run.name, day, of_day, up_to)

    def history(self, run_name: str, name: str) -> stats.ContributorHistory:
        """A contributor's days, found by its name as compared at registration (names.name_keys): the
        contributor of that exact name, else the oldest that looks like it."""
        try:
            keys = names.name_keys(names.clean(name) or "")
        except ValueError as exc:
            raise Unprocessable(str(exc)) from None
        with self.db.read() as c:
            run = self._run(c, run_name)
            found = stat_rows.holders(c, run.id, keys)
            exact = [h for h in found if h.name == name.strip()]
            shown = (exact or found)[0].name if found else name.strip()  # a worker named before names were claimed
            rows = stat_rows.history(c, run.id, shown)
            teams = stat_rows.teams_of(c, run.id, shown)
        if not found and not rows and not teams:
            raise NotFound(f"run {run_name!r} has no contributor named {name!r}")
        return stats.history(shown, teams, rows)

    def progress(self, run_name: str) -> protocol.RunProgress:
        with self.db.read() as c:
            return run_progress(c, self._run(c, run_name), now=utcnow())
