"""Contributors' stats and a run's progress (StatsService), public like the dashboard: daily rows by
contributor or team (JSON or CSV), one contributor's history, the daily summary, the progress.

Answers may be cached for STATS_MAX_AGE_S by a browser or a proxy: the numbers move with every
delta, and a minute late is fine for a table people read; the progress is never cached."""

from __future__ import annotations

from datetime import date
from typing import Literal

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from coordinator import stats
from coordinator.api.deps import CoordinatorDep
from shared import protocol

router = APIRouter(prefix=protocol.API_PREFIX, tags=["stats"])

STATS_MAX_AGE_S = 60
Format = Literal["json", "csv"]


def _answer(rows: list, columns: list[str], fmt: Format, filename: str) -> Response:
    headers = {"Cache-Control": f"public, max-age={STATS_MAX_AGE_S}"}
    if fmt == "csv":
        headers["Content-Disposition"] = f'attachment; filename="{filename}.csv"'
        return Response(stats.to_csv(columns, rows), media_type="text/csv; charset=utf-8", headers=headers)
    return JSONResponse([row.model_dump(mode="json") for row in rows], headers=headers)


@router.get("/runs/{run}/stats/daily", response_model=list[stats.DailyRow],
            responses={200: {"content": {"text/csv": {}}}})
async def daily_stats(run: str, coord: CoordinatorDep, format: Format = "json",
                      by: Literal["contributor", "team"] = "contributor", since: date | None = None,
                      until: date | None = None) -> Response:
    """Per UTC day and contributor name and team (`by=team`: per day and named team): machines,
    tokens, deltas accepted and rejected, credit; oldest day first. `since` and `until`
    (YYYY-MM-DD, inclusive) pick the days."""
    rows = await run_in_threadpool(coord.stats.daily, run, by_team=by == "team", since=since, until=until)
    return _answer(rows, stats.TEAM_COLUMNS if by == "team" else stats.DAILY_COLUMNS, format, f"{run}-daily-{by}")


@router.get("/runs/{run}/stats/summary", response_model=stats.DailySummary,
            responses={200: {"content": {"text/csv": {}}}})
async def daily_summary(run: str, coord: CoordinatorDep, format: Format = "json",
                        day: date | None = None) -> Response:
    """One line per contributor name and team: the day's tokens, deltas and credit, and the totals up
    to and including it (default day: today, UTC, so far), most credit in total first."""
    summary = await run_in_threadpool(coord.stats.summary, run, day)
    if format == "csv":
        return _answer(summary.lines, stats.SUMMARY_COLUMNS, format, f"{run}-summary-{summary.day}")
    return JSONResponse(summary.model_dump(mode="json"), headers={"Cache-Control": f"public, max-age={STATS_MAX_AGE_S}"})


@router.get("/runs/{run}/contributors/{name:path}/history", response_model=stats.ContributorHistory)
async def contributor_history(run: str, name: str, coord: CoordinatorDep) -> stats.ContributorHistory:
    """A contributor's days (all its machines together), found by name as registration compares
    names: ignoring case, width, invisible characters and lookalike letters."""
    return await run_in_threadpool(coord.stats.history, run, name)


@router.get("/runs/{run}/progress", response_model=protocol.RunProgress)
async def run_progress(run: str, coord: CoordinatorDep) -> protocol.RunProgress:
    """Tokens trained of the run's token budget, and the ETA at the last hour's rate."""
    return await run_in_threadpool(coord.stats.progress, run)
