"""Workers: registration, leases, delta uploads, sparse exchanges."""

from __future__ import annotations

import hashlib
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response
from starlette.requests import ClientDisconnect
from starlette.concurrency import run_in_threadpool

from coordinator import timing
from coordinator.api import relay
from coordinator.api.deps import AdminDep, CoordinatorDep, CurrentWorker, RowId
from coordinator.errors import PayloadTooLarge, ServiceError
from shared import protocol

router = APIRouter(prefix=protocol.API_PREFIX, tags=["workers"])


@router.post("/runs/{run}/workers", status_code=201, response_model=protocol.RegisterResponse)
async def register(run: str, req: protocol.RegisterRequest, request: Request,
                   coord: CoordinatorDep) -> protocol.RegisterResponse:
    """Register a worker with a run; the token in the answer is shown only this once."""
    client = request.client.host if request.client else None
    return await run_in_threadpool(coord.register_worker, run, req, client=client)


@router.get("/runs/{run}/workers", response_model=list[protocol.WorkerInfo])
async def list_workers(run: str, coord: CoordinatorDep, _: AdminDep) -> list[protocol.WorkerInfo]:
    """Every worker of a run: contribution, standing (ok / throttled / banned) and why (operators)."""
    return await run_in_threadpool(coord.list_workers, run)


@router.post("/runs/{run}/workers/{worker_id}/revoke", response_model=protocol.WorkerInfo)
async def revoke_worker(run: str, worker_id: RowId, coord: CoordinatorDep, _: AdminDep) -> protocol.WorkerInfo:
    """Revoke a worker's token for good; its live lease goes back to the queue (operators)."""
    return await run_in_threadpool(coord.revoke_worker, run, worker_id)


@router.post("/runs/{run}/workers/{worker_id}/readmit", response_model=protocol.WorkerInfo)
async def readmit_worker(run: str, worker_id: RowId, coord: CoordinatorDep, _: AdminDep) -> protocol.WorkerInfo:
    """Lift a ban or throttle that robust merging imposed (operators)."""
    return await run_in_threadpool(coord.readmit_worker, run, worker_id)


@router.post("/runs/{run}/leases", response_model=protocol.Lease,
             responses={204: {"description": "no work right now; ask again after Retry-After seconds"}})
async def take_lease(run: str, coord: CoordinatorDep, worker: CurrentWorker,
                     keep: Annotated[int | None, Query(ge=0, le=2**31 - 1, description=(
                         "this worker's lease whose delta is still uploading: it stays live; every other "
                         "earlier lease of the worker is given up"))] = None) -> protocol.Lease | Response:
    """Lease a data shard and the model version to train it from."""
    lease = await run_in_threadpool(coord.grant_lease, run, worker, keep=keep)
    if lease is None:
        return Response(status_code=204, headers={"Retry-After": "2"})
    return lease


_OCTET = {"requestBody": {"required": True, "content": {
    "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}}


@router.post("/leases/{lease_id}/renew", response_model=protocol.LeaseRenewed)
async def renew_lease(lease_id: RowId, coord: CoordinatorDep, worker: CurrentWorker) -> protocol.LeaseRenewed:
    """Extend a live lease by the run's lease_ttl_s (workers renew while their round progresses)."""
    return await run_in_threadpool(coord.renew_lease, lease_id, worker)


@router.delete("/leases/{lease_id}", status_code=204, response_class=Response)
async def release_lease(lease_id: RowId, coord: CoordinatorDep, worker: CurrentWorker) -> Response:
    """Give a live lease up before training it (a worker stopping): its shard is free again at once."""
    await run_in_threadpool(coord.release_lease, lease_id, worker)
    return Response(status_code=204)


@router.post("/leases/{lease_id}/delta", status_code=202, response_model=protocol.DeltaAccepted,
             openapi_extra=_OCTET)
async def upload_delta(lease_id: RowId, request: Request, coord: CoordinatorDep,
                       worker: CurrentWorker) -> protocol.DeltaAccepted:
    """Upload the encoded delta of a lease. 202 once it is durably queued for merging."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip()
    if ctype != "application/octet-stream":
        raise ServiceError(f"send the delta as application/octet-stream, not {ctype or 'nothing'}")
    with timing.phase("body"):
        body = await read_capped(request, coord.settings.max_upload_bytes)
    return await run_in_threadpool(coord.accept_delta, lease_id, worker, body)


@router.post("/leases/{lease_id}/exchange", response_class=Response, openapi_extra=_OCTET, responses={
    200: {"content": {"application/octet-stream": {}}, "description": "the encoded correction (a delta envelope)"}})
async def exchange(lease_id: RowId, step: Annotated[int, Query(description="the local step just finished")],
                   request: Request, coord: CoordinatorDep, worker: CurrentWorker) -> Response:
    """A sparse exchange with the global model (algorithms sparta and sparta+diloco): the body is
    the worker's values at this step's seeded indices, the answer the correction it subtracts."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip()
    if ctype != "application/octet-stream":
        raise ServiceError(f"send the exchange as application/octet-stream, not {ctype or 'nothing'}")
    body = await read_capped(request, coord.settings.max_upload_bytes)
    if not coord.leads:  # the live model is in another coordinator process
        return await relay.forward(request, body, coord)
    answer = await run_in_threadpool(coord.exchange, lease_id, step, worker, body)
    return Response(answer, media_type="application/octet-stream",
                    headers={protocol.H_SHA256: hashlib.sha256(answer).hexdigest()})


async def read_capped(request: Request, cap: int) -> bytes:
    """The request body, refused with 413 as soon as it passes `cap` bytes (counted while streaming)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > cap:
        raise PayloadTooLarge(f"body of {declared} bytes exceeds the limit of {cap} bytes")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > cap:
                raise PayloadTooLarge(f"body exceeds the limit of {cap} bytes")
            chunks.append(chunk)
    except ClientDisconnect:  # the worker went away mid-upload: nothing was received, nothing changes
        raise ServiceError("the upload was cut off before its end; send it again") from None
    return b"".join(chunks)
