"""The public dashboard: GET / (one self-contained page) and the JSON behind every number on it.

The page (coordinator/static/dashboard.html) is inline HTML, CSS and JS with no external request:
it polls /api/v1/runs and /api/v1/runs/{run}/dashboard every few seconds and draws the loss chart
as SVG itself. Its Content-Security-Policy allows only its own inline script and style (by hash)
and requests to this coordinator, so it works offline and a name on the leaderboard cannot run code.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import re
from importlib import resources

from fastapi import APIRouter
from fastapi.responses import HTMLResponse
from starlette.concurrency import run_in_threadpool

from coordinator.api.deps import CoordinatorDep
from shared import protocol

router = APIRouter(tags=["dashboard"])


@functools.cache
def page() -> tuple[str, str]:
    """(the page, its Content-Security-Policy), read once from the package."""
    html = resources.files("coordinator").joinpath("static/dashboard.html").read_text(encoding="utf-8")

    def hashes(tag: str) -> str:
        found = re.findall(rf"<{tag}>(.*?)</{tag}>", html, flags=re.S)
        return " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(s.encode()).digest()).decode()}'"
                        for s in found)

    csp = (f"default-src 'none'; script-src {hashes('script')}; style-src {hashes('style')}; "
           "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'")
    return html, csp


@router.get("/", response_class=HTMLResponse,
            responses={200: {"content": {"text/html": {}}, "description": "the dashboard page"}})
async def dashboard_page() -> HTMLResponse:
    """The dashboard: eval loss over versions and time, progress, live workers, leaderboard, teams,
    traffic saved against dense synchronisation. `?run=NAME` picks a run (default: the newest)."""
    html, csp = page()
    return HTMLResponse(html, headers={"Content-Security-Policy": csp, "Cache-Control": "no-cache",
                                       "X-Content-Type-Options": "nosniff"})


@router.get(f"{protocol.API_PREFIX}/runs/{{run}}/dashboard", response_model=protocol.Dashboard)
async def run_dashboard(run: str, coord: CoordinatorDep) -> protocol.Dashboard:
    """Every number of the dashboard for one run (public: names and teams, never tokens or reasons)."""
    return await run_in_threadpool(coord.reports.dashboard, run)
