"""Runs (RunService, LifecycleService): create (operator), list, config, pause and resume; options,
finish, archive, delete (operator)."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from starlette.concurrency import run_in_threadpool

from coordinator.api import relay
from coordinator.api.deps import AdminDep, CoordinatorDep
from shared import protocol
from shared.config import RunConfig

router = APIRouter(prefix=protocol.API_PREFIX, tags=["runs"])


@router.post("/runs", status_code=201, response_model=protocol.RunCreated)
async def create_run(cfg: RunConfig, coord: CoordinatorDep, _: AdminDep) -> protocol.RunCreated:
    """Create a training run: reads the corpus, cuts shards, initialises the model (version 0)."""
    return await run_in_threadpool(coord.runs.create, cfg)


RunState = Literal["creating", "active", "paused", "finishing", "finished", "archived"]


@router.get("/runs", response_model=list[protocol.RunSummary])
async def list_runs(coord: CoordinatorDep, state: Annotated[RunState | None, Query(
        description="only the runs in this state; active ones come by priority, highest first")] = None,
                    ) -> list[protocol.RunSummary]:
    """The runs (public): a worker following the whole coordinator picks among the active ones."""
    return await run_in_threadpool(coord.runs.list, state)


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


@router.patch("/runs/{run}", response_model=protocol.RunSummary)
async def set_run_options(run: str, options: protocol.RunOptions, coord: CoordinatorDep,
                          _: AdminDep) -> protocol.RunSummary:
    """Change the run's token budget, epochs or priority (the fields the body names)."""
    return await run_in_threadpool(coord.lifecycle.set_options, run, options)


@router.post("/runs/{run}/finish", response_model=protocol.RunSummary)
async def finish_run(run: str, coord: CoordinatorDep, _: AdminDep, grace_s: Annotated[float | None, Query(
        ge=0, le=7 * 86400, description="give up the leases still out after this many seconds (default: wait for "
                                        "them to be delivered or to expire)")] = None) -> protocol.RunSummary:
    """Stop handing out leases; the run finishes (final evaluation, checkpoint, export) once the leases
    out are in."""
    return await run_in_threadpool(lambda: coord.lifecycle.finish(run, grace_s=grace_s))


# Archive and delete answered by the process holding the live models (a paused run's is finished
# first; a deleted run's is let go), relayed there by the others (coordinator/api/relay.py).
@router.post("/runs/{run}/archive", response_model=protocol.RunSummary)
async def archive_run(run: str, request: Request, coord: CoordinatorDep, _: AdminDep) -> protocol.RunSummary:
    """Keep a finished (or paused) run's final model, export and records; delete its bulky state."""
    if not coord.live.leads:
        return await relay.forward(request, b"", coord)
    return await run_in_threadpool(coord.lifecycle.archive, run)


@router.delete("/runs/{run}", response_model=protocol.RunDeleted)
async def delete_run(run: str, request: Request, coord: CoordinatorDep, _: AdminDep, force: Annotated[bool, Query(
        description="delete an active or finishing run too")] = False) -> protocol.RunDeleted:
    """Remove the run: every row and file of it."""
    if not coord.live.leads:
        return await relay.forward(request, b"", coord)
    return await run_in_threadpool(lambda: coord.lifecycle.delete(run, force=force))
