"""A run's status and its evaluation now (ReportService); the dashboard's and /metrics' routes are
dashboard.py and metrics.py."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from coordinator.api import relay
from coordinator.api.deps import AdminDep, CoordinatorDep
from shared import protocol

router = APIRouter(prefix=protocol.API_PREFIX, tags=["reports"])


@router.get("/runs/{run}/status", response_model=protocol.RunStatus)
async def run_status(run: str, coord: CoordinatorDep) -> protocol.RunStatus:
    return await run_in_threadpool(coord.reports.status, run)


@router.post("/runs/{run}/evaluate", response_model=protocol.EvalPoint)
async def evaluate(run: str, request: Request, coord: CoordinatorDep, _: AdminDep) -> protocol.EvalPoint:
    """Evaluate the current global model now (operators; the merger also does it every eval_every)."""
    if not coord.live.leads:  # the live model is in another coordinator process
        return await relay.forward(request, b"", coord)
    return await run_in_threadpool(coord.reports.evaluate_now, run)
