"""Runs (RunService): create (operator), list, config, pause and resume."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool

from coordinator.api.deps import AdminDep, CoordinatorDep
from shared import protocol
from shared.config import RunConfig

router = APIRouter(prefix=protocol.API_PREFIX, tags=["runs"])


@router.post("/runs", status_code=201, response_model=protocol.RunCreated)
async def create_run(cfg: RunConfig, coord: CoordinatorDep, _: AdminDep) -> protocol.RunCreated:
    """Create a training run: reads the corpus, cuts shards, initialises the model (version 0)."""
    return await run_in_threadpool(coord.runs.create, cfg)


@router.get("/runs", response_model=list[protocol.RunSummary])
async def list_runs(coord: CoordinatorDep) -> list[protocol.RunSummary]:
    return await run_in_threadpool(coord.runs.list)


# Public: neither the join key nor the corpus or data (paths on the coordinator's disk) leaves the operator.
@router.get("/runs/{run}/config", response_model=RunConfig, response_model_exclude={"join_key", "corpus", "data"})
async def run_config(run: str, coord: CoordinatorDep) -> RunConfig:
    return await run_in_threadpool(coord.runs.config, run)


@router.post("/runs/{run}/pause", response_model=protocol.RunSummary)
async def pause_run(run: str, coord: CoordinatorDep, _: AdminDep) -> protocol.RunSummary:
    """Stop handing out leases (live leases may still deliver)."""
    return await run_in_threadpool(coord.runs.set_state, run, "paused")


@router.post("/runs/{run}/resume", response_model=protocol.RunSummary)
async def resume_run(run: str, coord: CoordinatorDep, _: AdminDep) -> protocol.RunSummary:
    return await run_in_threadpool(coord.runs.set_state, run, "active")
