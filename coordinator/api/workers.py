"""Workers: registration, and the operator's list / revoke / readmit (WorkerService)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from coordinator.api.deps import AdminDep, CoordinatorDep, RowId
from shared import protocol

router = APIRouter(prefix=protocol.API_PREFIX, tags=["workers"])


@router.post("/runs/{run}/workers", status_code=201, response_model=protocol.RegisterResponse)
async def register(run: str, req: protocol.RegisterRequest, request: Request,
                   coord: CoordinatorDep) -> protocol.RegisterResponse:
    """Register a worker with a run; the token in the answer is shown only this once."""
    client = request.client.host if request.client else None
    return await run_in_threadpool(coord.workers.register, run, req, client=client)


@router.get("/runs/{run}/workers", response_model=list[protocol.WorkerInfo])
async def list_workers(run: str, coord: CoordinatorDep, _: AdminDep) -> list[protocol.WorkerInfo]:
    """Every worker of a run: contribution, standing (ok / throttled / banned) and why (operators)."""
    return await run_in_threadpool(coord.workers.list, run)


@router.post("/runs/{run}/workers/{worker_id}/revoke", response_model=protocol.WorkerInfo)
async def revoke_worker(run: str, worker_id: RowId, coord: CoordinatorDep, _: AdminDep) -> protocol.WorkerInfo:
    """Revoke a worker's token for good; its live lease goes back to the queue (operators)."""
    return await run_in_threadpool(coord.workers.revoke, run, worker_id)


@router.post("/runs/{run}/workers/{worker_id}/readmit", response_model=protocol.WorkerInfo)
async def readmit_worker(run: str, worker_id: RowId, coord: CoordinatorDep, _: AdminDep) -> protocol.WorkerInfo:
    """Lift a ban or throttle that robust merging imposed (operators)."""
    return await run_in_threadpool(coord.workers.readmit, run, worker_id)
