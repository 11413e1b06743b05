"""Leases: take one, renew it while its round progresses, give it up (LeaseService)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request, Response
from starlette.concurrency import run_in_threadpool

from coordinator.api.deps import CoordinatorDep, CurrentWorker, RowId, worker_api
from coordinator.ratelimit import client_key
from shared import protocol

router = APIRouter(prefix=protocol.API_PREFIX, tags=["leases"])


@router.post("/runs/{run}/leases", response_model=protocol.Lease,
             responses={204: {"description": "no work right now; ask again after Retry-After seconds"}})
async def take_lease(run: str, request: Request, coord: CoordinatorDep, worker: CurrentWorker,
                     keep: Annotated[int | None, Query(ge=0, le=2**31 - 1, description=(
                         "this worker's lease whose delta is still uploading: it stays live; every other "
                         "earlier lease of the worker is given up"))] = None) -> protocol.Lease | Response:
    """Lease a data shard and the model version to train it from (429 while the requester's address
    holds max_leases_per_address live leases of the run)."""
    client = client_key(request.client.host if request.client else None)
    lease = await run_in_threadpool(coord.leases.grant, run, worker, keep=keep, client=client,
                                    api_version=worker_api(request))
    if lease is None:
        return Response(status_code=204, headers={"Retry-After": "2"})
    return lease


@router.post("/leases/{lease_id}/renew", response_model=protocol.LeaseRenewed)
async def renew_lease(lease_id: RowId, coord: CoordinatorDep, worker: CurrentWorker,
                      step: Annotated[int | None, Query(ge=0, le=2**31 - 1, description=(
                          "the round's local step now; it must be past the one the last renewal reported"))]
                      = None) -> protocol.LeaseRenewed:
    """Extend a live lease by the run's lease_ttl_s while its round progresses (each renewal reports a
    later local step), up to the lease's lifetime cap (a few of the run's expected rounds)."""
    return await run_in_threadpool(coord.leases.renew, lease_id, worker, step=step)


@router.get("/leases/{lease_id}", response_model=protocol.LeaseStanding)
async def lease_standing(lease_id: RowId, coord: CoordinatorDep, worker: CurrentWorker) -> protocol.LeaseStanding:
    """Whether a lease of this worker still stands: a worker resuming a saved round asks before it
    trains on (403 for another worker's lease, 404 for none)."""
    return await run_in_threadpool(coord.leases.standing, lease_id, worker)


@router.delete("/leases/{lease_id}", status_code=204, response_class=Response)
async def release_lease(lease_id: RowId, coord: CoordinatorDep, worker: CurrentWorker) -> Response:
    """Give a live lease up before training it (a worker stopping): its shard is free again at once."""
    await run_in_threadpool(coord.leases.release, lease_id, worker)
    return Response(status_code=204)
