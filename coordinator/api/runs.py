"""Runs: create (operator), list, status."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from coordinator.api import relay
from coordinator.api.deps import AdminDep, CoordinatorDep
from shared import protocol
from shared.config import RunConfig

router = APIRouter(prefix=protocol.API_PREFIX, tags=["runs"])


@router.post("/runs", status_code=201, response_model=protocol.RunCreated)
async def create_run(cfg: RunConfig, coord: CoordinatorDep, _: AdminDep) -> protocol.RunCreated:
    """Create a training run: reads the corpus, cuts shards, initialises the model (version 0)."""
    return await run_in_threadpool(coord.create_run, cfg)


@router.get("/runs", response_model=list[protocol.RunSummary])
async def list_runs(coord: CoordinatorDep) -> list[protocol.RunSummary]:
    return await run_in_threadpool(coord.list_runs)


@router.get("/runs/{run}/status", response_model=protocol.RunStatus)
async def run_status(run: str, coord: CoordinatorDep) -> protocol.RunStatus:
    return await run_in_threadpool(coord.status, run)


# Public: neither the join key nor the corpus (a path on the coordinator's disk) leaves the operator.
@router.get("/runs/{run}/config", response_model=RunConfig, response_model_exclude={"join_key", "corpus"})
async def run_config(run: str, coord: CoordinatorDep) -> RunConfig:
    return await run_in_threadpool(coord.run_config, run)


@router.post("/runs/{run}/evaluate", response_model=protocol.EvalPoint)
async def evaluate(run: str, request: Request, coord: CoordinatorDep, _: AdminDep) -> protocol.EvalPoint:
    """Evaluate the current global model now (operators; the merger also does it every eval_every)."""
    if not coord.leads:  # the live model is in another coordinator process
        return await relay.forward(request, b"", coord)
    return await run_in_threadpool(coord.evaluate_now, run)


@router.post("/runs/{run}/pause", response_model=protocol.RunSummary)
async def pause_run(run: str, coord: CoordinatorDep, _: AdminDep) -> protocol.RunSummary:
    """Stop handing out leases (live leases may still deliver)."""
    return await run_in_threadpool(coord.set_run_state, run, "paused")


@router.post("/runs/{run}/resume", response_model=protocol.RunSummary)
async def resume_run(run: str, coord: CoordinatorDep, _: AdminDep) -> protocol.RunSummary:
    return await run_in_threadpool(coord.set_run_state, run, "active")
